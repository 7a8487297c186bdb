//! The driven body on its own: order, backpressure, clean end against a vanished or panicking
//! producer, and a producer that outlives its body.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http_body_util::BodyExt;
use tokio::sync::oneshot;

use super::*;

fn block(i: usize) -> Bytes {
    Bytes::from(format!("data: {i}\n\n"))
}

/// Reads data frames until the body ends or fails; the error, if any, comes last.
async fn read_all(mut body: Body) -> (Vec<Bytes>, Option<io::Error>) {
    let mut frames = Vec::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => frames.extend(f.into_data().ok()),
            Err(e) => return (frames, Some(e)),
        }
    }
    (frames, None)
}

#[tokio::test]
async fn blocks_arrive_in_order_and_an_explicit_end_is_a_clean_end() {
    let (tx, body, driver) = driven(Protocol::OpenAi);
    driver.run(async move {
        for i in 0..50 {
            assert!(tx.send(block(i)).await);
            // Blocks sent across the producer's own waits keep their order too.
            if i % 7 == 0 {
                tokio::task::yield_now().await;
            }
        }
        tx.end().await;
    });
    let (frames, err) = read_all(body).await;
    assert!(err.is_none());
    assert_eq!(frames, (0..50).map(block).collect::<Vec<_>>());
}

#[tokio::test]
async fn the_producer_runs_on_the_task_that_reads_the_body() {
    let (tx, body, driver) = driven(Protocol::OpenAi);
    let (seen_tx, seen_rx) = oneshot::channel();
    driver.run(async move {
        let _ = seen_tx.send(tokio::task::try_id());
        tx.send(block(0)).await;
        tx.end().await;
    });
    let reader = tokio::spawn(async move {
        let me = tokio::task::try_id();
        read_all(body).await;
        me
    });
    let reader_id = reader.await.unwrap();
    assert!(reader_id.is_some());
    assert_eq!(seen_rx.await.unwrap(), reader_id, "no task of its own");
}

#[tokio::test]
async fn a_slow_reader_holds_the_producer_back() {
    let (tx, mut body, driver) = driven(Protocol::OpenAi);
    let sent = Arc::new(AtomicUsize::new(0));
    let count = sent.clone();
    driver.run(async move {
        for i in 0..1000 {
            if !tx.send(block(i)).await {
                return;
            }
            count.fetch_add(1, Ordering::Relaxed);
        }
        tx.end().await;
    });
    for read in 1..=20 {
        let f = body.frame().await.unwrap().unwrap();
        assert_eq!(f.into_data().unwrap(), block(read - 1));
        // The producer only runs when the queue is empty, and then queues at most a full queue.
        let ahead = sent.load(Ordering::Relaxed);
        assert!(
            ahead <= read + QUEUE_BLOCKS,
            "{ahead} sent after {read} read"
        );
    }
}

#[tokio::test]
async fn a_vanished_producer_is_an_error_event_then_a_failure() {
    for protocol in [Protocol::OpenAi, Protocol::Anthropic] {
        let (tx, body, driver) = driven(protocol);
        driver.run(async move {
            tx.send(block(0)).await;
            // Dropped without `end`.
        });
        let (frames, err) = read_all(body).await;
        assert_eq!(frames.len(), 2, "{frames:?}");
        let text = std::str::from_utf8(&frames[1]).unwrap();
        assert!(text.contains("the response is incomplete"), "{text}");
        if protocol == Protocol::Anthropic {
            assert!(text.starts_with("event: error\n"), "{text}");
        }
        assert!(err.is_some());
    }
}

#[tokio::test]
async fn a_panicking_producer_is_caught_and_the_stream_aborts() {
    let (tx, body, driver) = driven(Protocol::OpenAi);
    driver.run(async move {
        tx.send(block(0)).await;
        tokio::task::yield_now().await;
        panic!("the producer fails");
    });
    let (frames, err) = read_all(body).await;
    assert_eq!(frames[0], block(0));
    assert!(std::str::from_utf8(&frames[1])
        .unwrap()
        .contains("incomplete"));
    assert!(err.is_some());
}

#[tokio::test]
async fn a_driver_dropped_without_a_producer_aborts_the_stream() {
    let (_tx, body, driver) = driven(Protocol::OpenAi);
    let reader = tokio::spawn(read_all(body));
    tokio::task::yield_now().await;
    drop(driver);
    let (frames, err) = reader.await.unwrap();
    assert_eq!(frames.len(), 1, "only the error event");
    assert!(err.is_some());
}

#[tokio::test]
async fn a_body_read_before_its_producer_is_handed_over_waits_for_it() {
    let (tx, body, driver) = driven(Protocol::OpenAi);
    let reader = tokio::spawn(read_all(body));
    tokio::task::yield_now().await;
    driver.run(async move {
        tx.send(block(7)).await;
        tx.end().await;
    });
    let (frames, err) = reader.await.unwrap();
    assert_eq!(frames, vec![block(7)]);
    assert!(err.is_none());
}

/// A producer that sends a block, then waits for its client to leave and reports what it saw.
fn outliving_producer(tx: BodySender) -> (impl Future<Output = ()>, oneshot::Receiver<bool>) {
    let (done_tx, done_rx) = oneshot::channel();
    let producer = async move {
        tx.send(block(0)).await;
        tx.closed().await;
        // Still running after its body is gone: sends fail, the end is up to it.
        let _ = done_tx.send(tx.send(block(1)).await);
    };
    (producer, done_rx)
}

#[tokio::test]
async fn a_dropped_body_hands_its_unfinished_producer_to_a_task() {
    let (tx, mut body, driver) = driven(Protocol::OpenAi);
    let (producer, done) = outliving_producer(tx);
    driver.run(producer);
    body.frame().await.unwrap().unwrap();
    // The client leaves mid-stream.
    drop(body);
    assert!(
        !done.await.expect("the producer ran to its end"),
        "a send after the client left fails"
    );
}

#[tokio::test]
async fn a_producer_handed_to_a_dropped_body_still_runs() {
    let (tx, body, driver) = driven(Protocol::OpenAi);
    drop(body);
    let (producer, done) = outliving_producer(tx);
    driver.run(producer);
    assert!(!done.await.expect("the producer ran to its end"));
}
