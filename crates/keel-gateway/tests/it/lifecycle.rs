//! Graceful shutdown: stop accepting, let in-flight streams finish.

use std::time::Duration;

use serde_json::json;

use crate::harness::*;

#[tokio::test]
async fn shutdown_drains_in_flight_streams() {
    let mut h = Harness::openai(1, 1, "drain_ms = 5000", "").await;
    add_fault(h.server(0), json!({"kind": "slowdown", "factor": 20})).await;
    let resp = h.post("/v1/chat/completions", &stream_body("x")).await;
    assert_eq!(resp.status(), 200);
    h.stop();
    // New connections are refused once shutdown began...
    wait_for!(
        "the listener to close",
        keel_sim::http_client()
            .get(h.url("/keel/health"))
            .send()
            .await
            .is_err()
    );
    // ...while the stream in flight completes intact.
    let events = read_stream(resp).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let task = h.task.take().unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
