//! Every kind of bad input gets a precise error in the client's protocol, and nothing upstream.

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

async fn raw(h: &Harness, path: &str, content_type: Option<&str>, body: Vec<u8>) -> (u16, Value) {
    let mut req = keel_sim::http_client().post(h.url(path)).body(body);
    if let Some(ct) = content_type {
        req = req.header("content-type", ct);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

#[tokio::test]
async fn bad_requests_get_precise_errors() {
    let h = Harness::openai(1, 1, "max_body_bytes = 1000", "").await;
    let json_ct = Some("application/json");
    let (s, v) = raw(
        &h,
        "/v1/chat/completions",
        json_ct,
        b"{\n \"model\": \"p\",\n oops }".to_vec(),
    )
    .await;
    assert_eq!(s, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("line 3 column 2"),
        "{v}"
    );
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let (s, v) = raw(
        &h,
        "/v1/chat/completions",
        json_ct,
        br#"{"messages": [{"role": "user", "content": "x"}]}"#.to_vec(),
    )
    .await;
    assert_eq!(
        (s, v["error"]["message"].as_str().unwrap()),
        (400, "missing required field `model`")
    );
    let (s, v) = raw(
        &h,
        "/v1/chat/completions",
        json_ct,
        br#"{"model": "p"}"#.to_vec(),
    )
    .await;
    assert_eq!(
        (s, v["error"]["message"].as_str().unwrap()),
        (400, "missing required field `messages`")
    );

    let (s, v) = raw(
        &h,
        "/v1/chat/completions",
        json_ct,
        br#"{"model": "nope", "messages": [{"role": "user", "content": "x"}]}"#.to_vec(),
    )
    .await;
    assert_eq!(s, 404);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("models you may use: p"),
        "{v}"
    );

    let (s, v) = raw(
        &h,
        "/v1/chat/completions",
        Some("text/plain"),
        b"{}".to_vec(),
    )
    .await;
    assert_eq!(s, 415);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("text/plain"));

    let (s, v) = raw(
        &h,
        "/v1/chat/completions",
        json_ct,
        b"{\"model\": \"\xff\xfe\"}".to_vec(),
    )
    .await;
    assert_eq!(s, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("UTF-8"));

    let big = format!(
        r#"{{"model": "p", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
        "x".repeat(2000)
    );
    let (s, v) = raw(&h, "/v1/chat/completions", json_ct, big.into_bytes()).await;
    assert_eq!(s, 413);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("1000 bytes"));

    let r = keel_sim::http_client()
        .get(h.url("/v2/nothing"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = keel_sim::http_client()
        .get(h.url("/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(
        h.server(0).state.stats().requests,
        0,
        "no bad request reached an upstream"
    );
}

#[tokio::test]
async fn anthropic_bad_input_uses_anthropic_shape() {
    let fleet = keel_sim::Fleet::start_n(1, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let cfg = pool_over(&fleet, "c", "anthropic", 1, "");
    let h = Harness::start(fleet, &cfg).await;
    let (s, v) = raw(
        &h,
        "/v1/messages",
        Some("application/json"),
        br#"{"model": "c", "messages": [{"role": "user", "content": "x"}]}"#.to_vec(),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["message"], "missing required field `max_tokens`");
    let r = keel_sim::http_client()
        .get(h.url("/v1/nothing"))
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["type"], "error");
    let r = keel_sim::http_client()
        .post(h.url("/v1/messages"))
        .header("x-keel-force-variant", "sim-0")
        .json(
            &json!({"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "force-variant is off unless configured");
}

#[tokio::test]
async fn slow_clients_cannot_hold_a_connection() {
    let h = Harness::openai(1, 1, "header_read_timeout_ms = 200", "").await;
    let mut tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    tcp.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let read =
        tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read_to_end(&mut buf)).await;
    assert!(
        read.is_ok(),
        "the gateway closed the connection of a client that never finished its headers"
    );
}

/// A connection that never sends a byte is closed at the header-read timeout too (the HTTP
/// version is decided from the first bytes, and that wait is bounded as hyper bounds a head's).
#[tokio::test]
async fn a_client_that_sends_nothing_is_closed() {
    let h = Harness::openai(1, 1, "header_read_timeout_ms = 200", "").await;
    let mut tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let mut buf = Vec::new();
    let read =
        tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the gateway closed a silent connection");
    assert!(buf.is_empty());
}

/// The version is told from bytes that may arrive one at a time: an HTTP/1.1 request written a
/// byte at a time is answered, and an h2 preface split in two still starts HTTP/2 (the server's
/// first frame is its SETTINGS).
#[tokio::test]
async fn requests_whose_first_bytes_trickle_in_are_served() {
    let h = Harness::openai(1, 1, "", "").await;
    let mut tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let request = b"GET /keel/health HTTP/1.1\r\nhost: keel\r\nconnection: close\r\n\r\n";
    for byte in request {
        tcp.write_all(&[*byte]).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let mut buf = Vec::new();
    tcp.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");

    let mut tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    tcp.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    // The rest of the preface, then an empty SETTINGS frame.
    tcp.write_all(b"\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut frame = [0u8; 9];
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        tcp.read_exact(&mut frame),
    )
    .await
    .expect("the server's first frame")
    .unwrap();
    assert_eq!(frame[3], 0x4, "a SETTINGS frame: {frame:?}");
}

/// A client that declares a body over `max_body_bytes` and goes on uploading it gets the 413,
/// not a connection closed under its upload (a broken pipe: what Node's fetch, and so both
/// JavaScript SDKs, reported instead of the 413). Chunked bodies (no declared length) too.
#[tokio::test]
async fn an_oversized_upload_is_read_to_its_end_and_answered_413() {
    let h = Harness::openai(1, 1, "max_body_bytes = 1000", "").await;
    let body = vec![b'x'; 8 << 20];
    for chunked in [false, true] {
        let mut s = tokio::net::TcpStream::connect(h.addr).await.unwrap();
        let framing = if chunked {
            "transfer-encoding: chunked".to_owned()
        } else {
            format!("content-length: {}", body.len())
        };
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: keel\r\ncontent-type: application/json\r\n{framing}\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.unwrap();
        for part in body.chunks(64 << 10) {
            if chunked {
                s.write_all(format!("{:x}\r\n", part.len()).as_bytes())
                    .await
                    .unwrap();
            }
            // A broken pipe or a reset here is the bug.
            s.write_all(part).await.expect("keel cut the upload off");
            if chunked {
                s.write_all(b"\r\n").await.unwrap();
            }
        }
        if chunked {
            s.write_all(b"0\r\n\r\n").await.unwrap();
        }
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&answer).contains("bytes\"") {
            let n = s.read(&mut buf).await.expect("read the answer");
            assert!(
                n > 0,
                "closed before the answer: {}",
                String::from_utf8_lossy(&answer)
            );
            answer.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&answer);
        assert!(
            text.starts_with("HTTP/1.1 413"),
            "chunked={chunked}: {text}"
        );
        assert!(text.contains("exceeds the limit of 1000 bytes"), "{text}");
    }
}
