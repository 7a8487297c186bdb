//! The fleet's lifecycle as clients see it: a fleet still loading its models makes requests
//! wait instead of failing; graceful shutdown stops accepting and lets in-flight streams finish.

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

#[tokio::test]
async fn a_fleet_still_loading_makes_requests_wait_then_succeed() {
    // Both servers answer `503 Loading model` (as llama.cpp does) to their first 6 requests.
    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    for s in &fleet.servers {
        add_fault(s, json!({"kind": "loading", "count": 6})).await;
    }
    let cfg = pool_over(
        &fleet,
        "p",
        "openai",
        1,
        "[pools.health]\nprewarm_requests = 1",
    );
    let h = Harness::start(fleet, &cfg).await;
    // Sent at once, while nothing is ready: they wait for the first ready variant.
    let (status, headers, body) = h.chat(&chat_body("hello")).await;
    assert_eq!(status, 200, "{body}");
    let stream = h.post("/v1/chat/completions", &stream_body("hello")).await;
    assert_eq!(stream.status(), 200);
    let events = read_stream(stream).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert!(!header(&headers, "x-keel-variant").is_empty());
    // Readiness was found by keel's own warm-ups: loading answers went to them (and to at most
    // one client attempt per variant before keel knew), and none reached the client.
    let loading = h
        .metric("keel_attempts_total", &[("outcome", "loading")])
        .await;
    let warmups = h
        .metric(
            "keel_attempts_total",
            &[("kind", "warmup"), ("outcome", "loading")],
        )
        .await;
    assert_eq!(loading, 12.0, "every loading answer was keel's to see");
    assert!(
        loading - warmups <= 2.0,
        "client attempts on loading servers: {}",
        loading - warmups
    );
    assert_eq!(
        h.metric("keel_requests_total", &[("outcome", "ok")]).await,
        2.0
    );
}

#[tokio::test]
async fn a_fleet_that_stays_loading_past_the_deadline_gets_a_clear_503() {
    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    for s in &fleet.servers {
        add_fault(s, json!({"kind": "loading"})).await;
    }
    let cfg = pool_over(
        &fleet,
        "p",
        "openai",
        1,
        "[pools.health]\nprewarm_requests = 1",
    );
    let h = Harness::start(fleet, &cfg).await;
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-timeout-ms", "400")],
            &chat_body("hello"),
        )
        .await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(r.headers(), "retry-after"), "1");
    let body: serde_json::Value = r.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("still loading"), "{message}");
}
