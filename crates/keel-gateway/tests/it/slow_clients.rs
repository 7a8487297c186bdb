//! Clients that stop reading: a client that takes no response bytes for
//! `client_write_timeout_ms` while keel has some for it loses the request (its HTTP/1.1
//! connection, or its HTTP/2 stream), so the upstream attempt and the variant's and key's slots
//! are freed long before `total_ms`.

use bytes::Bytes;
use keel_gateway::state::keys::{hash_secret, hash_text};
use keel_sim::{Fleet, ServerConfig};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::harness::*;

const KEY: &str = "sk-keel-slow-reader";

/// A long answer, streamed as fast as the sim can (megabytes of SSE).
fn long_answer_body() -> String {
    json!({"model": "p", "stream": true, "messages": [{"role": "user", "content": "talk"}]})
        .to_string()
}

/// keel with a write timeout of 300 ms in front of a sim whose answers are long and fast, key
/// `a` limited to one request at a time, and the access log in `log`.
async fn keel_for_slow_readers(log: &std::path::Path) -> Harness {
    let server = ServerConfig {
        answer: Some("word ".repeat(200_000)),
        gap_ms: 0.0,
        ..ServerConfig::fast("s")
    };
    let fleet = Fleet::start_n(1, server).await.unwrap();
    let cfg = format!(
        "client_write_timeout_ms = 300\n[log]\nformat = \"json\"\naccess = {:?}\n\n[[keys]]\nid = \"a\"\nhash = \"{}\"\nmax_concurrency = 1\n\n{}",
        log.display().to_string(),
        hash_text(&hash_secret(KEY)),
        pool_over(&fleet, "p", "openai", 1, "hedge = \"off\""),
    );
    Harness::start(fleet, &cfg).await
}

fn log_path(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("keel-{name}-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// The access lines' outcomes so far.
fn outcomes(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["outcome"].as_str().map(str::to_owned))
        .collect()
}

async fn write_timeouts(h: &Harness, protocol: &str) -> f64 {
    parse_metric(
        &h.gw.metrics.render(),
        "keel_client_write_timeouts_total",
        &[("protocol", protocol)],
    )
}

/// Whether another request of key `a` is admitted now (its one slot is free).
async fn key_admits(h: &Harness) -> bool {
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("authorization", &format!("Bearer {KEY}"))],
            &chat_body("hello"),
        )
        .await;
    let status = r.status().as_u16();
    r.bytes().await.ok();
    status == 200
}

/// An HTTP/1.1 client with a small receive buffer that asks for a long stream and never reads
/// it: after the write timeout its connection is closed, the relay ends as cancelled, and the
/// key's only slot is free for its next request (without the timeout: refused with 429 until
/// `total_ms`).
#[tokio::test]
async fn a_client_that_stops_reading_loses_its_http1_request_and_frees_the_key_slot() {
    let log = log_path("slow-reader-h1");
    let h = keel_for_slow_readers(&log).await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut tcp = socket.connect(h.addr).await.unwrap();
    let body = long_answer_body();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: keel\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(body.as_bytes()).await.unwrap();
    wait_for!(
        "the write timeout to cut the reader",
        write_timeouts(&h, "http1").await >= 1.0
    );
    wait_for!("the key's slot to be free", key_admits(&h).await);
    wait_for!(
        "the access line of the cut request",
        outcomes(&log).contains(&"client_write_timeout".to_owned())
    );
    // The reader is still there (never closed its side): keel let go of it alone.
    drop(tcp);
}

/// An HTTP/2 client that never grants window for its stream (no WINDOW_UPDATE) while its
/// connection keeps flowing: after the write timeout the stream is reset and the key's slot is
/// free.
#[tokio::test]
async fn an_http2_stream_without_window_is_reset_and_frees_the_key_slot() {
    let log = log_path("slow-reader-h2");
    let h = keel_for_slow_readers(&log).await;
    let tcp = TcpStream::connect(h.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    // The connection keeps being driven (pings answered, frames read): only the stream's
    // window stays shut, because its data is never released.
    let driving = tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let req = http::Request::post(format!("http://{}/v1/chat/completions", h.addr))
        .header("authorization", format!("Bearer {KEY}"))
        .header("content-type", "application/json")
        .body(())
        .unwrap();
    let (response, mut send) = client.send_request(req, false).unwrap();
    send.send_data(Bytes::from(long_answer_body()), true)
        .unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    let unread = response.into_body();
    wait_for!(
        "the write timeout to reset the stream",
        write_timeouts(&h, "http2").await >= 1.0
    );
    wait_for!("the key's slot to be free", key_admits(&h).await);
    wait_for!(
        "the access line of the reset stream",
        outcomes(&log).contains(&"client_write_timeout".to_owned())
    );
    assert!(!driving.is_finished(), "the connection itself stays open");
    drop(unread);
}

/// keel's own answers are held to the write timeout too: a client that asks for large admin
/// documents (pipelined) and reads none of them loses its connection, counted.
#[tokio::test]
async fn a_client_that_reads_no_admin_answers_is_cut_at_the_write_timeout() {
    let h = Harness::openai(1, 1, "client_write_timeout_ms = 300", "").await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut tcp = socket.connect(h.addr).await.unwrap();
    // 100 answers of the OpenAPI document: megabytes nobody reads.
    let requests = "GET /keel/openapi.json HTTP/1.1\r\nhost: keel\r\n\r\n".repeat(100);
    tcp.write_all(requests.as_bytes()).await.unwrap();
    wait_for!(
        "the write timeout to cut the reader",
        write_timeouts(&h, "http1").await >= 1.0
    );
    drop(tcp);
}
