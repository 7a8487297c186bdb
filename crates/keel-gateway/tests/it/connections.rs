//! Client connections between requests: a keep-alive connection may wait idle for
//! `idle_timeout_ms`, and once its next request starts, the head must arrive within
//! `header_read_timeout_ms` of its first byte.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::*;

const HEALTH: &[u8] = b"GET /keel/health HTTP/1.1\r\nhost: keel\r\n\r\n";

/// Reads one response (head and a `content-length` body) from `tcp`; its status line.
async fn response(tcp: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut chunk))
            .await
            .expect("an answer within 5 s")
            .unwrap();
        assert!(
            n > 0,
            "closed mid-answer: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).into_owned();
        let Some(end) = text.find("\r\n\r\n") else {
            continue;
        };
        let length: usize = text[..end]
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().ok())?
            })
            .expect("a content-length");
        if buf.len() >= end + 4 + length {
            assert_eq!(buf.len(), end + 4 + length, "nothing after the answer");
            return text.lines().next().unwrap_or("").to_owned();
        }
    }
}

/// Waits for the gateway to close `tcp` (EOF, or a reset); `false` if it is still open after
/// `within`.
async fn closed_within(tcp: &mut TcpStream, within: Duration) -> bool {
    let mut rest = Vec::new();
    match tokio::time::timeout(within, tcp.read_to_end(&mut rest)).await {
        Ok(_) => {
            assert!(rest.is_empty(), "{:?}", String::from_utf8_lossy(&rest));
            true
        }
        Err(_) => false,
    }
}

/// keel with `config` and a keep-alive connection to it that has had one request answered
/// (the harness is returned to keep keel running).
async fn answered_once(config: &str) -> (Harness, TcpStream) {
    let h = Harness::openai(1, 1, config, "").await;
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    tcp.write_all(HEALTH).await.unwrap();
    assert_eq!(response(&mut tcp).await, "HTTP/1.1 200 OK");
    (h, tcp)
}

/// The header-read timeout is not an idle timeout: a pooled connection that sat idle for
/// several header-read timeouts still serves its next request (a client pool reusing it must
/// never race keel closing it).
#[tokio::test]
async fn an_idle_keep_alive_connection_outlives_the_header_read_timeout() {
    let (_keel, mut tcp) =
        answered_once("header_read_timeout_ms = 200\nidle_timeout_ms = 30000").await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    tcp.write_all(HEALTH).await.unwrap();
    assert_eq!(response(&mut tcp).await, "HTTP/1.1 200 OK");
}

/// An idle keep-alive connection is closed at the idle timeout.
#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_at_the_idle_timeout() {
    let (_keel, mut tcp) =
        answered_once("header_read_timeout_ms = 30000\nidle_timeout_ms = 300").await;
    assert!(
        closed_within(&mut tcp, Duration::from_secs(10)).await,
        "an idle connection outlived the idle timeout (300 ms) by 10 s"
    );
}

/// Once a request's first byte is in, the long idle timeout no longer applies: a head that
/// trickles in after an idle wait is cut at the header-read timeout from its first byte.
#[tokio::test]
async fn a_head_begun_after_an_idle_wait_must_arrive_within_the_header_read_timeout() {
    let (_keel, mut tcp) =
        answered_once("header_read_timeout_ms = 200\nidle_timeout_ms = 60000").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    tcp.write_all(b"GET /keel/health HTTP/1.1\r\nhost: ")
        .await
        .unwrap();
    assert!(
        closed_within(&mut tcp, Duration::from_secs(10)).await,
        "a head begun after an idle wait held the connection 10 s (header-read timeout 200 ms, \
         idle timeout 60 s)"
    );
}

/// A burst of connections larger than the runtime's default backlog (128) waits in the
/// kernel's queue of a listener made by `server::listen` until keel accepts it: every
/// handshake completes at once, where with the default the connections past the queue had
/// their SYNs dropped and retried a second later.
#[tokio::test]
async fn a_burst_of_connections_waits_in_the_listen_queue() {
    // The kernel caps any backlog at `net.core.somaxconn`.
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(4096);
    let burst = somaxconn.min(400) as usize;
    let listener =
        keel_gateway::http::server::listen("127.0.0.1:0".parse().unwrap(), burst as u32 + 1)
            .unwrap();
    let addr = listener.local_addr().unwrap();
    // Nobody accepts: every connection must be held by the queue alone.
    let connects = (0..burst)
        .map(|_| tokio::time::timeout(Duration::from_millis(800), TcpStream::connect(addr)));
    let results = futures_util::future::join_all(connects).await;
    let held = results
        .into_iter()
        .filter(|r| matches!(r, Ok(Ok(_))))
        .count();
    assert_eq!(held, burst, "of {burst} connections, {held} completed");
    drop(listener);
}

/// Past `max_connections` a new connection is answered at once (503 in OpenAI's error shape,
/// `retry-after: 1`, `connection: close`) and closed, and counted; the connections already open
/// keep being served.
#[tokio::test]
async fn a_connection_past_the_cap_is_refused_with_503_and_the_open_ones_keep_working() {
    let (h, mut first) = answered_once("max_connections = 2").await;
    let mut second = TcpStream::connect(h.addr).await.unwrap();
    second.write_all(HEALTH).await.unwrap();
    assert_eq!(response(&mut second).await, "HTTP/1.1 200 OK");

    let mut third = TcpStream::connect(h.addr).await.unwrap();
    third.write_all(HEALTH).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), third.read_to_end(&mut answer))
        .await
        .expect("the refusal, then the close")
        .unwrap();
    let answer = String::from_utf8(answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("a whole answer");
    assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
    let head = format!("{}\r\n", head.to_ascii_lowercase());
    assert!(head.contains("\r\nretry-after: 1\r\n"), "{head}");
    assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
    assert!(head.contains("\r\nx-keel-request-id: "), "{head}");
    let error: serde_json::Value = serde_json::from_str(body).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_connections = 2"),
        "{error}"
    );

    for tcp in [&mut first, &mut second] {
        tcp.write_all(HEALTH).await.unwrap();
        assert_eq!(response(tcp).await, "HTTP/1.1 200 OK");
    }
    let metrics = h.gw.metrics.render();
    assert_eq!(
        parse_metric(&metrics, "keel_connections_refused_total", &[]),
        1.0
    );
    assert_eq!(parse_metric(&metrics, "keel_connections_open", &[]), 2.0);
    // A closed connection frees its place.
    drop(second);
    wait_for!(
        "the closed connection's place to be freed",
        parse_metric(&h.gw.metrics.render(), "keel_connections_open", &[]) == 1.0
    );
    let mut fourth = TcpStream::connect(h.addr).await.unwrap();
    fourth.write_all(HEALTH).await.unwrap();
    assert_eq!(response(&mut fourth).await, "HTTP/1.1 200 OK");
}

/// An h2c connection with no open stream for the idle timeout is sent GOAWAY and closed,
/// although its client answers keep-alive pings.
#[tokio::test]
async fn an_idle_http2_connection_is_closed_at_the_idle_timeout() {
    let h = Harness::openai(1, 1, "idle_timeout_ms = 300", "").await;
    let tcp = TcpStream::connect(h.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let driving = tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let req = http::Request::get(format!("http://{}/keel/health", h.addr))
        .body(())
        .unwrap();
    let (response, _) = client.send_request(req, true).unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let ended = tokio::time::timeout(Duration::from_secs(10), driving)
        .await
        .expect("an idle h2 connection outlived the idle timeout (300 ms) by 10 s")
        .unwrap();
    assert!(ended.is_ok(), "closed with GOAWAY, not cut: {ended:?}");
    // GOAWAY: the client may open no stream on it any more.
    assert!(client.ready().await.is_err());
}

/// An HTTP/2 request head must arrive whole within the header-read timeout of its first
/// frame: a HEADERS frame without END_HEADERS whose CONTINUATION never comes closes the
/// connection (the idle timeout, far longer, does not apply: a head is on its way).
#[tokio::test]
async fn an_http2_head_that_never_ends_closes_the_connection_at_the_header_read_timeout() {
    let h = Harness::openai(
        1,
        1,
        "header_read_timeout_ms = 300\nidle_timeout_ms = 600000",
        "",
    )
    .await;
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    let mut opening = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    // An empty SETTINGS frame, then HEADERS (`:method GET`, indexed) without END_HEADERS.
    opening.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    opening.extend_from_slice(&[0, 0, 1, 0x1, 0x1, 0, 0, 0, 1, 0x82]);
    tcp.write_all(&opening).await.unwrap();
    let mut seen = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut seen)).await;
    assert!(
        read.is_ok(),
        "a head without its end held the connection 10 s (header-read timeout 300 ms)"
    );
}
