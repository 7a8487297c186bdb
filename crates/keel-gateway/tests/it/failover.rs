//! Failover before the first byte: which outcomes move on to another variant, which return to
//! the client, cooldowns, credentials, budgets and deadlines.
//!
//! Pools here weight the first server 1000:1 so that it is the primary of the first request
//! (smooth weighted round robin picks the heaviest first), which makes every test exact.

use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

/// The first server fails with `fault` on every request; the request must be served by sim-1.
async fn assert_fails_over(fault: Value, pool_extra: &str, stream: bool) {
    let h = Harness::openai(2, 1000, "", pool_extra).await;
    add_fault(h.server(0), fault.clone()).await;
    let body = if stream {
        stream_body("x")
    } else {
        chat_body("x")
    };
    let r = h.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status(), 200, "{fault}: {}", r.text().await.unwrap());
    assert_eq!(header(r.headers(), "x-keel-variant"), "sim-1", "{fault}");
    assert_eq!(header(r.headers(), "x-keel-route"), "fallback", "{fault}");
    assert_eq!(header(r.headers(), "x-keel-attempts"), "2", "{fault}");
    if stream {
        let events = read_stream(r).await;
        assert_eq!(events.last().unwrap().data, "[DONE]");
    }
}

#[tokio::test]
async fn retryable_statuses_fail_over() {
    for status in [408, 429, 500, 502, 503, 504, 529] {
        assert_fails_over(json!({"kind": "error", "status": status}), "", false).await;
    }
    assert_fails_over(json!({"kind": "error", "status": 503}), "", true).await;
}

#[tokio::test]
async fn transport_faults_fail_over() {
    assert_fails_over(json!({"kind": "reset"}), "", false).await;
    assert_fails_over(json!({"kind": "reset"}), "", true).await;
    // A malformed body (non-streaming) and a malformed first event (streaming).
    assert_fails_over(json!({"kind": "malformed", "after_tokens": 0}), "", false).await;
    assert_fails_over(json!({"kind": "malformed", "after_tokens": 0}), "", true).await;
    // A stream that dies before its first token.
    assert_fails_over(json!({"kind": "close", "after_tokens": 0}), "", true).await;
}

#[tokio::test]
async fn first_token_timeout_fails_over() {
    assert_fails_over(json!({"kind": "hang"}), "first_token_ms = 200", true).await;
    assert_fails_over(
        json!({"kind": "stall", "after_tokens": 0}),
        "first_token_ms = 200",
        true,
    )
    .await;
}

#[tokio::test]
async fn connect_errors_fail_over_and_cool_down() {
    let fleet = keel_sim::Fleet::start_n(1, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    // A closed port: bind then drop a listener to get one nobody listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cfg = format!(
        "[[pools]]\nname = \"p\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}{}",
        variant("dead", &format!("http://{dead}/v1"), "openai", 1000),
        variant("live", &fleet.get(0).openai_base(), "openai", 1)
    );
    let h = Harness::start(fleet, &cfg).await;
    let (status, headers, _) = h.chat(&chat_body("x")).await;
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "x-keel-variant"), "live");
    assert_eq!(header(&headers, "x-keel-attempts"), "2");
    // The dead variant refused the connection: it is restarting (warming, checked by the
    // monitor's warm-ups), so the next request goes straight to the live one.
    let (_, headers, _) = h.chat(&chat_body("x")).await;
    assert_eq!(header(&headers, "x-keel-attempts"), "1");
    let failed = h
        .metric(
            "keel_attempts_total",
            &[
                ("variant", "dead"),
                ("kind", "first"),
                ("outcome", "connect_error"),
            ],
        )
        .await;
    assert_eq!(failed, 1.0);
}

#[tokio::test]
async fn client_errors_are_returned_unchanged_and_never_retried() {
    for (status, fault) in [
        (400, json!({"kind": "error", "status": 400})),
        (413, json!({"kind": "error", "status": 413})),
        (422, json!({"kind": "error", "status": 422})),
    ] {
        let h = Harness::openai(2, 1000, "", "").await;
        add_fault(h.server(0), fault).await;
        let (got, headers, body) = h.chat(&chat_body("x")).await;
        assert_eq!(got, status);
        assert_eq!(header(&headers, "x-keel-attempts"), "1");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&format!("HTTP {status}")),
            "upstream body passed through: {body}"
        );
        assert_eq!(
            h.server(1).state.stats().requests,
            0,
            "{status} must not reach another variant"
        );
    }
}

#[tokio::test]
async fn upstream_404_is_not_retried() {
    let cfg = keel_sim::ServerConfig {
        models: vec!["other".into()],
        ..keel_sim::ServerConfig::fast("s")
    };
    let fleet = keel_sim::Fleet::start_n(2, cfg).await.unwrap();
    let toml = pool_over(&fleet, "p", "openai", 1000, "");
    let h = Harness::start(fleet, &toml).await;
    let (status, headers, body) = h.chat(&chat_body("x")).await;
    assert_eq!(status, 404);
    assert_eq!(header(&headers, "x-keel-attempts"), "1");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("does not exist"));
    assert_eq!(h.server(1).state.stats().requests, 0);
}

#[tokio::test]
async fn safety_refusal_is_returned_as_given() {
    // A refusal is a successful response whose content is the refusal; keel returns it untouched
    // and never routes around it. The simulator's 400 content-filter shape is an upstream 400.
    let h = Harness::openai(2, 1000, "", "").await;
    add_fault(h.server(0), json!({"kind": "error", "status": 400})).await;
    let (status, _, _) = h.chat(&chat_body("something unsafe")).await;
    assert_eq!(status, 400);
    assert_eq!(h.server(1).state.stats().requests, 0);
}

#[tokio::test]
async fn broken_credential_fails_over_and_marks_the_variant() {
    let fleet = keel_sim::Fleet::start_n(
        1,
        keel_sim::ServerConfig {
            api_key: Some("right".into()),
            ..keel_sim::ServerConfig::fast("s")
        },
    )
    .await
    .unwrap();
    let base = fleet.get(0).openai_base();
    let cfg = format!(
        "[[pools]]\nname = \"p\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}api_key = \"wrong\"\n{}api_key = \"right\"\n",
        variant("bad-key", &base, "openai", 1000),
        variant("good-key", &base, "openai", 1)
    );
    let h = Harness::start(fleet, &cfg).await;
    let (status, headers, _) = h.chat(&chat_body("x")).await;
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "x-keel-variant"), "good-key");
    // A client's 401 is confirmed by keel's own request before the variant is marked.
    wait_for!(
        "keel's own request to confirm the refused credential",
        h.get_json("/keel/health").await["pools"][0]["variants"][0]["credential_broken"] == true
    );
    let health: Value = h.get_json("/keel/health").await;
    let v = &health["pools"][0]["variants"][0];
    assert_eq!(v["credential_broken"], true);
    assert_eq!(v["available"], false);
    // Skipped while marked: served directly by the good variant.
    let (_, headers, _) = h.chat(&chat_body("x")).await;
    assert_eq!(header(&headers, "x-keel-attempts"), "1");
}

#[tokio::test]
async fn retry_after_sets_an_exact_cooldown() {
    let h = Harness::openai(2, 1000, "", "").await;
    add_fault(
        h.server(0),
        json!({"kind": "error", "status": 429, "retry_after_s": 1, "count": 1}),
    )
    .await;
    let (_, headers, _) = h.chat(&chat_body("x")).await;
    assert_eq!(header(&headers, "x-keel-variant"), "sim-1");
    let health: Value = h.get_json("/keel/health").await;
    let cooldown = health["pools"][0]["variants"][0]["cooldown_ms"]
        .as_u64()
        .unwrap();
    assert!(cooldown > 0 && cooldown <= 1000, "{cooldown}");
    for _ in 0..5 {
        let (_, headers, _) = h.chat(&chat_body("x")).await;
        assert_eq!(
            header(&headers, "x-keel-variant"),
            "sim-1",
            "sim-0 is cooling down"
        );
    }
    wait_for!(
        "sim-0's cooldown to end",
        h.get_json("/keel/health").await["pools"][0]["variants"][0]["available"] == true
    );
    let (_, headers, _) = h.chat(&chat_body("x")).await;
    assert_eq!(
        header(&headers, "x-keel-variant"),
        "sim-0",
        "back after its retry-after"
    );
}

#[tokio::test]
async fn a_lone_variant_is_tried_again_after_its_short_cooldown() {
    // One variant; its first answer is a 429 asking for 1 s: a cooldown. With nothing else to
    // try, the request waits it out and is served (not answered 503: the server is healthy).
    let h = Harness::openai(1, 1, "", "").await;
    add_fault(
        h.server(0),
        json!({"kind": "error", "status": 429, "retry_after_s": 1, "count": 1}),
    )
    .await;
    let (status, headers, body) = h.chat(&chat_body("x")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header(&headers, "x-keel-attempts"), "2");
    assert_eq!(h.server(0).state.stats().requests, 2);
    // A longer retry-after earned by a client's request holds the variant out for a second
    // at most until keel's own request confirms it (see `settlement::classify`): this one
    // expires before the confirmation, so the request waits the second and is served.
    add_fault(
        h.server(0),
        json!({"kind": "error", "status": 429, "retry_after_s": 3, "count": 1}),
    )
    .await;
    let (status, headers, body) = h.chat(&chat_body("x")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header(&headers, "x-keel-attempts"), "2");
}

#[tokio::test]
async fn everything_failing_gives_a_precise_error_in_each_protocol() {
    let h = Harness::openai(2, 1, "", "").await;
    for s in &h.fleet.servers {
        add_fault(s, json!({"kind": "error", "status": 500})).await;
    }
    let (status, _, body) = h.chat(&chat_body("x")).await;
    assert_eq!(status, 502);
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("sim-0: HTTP 500") && msg.contains("sim-1: HTTP 500"),
        "{msg}"
    );
    assert_eq!(body["error"]["type"], "api_error");

    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    for s in &fleet.servers {
        add_fault(
            s,
            json!({"kind": "error", "status": 529, "retry_after_s": 3}),
        )
        .await;
    }
    let cfg = pool_over(&fleet, "c", "anthropic", 1, "");
    let h = Harness::start(fleet, &cfg).await;
    let r = h
        .post(
            "/v1/messages",
            &json!({"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(r.headers(), "retry-after"), "3");
    assert_eq!(header(r.headers(), "retry-after-ms"), "3000");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "overloaded_error");
    // Both are cooling down now: keel answers at once with the exact wait.
    let r = h
        .post(
            "/v1/messages",
            &json!({"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 503);
    let wait: u64 = header(r.headers(), "retry-after-ms").parse().unwrap();
    assert!(wait > 0 && wait <= 3000, "{wait}");
}

#[tokio::test]
async fn attempts_are_bounded_by_max_attempts() {
    let h = Harness::openai(4, 1, "", "max_attempts = 2").await;
    for s in &h.fleet.servers {
        add_fault(s, json!({"kind": "error", "status": 503})).await;
    }
    let (status, headers, _) = h.chat(&chat_body("x")).await;
    assert_eq!(status, 503);
    assert_eq!(header(&headers, "x-keel-attempts"), "2");
    let total: u64 = h
        .fleet
        .servers
        .iter()
        .map(|s| s.state.stats().requests)
        .sum();
    assert_eq!(total, 2);
}

#[tokio::test]
async fn retry_budget_stops_retry_storms() {
    let top = "[retry_budget]\nratio = 0.0\nmin_retries_per_sec = 0\n";
    let h = Harness::openai(2, 1000, top, "").await;
    add_fault(h.server(0), json!({"kind": "error", "status": 500})).await;
    let (status, headers, body) = h.chat(&chat_body("x")).await;
    assert_eq!(status, 502);
    assert_eq!(header(&headers, "x-keel-attempts"), "1");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("retry budget"));
    assert_eq!(
        h.metric("keel_retry_budget_exhausted_total", &[("pool", "p")])
            .await,
        1.0
    );
}

#[tokio::test]
async fn client_deadline_caps_every_attempt() {
    let h = Harness::openai(2, 1, "", "").await;
    for s in &h.fleet.servers {
        add_fault(s, json!({"kind": "hang"})).await;
    }
    let started = std::time::Instant::now();
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-timeout-ms", "300")],
            &chat_body("x"),
        )
        .await;
    assert_eq!(r.status(), 504);
    assert!(started.elapsed() >= Duration::from_millis(300));
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("deadline"),
        "{v}"
    );
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-timeout-ms", "soon")],
            &chat_body("x"),
        )
        .await;
    assert_eq!(r.status(), 400);
}
