//! The direct pool against plain TCP servers written here byte by byte, so that each test
//! controls exactly when the server answers, streams and closes.

use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::*;

/// What the test server does with one request on a connection.
#[derive(Clone, Copy)]
enum Answer {
    /// A keep-alive response with a length.
    Whole,
    /// The same, then the server closes the connection without saying so.
    WholeThenClose,
    /// A chunked response: one chunk now, the next and the end when the test says.
    Streamed,
}

struct Server {
    url: String,
    accepted: Arc<AtomicUsize>,
    /// Each request's head, as received.
    heads: mpsc::UnboundedReceiver<String>,
    /// Releases the rest of a streamed response.
    go_on: mpsc::UnboundedSender<()>,
}

async fn server(answer: Answer) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/v1/chat/completions",
        listener.local_addr().unwrap()
    );
    let accepted = Arc::new(AtomicUsize::new(0));
    let (heads_tx, heads) = mpsc::unbounded_channel();
    let (go_on, go_rx) = mpsc::unbounded_channel::<()>();
    let go_rx = Arc::new(tokio::sync::Mutex::new(go_rx));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = listener.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            let heads_tx = heads_tx.clone();
            let go_rx = Arc::clone(&go_rx);
            tokio::spawn(async move {
                loop {
                    let Some(head) = read_request(&mut sock).await else {
                        return;
                    };
                    heads_tx.send(head).unwrap();
                    let ok = match answer {
                        Answer::Whole | Answer::WholeThenClose => sock
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
                            .await
                            .is_ok(),
                        Answer::Streamed => {
                            let first = sock
                                .write_all(
                                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n",
                                )
                                .await;
                            go_rx.lock().await.recv().await;
                            first.is_ok()
                                && sock.write_all(b"6\r\nsecond\r\n0\r\n\r\n").await.is_ok()
                        }
                    };
                    if matches!(answer, Answer::WholeThenClose) {
                        // After the client has taken the response as a keep-alive one.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        return;
                    }
                    if !ok {
                        return;
                    }
                }
            });
        }
    });
    Server {
        url,
        accepted,
        heads,
        go_on,
    }
}

/// A request's head, read byte by byte (so nothing after it is taken): what a server with a
/// body limit reads before refusing. `None` at the connection's end.
async fn read_head(sock: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if sock.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    Some(String::from_utf8(buf).unwrap())
}

/// One request's head (its body, of the length it declares, is read and dropped); `None` when
/// the client closed the connection.
async fn read_request(sock: &mut TcpStream) -> Option<String> {
    let head = read_head(sock).await?;
    let len: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length: ")
                .map(str::to_owned)
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    sock.read_exact(&mut body).await.ok()?;
    Some(head)
}

/// A server on a fresh loopback port that runs `conn` on each connection it accepts: its URL,
/// and how many connections it has accepted.
async fn serve_each<F, Fut>(conn: F) -> (String, Arc<AtomicUsize>)
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/x", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        loop {
            let (sock, _) = listener.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(conn(sock));
        }
    });
    (url, accepted)
}

fn pool() -> Arc<Direct> {
    Arc::new(Direct::new(
        Duration::from_secs(2),
        metrics::Counter::noop(),
    ))
}

async fn post(pool: &Arc<Direct>, url: &str) -> Result<Response, GatewayError> {
    pool.send(
        Target::of(url).unwrap(),
        None,
        HeaderMap::new(),
        Bytes::from_static(b"{\"x\":1}"),
    )
    .await
}

async fn read_all(mut body: super::super::Body) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(c) = body.next().await {
        out.extend_from_slice(&c.unwrap());
    }
    out
}

#[test]
fn only_plain_http_without_credentials_is_direct() {
    let t = Target::of("http://127.0.0.1:8000/v1/chat/completions").unwrap();
    assert_eq!(&*t.authority, "127.0.0.1:8000");
    assert_eq!(&*t.path, "/v1/chat/completions");
    let t = Target::of("http://vllm.internal/v1/messages?beta=true").unwrap();
    assert_eq!(&*t.authority, "vllm.internal:80");
    assert_eq!(t.host, "vllm.internal");
    assert_eq!(&*t.path, "/v1/messages?beta=true");
    assert!(Target::of("https://api.openai.com/v1/chat/completions").is_none());
    assert!(Target::of("http://user:secret@host:8000/v1").is_none());
}

/// A thread keeps the URLs it read: the same reading every time, the refusals too, and no more
/// than it keeps room for.
#[test]
fn a_url_is_read_as_a_target_once_per_thread() {
    let d = Direct::new(Duration::from_secs(1), metrics::Counter::noop());
    for _ in 0..2 {
        let t = d
            .target("http://127.0.0.1:8000/v1/chat/completions")
            .unwrap();
        assert_eq!(
            (&*t.authority, &*t.path),
            ("127.0.0.1:8000", "/v1/chat/completions")
        );
        assert!(d
            .target("https://api.openai.com/v1/chat/completions")
            .is_none());
    }
    for i in 0..(2 * TARGETS_KEPT) {
        let t = d.target(&format!("http://h{i}/v1")).unwrap();
        assert_eq!(t.host, format!("h{i}").as_str());
    }
    assert_eq!(d.targets.own().len(), TARGETS_KEPT);
}

#[tokio::test]
async fn requests_read_to_their_end_share_one_connection() {
    let mut s = server(Answer::Whole).await;
    let pool = pool();
    for _ in 0..5 {
        let resp = post(&pool, &s.url).await.unwrap();
        assert_eq!(resp.status, 200);
        assert_eq!(read_all(resp.body).await, b"hello");
        let head = s.heads.recv().await.unwrap();
        assert!(
            head.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"),
            "{head}"
        );
        let host = s.url.split('/').nth(2).unwrap();
        assert!(
            head.to_ascii_lowercase()
                .contains(&format!("host: {host}\r\n")),
            "{head}"
        );
        assert!(head.contains("content-length: 7\r\n"), "{head}");
    }
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1);
}

/// A connection the server closed while it sat idle (a keep-alive timeout) is found closed at
/// checkout and the request goes on a new one, with no error.
#[tokio::test]
async fn a_connection_closed_while_idle_is_not_reused() {
    let mut s = server(Answer::WholeThenClose).await;
    let pool = pool();
    for i in 1..=3 {
        let resp = post(&pool, &s.url).await.unwrap();
        assert_eq!(read_all(resp.body).await, b"hello");
        s.heads.recv().await.unwrap();
        assert_eq!(idle(&pool), 1);
        // Let the server's close arrive.
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert_eq!(s.accepted.load(Ordering::SeqCst), i);
    }
}

/// A streamed body's chunks reach the reader as the server writes them, with no task driving
/// the connection but the reader's.
#[tokio::test]
async fn streamed_chunks_arrive_before_the_end_and_the_connection_is_reused() {
    let s = server(Answer::Streamed).await;
    let pool = pool();
    for round in 1..=2 {
        let resp = post(&pool, &s.url).await.unwrap();
        let mut body = resp.body;
        let first = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .expect("the first chunk before the server's end")
            .unwrap()
            .unwrap();
        assert_eq!(&first[..], b"first");
        s.go_on.send(()).unwrap();
        assert_eq!(read_all(body).await, b"second");
        assert_eq!(s.accepted.load(Ordering::SeqCst), 1, "round {round}");
    }
}

/// The relay drops a body at the stream's terminal event, usually before the transfer's own
/// end has been read: when that end is already received, the connection is kept.
#[tokio::test]
async fn a_body_dropped_with_its_end_received_keeps_its_connection() {
    let (url, accepted) = serve_each(|mut sock| async move {
        while read_request(&mut sock).await.is_some() {
            let all = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n6\r\nsecond\r\n0\r\n\r\n";
            if sock.write_all(all).await.is_err() {
                return;
            }
        }
    })
    .await;
    let pool = pool();
    for _ in 0..3 {
        let mut body = post(&pool, &url).await.unwrap().body;
        // Both chunks arrived together, and are handed over together.
        assert_eq!(&body.next().await.unwrap().unwrap()[..], b"firstsecond");
        drop(body);
        assert_eq!(idle(&pool), 1);
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

/// Dropped after its reader saw the last event, while the transfer's end is still on its way,
/// a body waits a moment for it.
#[tokio::test]
async fn a_body_dropped_just_before_its_end_keeps_its_connection() {
    let s = server(Answer::Streamed).await;
    let pool = pool();
    let mut body = post(&pool, &s.url).await.unwrap().body;
    assert_eq!(&body.next().await.unwrap().unwrap()[..], b"first");
    body.as_mut().reached_end();
    drop(body);
    assert_eq!(idle(&pool), 0);
    s.go_on.send(()).unwrap();
    for _ in 0..200 {
        if idle(&pool) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(idle(&pool), 1);
}

/// A body dropped whose end does not come (a stalled stream left for another variant, a
/// client gone mid-generation) closes its connection: the upstream sees the client gone, and
/// the next request opens a new connection.
#[tokio::test]
async fn a_body_dropped_far_from_its_end_closes_its_connection() {
    let s = server(Answer::Streamed).await;
    let pool = pool();
    let mut body = post(&pool, &s.url).await.unwrap().body;
    assert_eq!(&body.next().await.unwrap().unwrap()[..], b"first");
    drop(body);
    tokio::time::sleep(DRAIN_WAIT * 2).await;
    s.go_on.send(()).unwrap();
    assert_eq!(idle(&pool), 0);
    let resp = post(&pool, &s.url).await.unwrap();
    s.go_on.send(()).unwrap();
    assert_eq!(read_all(resp.body).await, b"firstsecond");
    assert_eq!(s.accepted.load(Ordering::SeqCst), 2);
}

/// A body given up mid-response (its reader never saw the last event: a client gone, a hedge's
/// loser) closes its connection at once rather than waiting for the end: the upstream stops
/// generating now. Here the end comes right after the drop; a body that waited for it would
/// keep the connection (the test above), this one must not.
#[tokio::test]
async fn a_body_given_up_closes_its_connection_without_waiting_for_the_end() {
    let s = server(Answer::Streamed).await;
    let pool = pool();
    let mut body = post(&pool, &s.url).await.unwrap().body;
    assert_eq!(&body.next().await.unwrap().unwrap()[..], b"first");
    drop(body);
    s.go_on.send(()).unwrap();
    // Longer than a waiting body would need to see the end arrive and keep the connection.
    tokio::time::sleep(DRAIN_WAIT).await;
    assert_eq!(idle(&pool), 0, "the connection of a body given up was kept");
    let resp = post(&pool, &s.url).await.unwrap();
    s.go_on.send(()).unwrap();
    assert_eq!(read_all(resp.body).await, b"firstsecond");
    assert_eq!(s.accepted.load(Ordering::SeqCst), 2);
}

/// An idle connection its server closes (a keep-alive timeout) is dropped by the sweep, not
/// kept in `CLOSE_WAIT` until the next request; one the server keeps open stays.
#[tokio::test]
async fn idle_connections_their_servers_closed_are_swept() {
    let pool = Arc::new(Direct::sweeping_every(
        Duration::from_secs(2),
        metrics::Counter::noop(),
        Duration::from_millis(10),
    ));
    let open = server(Answer::Whole).await;
    let closing = server(Answer::WholeThenClose).await;
    for url in [&open.url, &closing.url] {
        let resp = post(&pool, url).await.unwrap();
        assert_eq!(read_all(resp.body).await, b"hello");
    }
    assert_eq!(idle(&pool), 2);
    for _ in 0..500 {
        if idle(&pool) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(idle(&pool), 1, "the closed connection was not swept");
    // Several sweeps later the open one is still there, and reused.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(idle(&pool), 1);
    let resp = post(&pool, &open.url).await.unwrap();
    assert_eq!(read_all(resp.body).await, b"hello");
    assert_eq!(open.accepted.load(Ordering::SeqCst), 1);
}

fn idle(pool: &Direct) -> usize {
    pool.idle.all().iter().map(|q| q.len()).sum()
}

#[tokio::test]
async fn a_refused_connection_is_reported_as_refused() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = post(
        &pool(),
        &format!("http://127.0.0.1:{port}/v1/chat/completions"),
    )
    .await
    .err()
    .expect("nothing listens");
    assert_eq!(e.kind, ErrorKind::Refused, "{}", e.message);
}

/// A body's pieces, joined, up to its end: `Some` with the error it ended in.
async fn read_until_end(body: &mut super::super::Body) -> (Vec<u8>, Option<GatewayError>) {
    let mut got = Vec::new();
    while let Some(piece) = body.next().await {
        match piece {
            Ok(c) => got.extend_from_slice(&c),
            Err(e) => return (got, Some(e)),
        }
    }
    (got, None)
}

/// A server that closes in the middle of a response: the reader gets an error, not a clean end.
#[tokio::test]
async fn a_body_cut_short_is_an_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/x", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        read_request(&mut sock).await.unwrap();
        sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")
            .await
            .unwrap();
    });
    let resp = post(&pool(), &url).await.unwrap();
    let mut body = resp.body;
    let (got, end) = read_until_end(&mut body).await;
    assert_eq!(got, b"part");
    let e = end.expect("an error, not a clean end");
    assert_eq!(e.kind, ErrorKind::Io);
    assert!(body.next().await.is_none(), "fused after the error");
}

/// A chunked response whose chunks arrive together (a fast server frames every event as a
/// chunk of its own) is handed over in a few pieces, not a piece a chunk: what one read brought
/// at once, and the rest of a burst that filled the buffer with it.
#[tokio::test]
async fn chunks_that_arrive_together_are_handed_over_together() {
    let event = format!("data: {}\n\n", "x".repeat(150));
    let mut wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..60 {
        wire.extend_from_slice(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes());
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    let wire = Arc::new(wire);
    let (url, _) = serve_each(move |mut sock| {
        let wire = Arc::clone(&wire);
        async move {
            read_request(&mut sock).await.unwrap();
            sock.write_all(&wire).await.unwrap();
            // Held open: the body ends by its framing, not by the close.
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    })
    .await;
    let mut body = post(&pool(), &url).await.unwrap().body;
    let mut pieces = Vec::new();
    while let Some(piece) = body.next().await {
        pieces.push(piece.unwrap());
    }
    let got: Vec<u8> = pieces.concat();
    assert_eq!(got, event.repeat(60).into_bytes());
    // 60 chunks, 9.5 KB: three 4 KiB reads at most, each handed over whole.
    assert!(pieces.len() <= 4, "{} pieces", pieces.len());
}

/// Chunks decoded before a framing error reach the reader first; the error follows.
#[tokio::test]
async fn chunks_before_a_framing_error_are_handed_over_then_the_error() {
    let (url, _) = serve_each(|mut sock| async move {
        read_request(&mut sock).await.unwrap();
        sock.write_all(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n6\r\nsecond\r\nzz\r\n",
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
    })
    .await;
    let mut body = post(&pool(), &url).await.unwrap().body;
    let (got, end) = read_until_end(&mut body).await;
    assert_eq!(got, b"firstsecond");
    let e = end.expect("the framing error, not a clean end");
    assert!(e.message.contains("bad chunk size"), "{}", e.message);
}

/// A response head larger than the read buffer grows it; one over the limit fails the attempt
/// with a clear message.
#[tokio::test]
async fn a_response_head_over_the_read_buffer_is_read_up_to_the_limit() {
    let (url, _) = serve_each(|mut sock| async move {
        let mut size = exchange::READ_BUF * 3;
        while read_request(&mut sock).await.is_some() {
            let big = "x".repeat(size);
            let head = format!("HTTP/1.1 200 OK\r\nx-big: {big}\r\ncontent-length: 5\r\n\r\nhello");
            if sock.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            size = exchange::MAX_HEAD;
        }
    })
    .await;
    let pool = pool();
    let resp = post(&pool, &url).await.unwrap();
    assert_eq!(resp.headers["x-big"].len(), exchange::READ_BUF * 3);
    assert_eq!(read_all(resp.body).await, b"hello");
    let e = post(&pool, &url)
        .await
        .err()
        .expect("the second head is over the limit");
    assert_eq!(e.kind, ErrorKind::Io);
    assert!(
        e.message.contains("larger than 65536 bytes"),
        "{}",
        e.message
    );
}

/// A connection's server closing it just as it is reused (the request written, no answer):
/// the request goes again on a new connection, with no error.
#[tokio::test]
async fn a_reused_connection_closed_without_an_answer_is_retried_on_a_new_one() {
    let (url, accepted) = serve_each(|mut sock| async move {
        // Answers one request, then reads the next and closes without a word.
        read_request(&mut sock).await.unwrap();
        sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
            .await
            .unwrap();
        read_request(&mut sock).await;
    })
    .await;
    let pool = pool();
    for _ in 0..3 {
        let resp = post(&pool, &url).await.unwrap();
        assert_eq!(read_all(resp.body).await, b"hello");
    }
    // The second and third went first on the connection kept, then on a new one.
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

/// A body without a length or chunks ends at the close, and its connection is not kept.
#[tokio::test]
async fn a_body_ended_by_the_close_is_whole_and_its_connection_not_kept() {
    let (url, _) = serve_each(|mut sock| async move {
        read_request(&mut sock).await.unwrap();
        let _ = sock
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n")
            .await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        let _ = sock.write_all(b"data: [DONE]\n\n").await;
    })
    .await;
    let pool = pool();
    let resp = post(&pool, &url).await.unwrap();
    assert_eq!(read_all(resp.body).await, b"data: 1\n\ndata: [DONE]\n\n");
    assert_eq!(idle(&pool), 0);
}

/// A burst of streams at a variant with a cap of two opens two connections; the rest wait for
/// one of them and are served on it when it is checked back in.
#[tokio::test]
async fn a_capped_variant_never_holds_more_connections_than_its_cap() {
    let mut s = server(Answer::Streamed).await;
    let pool = pool();
    let cap = Cap::new(2, None);
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let (pool, url, cap) = (pool.clone(), s.url.clone(), cap.clone());
            tokio::spawn(async move {
                let resp = pool
                    .send(
                        Target::of(&url).unwrap(),
                        Some(&cap),
                        HeaderMap::new(),
                        Bytes::from_static(b"{}"),
                    )
                    .await
                    .unwrap();
                read_all(resp.body).await
            })
        })
        .collect();
    // Two streams started; the other three wait for a connection.
    s.heads.recv().await.unwrap();
    s.heads.recv().await.unwrap();
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(s.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(cap.held(), 2);
    for _ in 0..5 {
        s.go_on.send(()).unwrap();
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), b"firstsecond");
    }
    assert_eq!(s.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(cap.held(), 2, "both kept idle for the next requests");
    // An uncapped request to the same server does not take the capped connections.
    let resp = post(&pool, &s.url).await.unwrap();
    s.go_on.send(()).unwrap();
    assert_eq!(read_all(resp.body).await, b"firstsecond");
    assert_eq!(s.accepted.load(Ordering::SeqCst), 3);
}

/// A body larger than any socket buffer, so that the server can answer before it has all of it.
fn large_body() -> Bytes {
    Bytes::from(vec![b'x'; 32 << 20])
}

async fn post_large(pool: &Arc<Direct>, url: &str) -> Result<Response, GatewayError> {
    pool.send(
        Target::of(url).unwrap(),
        None,
        HeaderMap::new(),
        large_body(),
    )
    .await
}

const TOO_LARGE: &[u8] =
    b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 9\r\nconnection: close\r\n\r\ntoo large";

/// A server that refuses a body over its limit and closes without reading it (the close of a
/// socket with unread bytes resets the connection, so the rest of the write fails): its 413
/// is the answer, not the failed write.
#[tokio::test]
async fn an_answer_before_the_body_was_taken_is_the_response_when_the_server_then_resets() {
    let (url, _) = serve_each(|mut sock| async move {
        read_head(&mut sock).await.unwrap();
        sock.write_all(TOO_LARGE).await.unwrap();
        drop(sock);
    })
    .await;
    let pool = pool();
    let resp = post_large(&pool, &url).await.unwrap();
    assert_eq!(resp.status, http::StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(read_all(resp.body).await, b"too large");
    assert_eq!(idle(&pool), 0);
}

/// A server that answers early and then neither reads nor closes: the answer comes at once,
/// rather than a write waiting for a reader that never comes, and the connection is not kept
/// (the request was not sent whole).
#[tokio::test]
async fn an_answer_before_the_body_was_taken_is_the_response_while_the_server_stops_reading() {
    let (release, held) = tokio::sync::oneshot::channel::<()>();
    let held = Arc::new(tokio::sync::Mutex::new(Some(held)));
    let (url, _) = serve_each(move |mut sock| {
        let held = Arc::clone(&held);
        async move {
            read_head(&mut sock).await.unwrap();
            sock.write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 9\r\n\r\ntoo large")
                .await
                .unwrap();
            // Held open, unread, until the test ends.
            if let Some(held) = held.lock().await.take() {
                let _ = held.await;
            }
        }
    })
    .await;
    let pool = pool();
    let resp = tokio::time::timeout(Duration::from_secs(10), post_large(&pool, &url))
        .await
        .expect("the early answer, without waiting for the write")
        .unwrap();
    assert_eq!(resp.status, http::StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(read_all(resp.body).await, b"too large");
    assert_eq!(idle(&pool), 0);
    drop(release);
}
