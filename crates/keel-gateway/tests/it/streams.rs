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

/// The relay runs inside the client's body (`body::driven`); when the client leaves, the body
/// is dropped and the relay finishes in a task of its own: the request is logged `cancelled`,
/// the upstream request is cancelled and the variant's slot is given back.
#[tokio::test]
async fn a_client_that_leaves_mid_stream_is_logged_cancelled_and_frees_its_slot() {
    let path =
        std::env::temp_dir().join(format!("keel-left-mid-stream-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let top = format!(
        "[log]\nformat = \"json\"\naccess = {:?}\n",
        path.display().to_string()
    );
    let h = Harness::openai(1, 1, &top, "").await;
    // The upstream goes quiet after a few tokens: the relay waits on it when the client leaves.
    add_fault(h.server(0), json!({"kind": "stall", "after_tokens": 3})).await;
    let in_flight = || {
        h.gw.pool("p").unwrap().variants[0]
            .in_flight
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let mut resp = h.post("/v1/chat/completions", &stream_body("x")).await;
    assert_eq!(resp.status(), 200);
    resp.chunk().await.unwrap().unwrap();
    assert_eq!(in_flight(), 1, "the stream holds its variant's slot");
    drop(resp);
    wait_for!("the variant's slot to be given back", in_flight() == 0);
    wait_for!(
        "the access line",
        std::fs::read_to_string(&path).is_ok_and(|t| !t.is_empty())
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let line: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(line["outcome"], "cancelled", "{line}");
    assert_eq!(line["status"], 200, "{line}");
    wait_for!(
        "the cancelled request to be counted",
        h.metric("keel_requests_total", &[("outcome", "cancelled")])
            .await
            == 1.0
    );
    // The upstream sees the connection closed: a body given up mid-response closes it at once
    // (`upstream::direct`).
    wait_for!(
        "the upstream to see the client gone",
        h.server(0).state.stats().cancelled == 1
    );
    let _ = std::fs::remove_file(&path);
}
