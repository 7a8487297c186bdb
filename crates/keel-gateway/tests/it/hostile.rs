//! Nothing an upstream sends can crash keel or grow it without bound, and an upstream that
//! answers a streamed request with one JSON body is served, not failed.

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

fn sse(events: &[Value]) -> String {
    let mut s: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    s.push_str("data: [DONE]\n\n");
    s
}

fn chunk(delta: Value, finish: Value) -> Value {
    json!({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
}

#[tokio::test]
async fn an_absurd_tool_call_index_fails_over_instead_of_allocating() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "hedge = \"off\"").await;
    let hostile = sse(&[
        chunk(json!({"role": "assistant", "content": null}), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 4_000_000_000u64, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
    ]);
    for stream in [false, true] {
        add_fault(
            h.server(0),
            json!({"kind": "raw", "content_type": "text/event-stream", "body": hostile, "count": 1}),
        )
        .await;
        let mut body = chat_body("hello");
        body["stream"] = json!(stream);
        let resp = forced_sim0(&h, &body).await;
        assert_eq!(resp.status(), 200, "stream = {stream}");
        assert_eq!(header(resp.headers(), "x-keel-variant"), "sim-1");
        assert_eq!(header(resp.headers(), "x-keel-route"), "fallback");
        let text = resp.text().await.unwrap();
        assert!(!text.contains("4000000000"), "{text}");
    }
    assert_eq!(
        h.metric(
            "keel_attempts_total",
            &[("variant", "sim-0"), ("outcome", "malformed")]
        )
        .await,
        2.0
    );
}

#[tokio::test]
async fn an_absurd_index_mid_stream_migrates() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "hedge = \"off\"").await;
    let hostile = sse(&[
        chunk(json!({"role": "assistant", "content": "Once"}), Value::Null),
        chunk(json!({"content": " upon"}), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 99_999_999, "id": "c", "function": {"name": "f", "arguments": ""}}]}),
            Value::Null,
        ),
    ]);
    add_fault(
        h.server(0),
        json!({"kind": "raw", "content_type": "text/event-stream", "body": hostile, "count": 1}),
    )
    .await;
    let resp = forced_sim0(&h, &stream_body("a story")).await;
    assert_eq!(resp.status(), 200);
    let events = read_stream(resp).await;
    assert!(events
        .iter()
        .any(|e| e.comment_only && String::from_utf8_lossy(&e.raw).contains("reason=error")));
    assert_eq!(events.iter().filter(|e| e.data == "[DONE]").count(), 1);
    assert!(openai_stream_text(&events).starts_with("Once upon"));
    assert!(!events.iter().any(|e| e.data.contains("99999999")));
}

#[tokio::test]
async fn oversized_events_and_bodies_fail_over() {
    let top =
        "allow_force_variant = true\nmax_sse_event_bytes = 4096\nmax_upstream_body_bytes = 4096";
    let h = Harness::openai(2, 1, top, "hedge = \"off\"\nassemble_non_streaming = false").await;
    let big = "x".repeat(10_000);
    let cases = [
        // One event larger than max_sse_event_bytes.
        (
            true,
            "text/event-stream",
            format!("data: {}\n\n", json!({"pad": big})),
        ),
        // A whole body larger than max_upstream_body_bytes.
        (false, "application/json", json!({"pad": big}).to_string()),
        // Neither a stream nor JSON.
        (true, "text/html", "<html>busy</html>".to_owned()),
    ];
    for (stream, content_type, payload) in cases {
        add_fault(
            h.server(0),
            json!({"kind": "raw", "content_type": content_type, "body": payload, "count": 1}),
        )
        .await;
        let mut body = chat_body("hello");
        body["stream"] = json!(stream);
        let resp = forced_sim0(&h, &body).await;
        assert_eq!(resp.status(), 200, "{content_type}");
        assert_eq!(header(resp.headers(), "x-keel-variant"), "sim-1");
        assert_eq!(header(resp.headers(), "x-keel-attempts"), "2");
    }
    assert_eq!(
        h.metric(
            "keel_attempts_total",
            &[("variant", "sim-0"), ("outcome", "malformed")]
        )
        .await,
        3.0
    );
}

#[tokio::test]
async fn a_server_that_ignores_stream_is_served_in_both_protocols() {
    // OpenAI: a streaming client gets the equivalent stream; a non-streaming one (streamed
    // upstream by keel for assembly) gets the server's body.
    let h = Harness::openai(1, 1, "", "hedge = \"off\"").await;
    add_fault(h.server(0), json!({"kind": "ignore_stream"})).await;
    let body = stream_body("tell me about rivers");
    let want = reference(&h, 0, "/v1/chat/completions", &body).await;
    let want_text = want["choices"][0]["message"]["content"].as_str().unwrap();
    let resp = h.post("/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    assert!(header(resp.headers(), "content-type").starts_with("text/event-stream"));
    let events = read_stream(resp).await;
    assert_eq!(openai_stream_text(&events), want_text);
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let (status, _, got) = h.chat(&chat_body("tell me about rivers")).await;
    assert_eq!(status, 200);
    assert_eq!(got["choices"][0]["message"]["content"], want_text);

    // Anthropic.
    let fleet = keel_sim::Fleet::start_n(1, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let cfg = pool_over(&fleet, "p", "anthropic", 1, "hedge = \"off\"");
    let h = Harness::start(fleet, &cfg).await;
    add_fault(h.server(0), json!({"kind": "ignore_stream"})).await;
    let body = json!({"model": "p", "max_tokens": 40, "stream": true,
        "messages": [{"role": "user", "content": "tell me about rivers"}]});
    let want = reference(&h, 0, "/v1/messages", &body).await;
    let resp = h.post("/v1/messages", &body).await;
    assert_eq!(resp.status(), 200);
    let events = read_stream(resp).await;
    let text: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("content_block_delta"))
        .filter_map(|e| {
            let v: Value = serde_json::from_str(&e.data).ok()?;
            v["delta"]["text"].as_str().map(str::to_owned)
        })
        .collect();
    assert_eq!(text, want["content"][0]["text"].as_str().unwrap());
    assert_eq!(
        events.last().unwrap().event.as_deref(),
        Some("message_stop")
    );
}

#[tokio::test]
async fn a_slow_request_body_gets_408() {
    let h = Harness::openai(1, 1, "body_read_timeout_ms = 300", "").await;
    let mut tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    tcp.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tcp.read_to_end(&mut buf),
    )
    .await;
    assert!(read.is_ok(), "the gateway answered and closed");
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("body_read_timeout_ms"));
    assert_eq!(h.server(0).state.stats().requests, 0);
}

#[tokio::test]
async fn a_stream_whose_last_event_ends_in_a_lone_cr_is_complete() {
    // WHATWG framing allows `\r` line endings; the last blank line is then a lone `\r` that
    // only the end of the bytes completes.
    let h = Harness::openai(2, 1, "allow_force_variant = true", "hedge = \"off\"").await;
    let body = format!(
        "data: {}\r\rdata: {}\r\rdata: [DONE]\r\r",
        chunk(
            json!({"role": "assistant", "content": "Hi there"}),
            Value::Null
        ),
        chunk(json!({}), json!("stop"))
    );
    add_fault(
        h.server(0),
        json!({"kind": "raw", "content_type": "text/event-stream", "body": body, "count": 1}),
    )
    .await;
    let resp = forced_sim0(&h, &stream_body("hello")).await;
    assert_eq!(header(resp.headers(), "x-keel-variant"), "sim-0");
    let events = read_stream(resp).await;
    assert_eq!(openai_stream_text(&events), "Hi there");
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert!(!events.iter().any(|e| e.comment_only), "no migration");
}
