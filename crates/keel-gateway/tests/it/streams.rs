//! After the first byte: streams never end silently, and a client that leaves cancels upstream.

use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

#[tokio::test]
async fn upstream_death_mid_stream_ends_with_an_explicit_error_event() {
    let h = Harness::openai(1, 1, "", "").await;
    add_fault(h.server(0), json!({"kind": "close", "after_tokens": 3})).await;
    let events = read_stream(h.post("/v1/chat/completions", &stream_body("x")).await).await;
    assert!(
        events.iter().all(|e| e.data != "[DONE]"),
        "never a clean end"
    );
    let last: Value = serde_json::from_str(&events.last().unwrap().data).unwrap();
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("incomplete"),
        "{last}"
    );
    assert!(
        !openai_stream_text(&events).is_empty(),
        "the tokens before the failure were delivered"
    );
    wait_for!(
        "the incomplete stream to be counted",
        h.metric(
            "keel_requests_total",
            &[("route", "direct"), ("outcome", "incomplete")]
        )
        .await
            == 1.0
    );
}

#[tokio::test]
async fn anthropic_stream_failure_ends_with_event_error() {
    let fleet = keel_sim::Fleet::start_n(1, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    add_fault(fleet.get(0), json!({"kind": "close", "after_tokens": 2})).await;
    let cfg = pool_over(&fleet, "c", "anthropic", 1, "");
    let h = Harness::start(fleet, &cfg).await;
    let body = json!({"model": "c", "max_tokens": 50, "stream": true, "messages": [{"role": "user", "content": "x"}]});
    let events = read_stream(h.post("/v1/messages", &body).await).await;
    let last = events.last().unwrap();
    assert_eq!(last.event.as_deref(), Some("error"));
    assert!(!events
        .iter()
        .any(|e| e.event.as_deref() == Some("message_stop")));
    let v: Value = serde_json::from_str(&last.data).unwrap();
    assert_eq!(v["type"], "error");
}

#[tokio::test]
async fn a_stall_after_the_first_byte_ends_with_an_error_not_a_hang() {
    let h = Harness::openai(1, 1, "", "stall_ms = 300").await;
    add_fault(h.server(0), json!({"kind": "stall", "after_tokens": 4})).await;
    let events = read_stream(h.post("/v1/chat/completions", &stream_body("x")).await).await;
    let last: Value = serde_json::from_str(&events.last().unwrap().data).unwrap();
    assert!(
        last["error"]["message"].as_str().unwrap().contains("stall"),
        "{last}"
    );
}

#[tokio::test]
async fn malformed_event_mid_stream_is_not_forwarded() {
    let h = Harness::openai(1, 1, "", "").await;
    add_fault(h.server(0), json!({"kind": "malformed", "after_tokens": 3})).await;
    let events = read_stream(h.post("/v1/chat/completions", &stream_body("x")).await).await;
    for e in &events {
        assert!(
            serde_json::from_str::<Value>(&e.data).is_ok(),
            "client never sees a malformed event: {:?}",
            e.data
        );
    }
    let last: Value = serde_json::from_str(&events.last().unwrap().data).unwrap();
    assert!(last["error"].is_object());
}

#[tokio::test]
async fn client_disconnect_cancels_the_upstream_request() {
    let h = Harness::openai(1, 1, "", "").await;
    add_fault(h.server(0), json!({"kind": "stall", "after_tokens": 3})).await;
    let mut resp = h.post("/v1/chat/completions", &stream_body("x")).await;
    assert_eq!(resp.status(), 200);
    resp.chunk().await.unwrap().unwrap();
    drop(resp);
    let sim = &h.server(0).state;
    for _ in 0..200 {
        if sim.stats().cancelled == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        sim.stats().cancelled,
        1,
        "the upstream saw its client go away"
    );
    assert_eq!(sim.stats().running, 0);
    for _ in 0..100 {
        if h.metric("keel_requests_total", &[("outcome", "cancelled")])
            .await
            == 1.0
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("cancelled request not counted: {}", h.metrics().await);
}
