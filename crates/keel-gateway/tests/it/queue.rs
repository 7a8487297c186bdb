//! The wait line of a full pool: served by priority (`x-keel-priority`) then deadline, and
//! refused at once with 429/503, `retry-after` from the measured drain rate and
//! `x-keel-route: throttled`, when it is full or the expected wait is longer than allowed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel_sim::{Fleet, ServerConfig};
use serde_json::json;

use crate::harness::*;

/// One server whose every answer takes about `ttft_ms`; keel may run one request on it at once.
async fn one_slot(ttft_ms: f64, pool_extra: &str) -> Harness {
    let cfg = ServerConfig {
        ttft_ms,
        ..ServerConfig::fast("s")
    };
    let fleet = Fleet::start_n(1, cfg).await.unwrap();
    let mut config = pool_over(
        &fleet,
        "p",
        "openai",
        1,
        &format!("hedge = \"off\"\nqueue_ms = 60000\n{pool_extra}"),
    );
    config.push_str("max_concurrency = 1\n");
    Harness::start(fleet, &config).await
}

/// What one client saw.
#[derive(Debug)]
struct Answer {
    status: u16,
    route: String,
    retry_after_ms: Option<u64>,
    /// Place in the order in which answers arrived.
    order: usize,
}

/// Sends a request with `headers` in the background; its answer is numbered by arrival.
fn send(
    h: &Harness,
    headers: &[(&str, &str)],
    done: &Arc<AtomicUsize>,
) -> tokio::task::JoinHandle<Answer> {
    let mut req = keel_sim::http_client()
        .post(h.url("/v1/chat/completions"))
        .json(&json!({"model": "p", "max_tokens": 16,
                      "messages": [{"role": "user", "content": "wait your turn"}]}));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let done = done.clone();
    tokio::spawn(async move {
        let r = req.send().await.expect("gateway reachable");
        let status = r.status().as_u16();
        let route = header(r.headers(), "x-keel-route").to_owned();
        let retry_after_ms = r
            .headers()
            .get("retry-after-ms")
            .and_then(|v| v.to_str().ok()?.parse().ok());
        let _ = r.bytes().await;
        Answer {
            status,
            route,
            retry_after_ms,
            order: done.fetch_add(1, Ordering::SeqCst),
        }
    })
}

/// Waits until the line holds `n` requests of `priority`.
async fn until_waiting(h: &Harness, priority: &str, n: f64) {
    for _ in 0..500 {
        if h.metric("keel_queue_depth", &[("priority", priority)])
            .await
            == n
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the line never held {n} {priority}-priority requests");
}

/// Waits until the variant runs a request.
async fn until_running(h: &Harness) {
    for _ in 0..500 {
        if h.server(0).state.stats().running > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the variant never ran a request");
}

#[tokio::test]
async fn high_priority_requests_are_served_before_low_ones_that_queued_earlier() {
    let h = one_slot(400.0, "").await;
    let done = Arc::new(AtomicUsize::new(0));
    let blocker = send(&h, &[], &done);
    until_running(&h).await;
    let low: Vec<_> = (0..2)
        .map(|_| send(&h, &[("x-keel-priority", "low")], &done))
        .collect();
    until_waiting(&h, "low", 2.0).await;
    let high: Vec<_> = (0..2)
        .map(|_| send(&h, &[("x-keel-priority", "HIGH")], &done))
        .collect();
    until_waiting(&h, "high", 2.0).await;
    assert_eq!(blocker.await.unwrap().status, 200);
    let mut high_order = Vec::new();
    for t in high {
        let a = t.await.unwrap();
        assert_eq!((a.status, a.route.as_str()), (200, "direct"), "{a:?}");
        high_order.push(a.order);
    }
    for t in low {
        let a = t.await.unwrap();
        assert_eq!(a.status, 200, "{a:?}");
        assert!(
            high_order.iter().all(|h| *h < a.order),
            "low answered {} before the high ones {high_order:?}",
            a.order
        );
    }
    assert_eq!(h.metric("keel_queue_depth", &[]).await, 0.0);
    assert!(h.metrics().await.contains("keel_queue_wait_seconds"));
}

#[tokio::test]
async fn while_high_priority_traffic_is_seen_a_share_of_capacity_stays_free_for_it() {
    // Four slots; `priority_reserve = 0.25` keeps one for high priority once any was seen.
    let cfg = ServerConfig {
        ttft_ms: 400.0,
        ..ServerConfig::fast("s")
    };
    let fleet = Fleet::start_n(1, cfg).await.unwrap();
    let mut config = pool_over(
        &fleet,
        "p",
        "openai",
        1,
        "hedge = \"off\"\nqueue_ms = 60000\n",
    );
    config.push_str("max_concurrency = 4\n");
    let h = Harness::start(fleet, &config).await;
    let done = Arc::new(AtomicUsize::new(0));
    assert_eq!(
        send(&h, &[("x-keel-priority", "high")], &done)
            .await
            .unwrap()
            .status,
        200
    );
    // Four low ones: three run, the fourth waits although a slot is free.
    let low: Vec<_> = (0..4)
        .map(|_| send(&h, &[("x-keel-priority", "low")], &done))
        .collect();
    until_waiting(&h, "low", 1.0).await;
    assert_eq!(h.server(0).state.stats().running, 3);
    // A high one arriving now takes the kept slot at once, ahead of the waiting low one.
    let high = send(&h, &[("x-keel-priority", "high")], &done)
        .await
        .unwrap();
    assert_eq!((high.status, high.route.as_str()), (200, "direct"));
    let mut orders: Vec<usize> = Vec::new();
    for t in low {
        let a = t.await.unwrap();
        assert_eq!(a.status, 200, "{a:?}");
        orders.push(a.order);
    }
    assert!(
        high.order < *orders.iter().max().unwrap(),
        "the high request ({}) waited behind every low one ({orders:?})",
        high.order
    );
}

#[tokio::test]
async fn a_short_deadline_behind_a_long_line_is_refused_at_once_with_retry_after() {
    let h = one_slot(150.0, "").await;
    let done = Arc::new(AtomicUsize::new(0));
    // Serve a few first: the drain rate is measured from slots freed.
    for _ in 0..3 {
        assert_eq!(send(&h, &[], &done).await.unwrap().status, 200);
    }
    let blocker = send(&h, &[], &done);
    until_running(&h).await;
    let waiting: Vec<_> = (0..3).map(|_| send(&h, &[], &done)).collect();
    until_waiting(&h, "normal", 3.0).await;
    // Four requests ahead of it at about 150 ms each: far more than its 50 ms.
    let hurried = send(&h, &[("x-keel-timeout-ms", "50")], &done)
        .await
        .unwrap();
    assert_eq!(hurried.status, 503, "{hurried:?}");
    assert_eq!(hurried.route, "throttled");
    let ms = hurried.retry_after_ms.expect("retry-after-ms");
    // The expected wait for its place: four slots to free at the measured rate (one per
    // 150 ms or so, slower on a loaded machine), never zero.
    assert!(ms >= 100, "retry-after-ms {ms}");
    assert_eq!(
        h.metric(
            "keel_queue_refused_total",
            &[("pool", "p"), ("reason", "deadline")]
        )
        .await,
        1.0
    );
    // Nothing else was refused: everyone else ends with an answer.
    assert_eq!(blocker.await.unwrap().status, 200);
    for t in waiting {
        assert_eq!(t.await.unwrap().status, 200);
    }
}

#[tokio::test]
async fn a_full_line_refuses_its_priority_and_a_higher_one_displaces_the_last() {
    let h = one_slot(300.0, "queue_max = 1").await;
    let done = Arc::new(AtomicUsize::new(0));
    let blocker = send(&h, &[], &done);
    until_running(&h).await;
    let low = send(&h, &[("x-keel-priority", "low")], &done);
    until_waiting(&h, "low", 1.0).await;
    // Full for low priority: refused at once.
    let second_low = send(&h, &[("x-keel-priority", "low")], &done)
        .await
        .unwrap();
    assert_eq!(
        (second_low.status, second_low.route.as_str()),
        (429, "throttled")
    );
    assert!(second_low.retry_after_ms.is_some_and(|ms| ms >= 1));
    // A normal-priority request takes the waiting low one's place; the low one is refused.
    let normal = send(&h, &[], &done);
    let displaced = low.await.unwrap();
    assert_eq!(
        (displaced.status, displaced.route.as_str()),
        (429, "throttled"),
        "{displaced:?}"
    );
    assert!(displaced.retry_after_ms.is_some());
    assert_eq!(blocker.await.unwrap().status, 200);
    assert_eq!(normal.await.unwrap().status, 200);
    for (reason, n) in [("full", 1.0), ("displaced", 1.0)] {
        assert_eq!(
            h.metric("keel_queue_refused_total", &[("reason", reason)])
                .await,
            n,
            "{reason}"
        );
    }
}

#[tokio::test]
async fn an_unknown_priority_is_a_clear_400() {
    let h = one_slot(1.0, "").await;
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-priority", "urgent")],
            &chat_body("hi"),
        )
        .await;
    assert_eq!(r.status().as_u16(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("x-keel-priority must be high, normal or low"));
}
