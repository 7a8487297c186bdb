//! The fleet's lifecycle as clients see it: a fleet still loading its models, or restarting
//! (refusing connections, then loading), makes requests wait instead of failing; a variant that
//! stays down is ejected after its restart grace; graceful shutdown stops accepting and lets
//! in-flight streams finish.

use std::time::{Duration, Instant};

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

/// A pool over `fleet` whose variants declare `health_path = "/health"`.
fn pool_with_health(fleet: &keel_sim::Fleet, health: &str) -> String {
    pool_over(fleet, "p", "openai", 1, health).replace(
        "upstream_model = \"sim\"\n",
        "upstream_model = \"sim\"\nhealth_path = \"/health\"\n",
    )
}

/// Each variant's lifecycle state in the first pool of a `/keel/health` document.
pub fn variant_states(health: &serde_json::Value) -> Vec<String> {
    health["pools"][0]["variants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["state"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn a_loading_fleet_with_health_endpoints_is_checked_there_and_requests_wait() {
    // Both servers load their model for 1 s: `/health` answers 503 and generation requests
    // `503 Loading model` until then.
    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    for s in &fleet.servers {
        add_fault(s, json!({"kind": "loading", "ms": 1000})).await;
    }
    let loading_since = Instant::now();
    let cfg = pool_with_health(&fleet, "[pools.health]\nprewarm_requests = 1");
    let h = Harness::start(fleet, &cfg).await;
    // Sent at once, while nothing is ready: they wait, then succeed.
    let (chat, streamed) = (chat_body("hello"), stream_body("hello"));
    let whole = h.chat(&chat);
    let stream = h.post("/v1/chat/completions", &streamed);
    let ((status, headers, body), stream) = tokio::join!(whole, stream);
    assert_eq!(status, 200, "{body}");
    assert_eq!(header(&headers, "x-keel-attempts"), "1");
    assert_eq!(stream.status(), 200);
    let events = read_stream(stream).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert!(
        loading_since.elapsed() >= Duration::from_millis(900),
        "answered before the fleet was ready"
    );
    // Readiness was asked of /health only: no generation request (client or warm-up) reached
    // a server before its /health answered 200.
    for s in &h.fleet.servers {
        assert_eq!(s.state.stats().errors, 0, "a request met a loading server");
    }
    assert_eq!(
        h.metric("keel_attempts_total", &[("outcome", "loading")])
            .await,
        0.0
    );
    let health = |outcome| [("kind", "health"), ("outcome", outcome)];
    assert!(
        h.metric("keel_maintenance_requests_total", &health("not_ready"))
            .await
            >= 2.0
    );
    assert!(
        h.metric("keel_maintenance_requests_total", &health("ok"))
            .await
            >= 1.0
    );
    // Health checks are not attempts: nothing of them in the attempt counts or the budget.
    assert_eq!(
        h.metric("keel_attempts_total", &[("kind", "health")]).await,
        0.0
    );
    assert_eq!(
        h.metric("keel_requests_total", &[("outcome", "ok")]).await,
        2.0
    );
}

#[tokio::test]
async fn a_restarting_fleet_makes_requests_wait_then_succeed() {
    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let cfg = pool_with_health(&fleet, "[pools.health]\nprewarm_requests = 1");
    let h = Harness::start(fleet, &cfg).await;
    wait_for!(
        "the fleet to be ready",
        variant_states(&h.get_json("/keel/health").await)
            .iter()
            .all(|s| s != "warming")
    );
    let (status, _, _) = h.chat(&chat_body("before")).await;
    assert_eq!(status, 200);
    // Every server restarts: connections refused for 500 ms, then loading until 1 s.
    for s in &h.fleet.servers {
        for f in [
            json!({"kind": "refuse", "ms": 500}),
            json!({"kind": "loading", "ms": 1000}),
        ] {
            s.state.add_fault(serde_json::from_value(f).unwrap());
        }
    }
    let restarted = Instant::now();
    // Requests sent during the restart wait for it and succeed.
    let requests = (0..4).map(|i| {
        let h = &h;
        async move {
            tokio::time::sleep(Duration::from_millis(150 * i)).await;
            h.chat(&chat_body(&format!("during {i}"))).await
        }
    });
    for (status, headers, body) in futures_util::future::join_all(requests).await {
        assert_eq!(status, 200, "{body}");
        assert!(!header(&headers, "x-keel-variant").is_empty());
    }
    assert!(restarted.elapsed() >= Duration::from_millis(900));
    // Refused connections failed over at once (only until keel knew the fleet was restarting),
    // and no generation request met a loading server: readiness was asked of /health.
    let refused = h
        .metric("keel_attempts_total", &[("outcome", "connect_error")])
        .await;
    assert!(refused >= 1.0);
    assert_eq!(
        h.metric("keel_attempts_total", &[("outcome", "loading")])
            .await,
        0.0
    );
    assert!(
        h.metric(
            "keel_maintenance_requests_total",
            &[("kind", "health"), ("outcome", "refused")]
        )
        .await
            + h.metric(
                "keel_maintenance_requests_total",
                &[("kind", "health"), ("outcome", "not_ready")]
            )
            .await
            >= 1.0
    );
    assert_eq!(
        h.metric("keel_requests_total", &[("outcome", "ok")]).await,
        5.0
    );
}

/// A pool of one variant on a port nothing listens on (connections refused), with `health`
/// lines in its `[pools.health]` table.
async fn one_dead_variant(health: &str) -> Harness {
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let fleet = keel_sim::Fleet::start_n(0, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let cfg = format!(
        "[[pools]]\nname = \"p\"\n[pools.health]\nprewarm_requests = 0\n{health}{}",
        variant("dead", &format!("http://{dead}/v1"), "openai", 1)
    );
    Harness::start(fleet, &cfg).await
}

#[tokio::test]
async fn a_fleet_that_refuses_past_the_deadline_gets_a_clear_503() {
    // Nothing listens on this port: the variant is restarting (within its grace) for as long
    // as the request may wait.
    let h = one_dead_variant("").await;
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
    assert!(message.contains("restarting"), "{message}");
}

#[tokio::test]
async fn a_dead_variant_is_ejected_after_its_restart_grace_and_stops_making_requests_wait() {
    let h = one_dead_variant("restart_grace_ms = 300\n").await;
    // It waits for the restart grace at most, not for its 20 s deadline, then gets a precise
    // error naming what was tried.
    let started = Instant::now();
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-timeout-ms", "20000")],
            &chat_body("hello"),
        )
        .await;
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(r.status(), 502);
    let body: serde_json::Value = r.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("dead: connect error"), "{message}");
    assert_eq!(
        variant_states(&h.get_json("/keel/health").await),
        ["ejected"]
    );
}

#[tokio::test]
async fn a_stream_cut_by_a_whole_fleet_restart_waits_and_is_continued() {
    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let cfg = pool_with_health(&fleet, "[pools.health]\nprewarm_requests = 1");
    let h = Harness::start(fleet, &cfg).await;
    wait_for!(
        "the fleet to be ready",
        variant_states(&h.get_json("/keel/health").await)
            .iter()
            .all(|s| s != "warming")
    );
    for s in &h.fleet.servers {
        add_fault(s, json!({"kind": "slowdown", "factor": 20})).await;
    }
    let resp = h.post("/v1/chat/completions", &stream_body("x")).await;
    assert_eq!(resp.status(), 200);
    // Committed to one server: now the whole fleet restarts under it.
    for s in &h.fleet.servers {
        s.state.clear_faults();
        for f in [
            json!({"kind": "refuse", "ms": 300}),
            json!({"kind": "loading", "ms": 700}),
        ] {
            s.state.add_fault(serde_json::from_value(f).unwrap());
        }
    }
    let events = read_stream(resp).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert!(
        events.iter().all(|e| !e.data.contains("\"error\"")),
        "no error event"
    );
    assert!(
        events
            .iter()
            .any(|e| e.comment_only && String::from_utf8_lossy(&e.raw).contains("keel migrated")),
        "the stream was continued after the restart"
    );
}

#[tokio::test]
async fn a_variant_still_warming_takes_the_request_the_warm_one_refuses() {
    // The second server answers its first request (keel's warm-up) after 5 s: it stays warming
    // that long, while the first is warm at once and then refuses everything with a 429.
    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    add_fault(
        &fleet.servers[1],
        json!({"kind": "delay", "ms": 5000, "count": 1}),
    )
    .await;
    let cfg = pool_over(
        &fleet,
        "p",
        "openai",
        1,
        "[pools.health]\nprewarm_requests = 1",
    );
    let h = Harness::start(fleet, &cfg).await;
    wait_for!("the first variant to be warm", {
        let states = variant_states(&h.get_json("/keel/health").await);
        states[0] != "warming" && states[1] == "warming"
    });
    add_fault(
        h.server(0),
        json!({"kind": "error", "status": 429, "retry_after_s": 30}),
    )
    .await;
    let (status, headers, body) = h.chat(&chat_body("hello")).await;
    assert_eq!(status, 200, "{body}");
    let health = h.get_json("/keel/health").await;
    assert_eq!(
        header(&headers, "x-keel-variant"),
        health["pools"][0]["variants"][1]["name"].as_str().unwrap()
    );
    assert_eq!(header(&headers, "x-keel-attempts"), "2");
}
