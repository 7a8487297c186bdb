//! Nothing bypasses the safeguards: continuations after the first byte are attempts like any
//! other (retry budget, learned limits, credentials), and a stream ends cleanly only when keel
//! says so, even when the task producing it dies.

use std::sync::atomic::Ordering;

use futures_util::future::join_all;
use serde_json::{json, Value};

use crate::harness::*;

/// Upstream requests every simulated server has received.
fn upstream_requests(h: &Harness) -> u64 {
    h.fleet
        .servers
        .iter()
        .map(|s| s.state.stats().requests)
        .sum()
}

fn terminal_errors(events: &[keel_core::sse::SseEvent]) -> usize {
    events
        .iter()
        .filter(|e| e.data.contains("the response is incomplete"))
        .count()
}

#[tokio::test]
async fn migrations_spend_the_retry_budget_when_every_variant_rate_limits_mid_stream() {
    // Every stream stalls after 3 tokens; once all have reached the client, every variant
    // starts answering 429. Without a budget each of the 10 streams would try a continuation
    // on each of the 3 other variants (40 upstream requests); with 20% of 10 requests, two
    // continuations are allowed in all.
    let top = "[retry_budget]\nratio = 0.2\nmin_retries_per_sec = 0\nwindow_ms = 60000";
    let extra = "hedge = \"off\"\nmax_migrations = 3\nadaptive_stall = false\nstall_ms = 300";
    let h = Harness::openai(4, 1, top, extra).await;
    for i in 0..4 {
        add_fault(h.server(i), json!({"kind": "stall", "after_tokens": 3})).await;
    }
    let bodies: Vec<Value> = (0..10).map(|i| stream_body(&format!("q{i}"))).collect();
    let streams = join_all(bodies.iter().map(|b| h.post("/v1/chat/completions", b))).await;
    assert!(streams.iter().all(|r| r.status() == 200));
    assert_eq!(upstream_requests(&h), 10);
    for i in 0..4 {
        add_fault(
            h.server(i),
            json!({"kind": "error", "status": 429, "retry_after_s": 1}),
        )
        .await;
    }
    let bodies = join_all(streams.into_iter().map(read_stream)).await;
    for events in &bodies {
        assert_eq!(
            terminal_errors(events),
            1,
            "each stream ends with one error event"
        );
        assert!(
            !events.iter().any(|e| e.data == "[DONE]"),
            "never a clean end"
        );
    }
    assert_eq!(
        upstream_requests(&h),
        12,
        "10 requests + 2 budgeted continuations"
    );
    let continuations = h
        .metric("keel_attempts_total", &[("kind", "continuation")])
        .await;
    assert_eq!(continuations, 2.0);
    let refused = h
        .metric("keel_retry_budget_exhausted_total", &[("pool", "p")])
        .await;
    assert!(
        refused >= 8.0,
        "every other stream's migration was refused: {refused}"
    );
    // The continuations' 429s arrived while other streams ran on their variants: the variants
    // are full, not broken, and each learned a concurrency limit.
    let health = h.get_json("/keel/health").await;
    let variants = health["pools"][0]["variants"].as_array().unwrap();
    // Full (a limit learned) or, if the 429 came to a lone request, a quota (a cooldown): either
    // way the settlement acted on it.
    let acted = variants
        .iter()
        .filter(|v| v["concurrency_limit"].is_u64() || v["cooldown_ms"].as_u64() > Some(0))
        .count();
    assert!(acted >= 1, "{health}");
    assert_eq!(
        h.metric(
            "keel_attempts_total",
            &[("kind", "continuation"), ("outcome", "status_429")]
        )
        .await,
        2.0
    );
    // Each stream's first attempt is counted once, when it ended (a stall), never as `ok`.
    assert_eq!(
        h.metric(
            "keel_attempts_total",
            &[("kind", "first"), ("outcome", "stall")]
        )
        .await,
        10.0
    );
    assert_eq!(
        h.metric("keel_attempts_total", &[("outcome", "ok")]).await,
        0.0
    );
}

#[tokio::test]
async fn a_continuation_refused_with_401_marks_the_credential_and_moves_on() {
    // Round robin orders fallbacks by weight: after the forced sim-0, sim-1 then sim-2.
    let fleet = keel_sim::Fleet::start_n(3, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let mut cfg = String::from(
        "allow_force_variant = true\n[[pools]]\nname = \"p\"\npolicy = \"round_robin\"\nhedge = \"off\"\nadaptive_stall = false\nstall_ms = 300\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n",
    );
    for (i, w) in [1, 5, 2].iter().enumerate() {
        let s = fleet.get(i);
        cfg.push_str(&variant(&s.name, &s.openai_base(), "openai", *w));
    }
    let h = Harness::start(fleet, &cfg).await;
    add_fault(h.server(0), json!({"kind": "stall", "after_tokens": 4})).await;
    add_fault(h.server(1), json!({"kind": "error", "status": 401})).await;
    let resp = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-force-variant", "sim-0")],
            &stream_body("tell me a story"),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let events = read_stream(resp).await;
    assert_eq!(terminal_errors(&events), 0);
    assert_eq!(events.iter().filter(|e| e.data == "[DONE]").count(), 1);
    let note = events
        .iter()
        .find(|e| e.comment_only && String::from_utf8_lossy(&e.raw).contains("keel migrated"))
        .map(|e| String::from_utf8_lossy(&e.raw).into_owned())
        .expect("a migration note");
    assert!(note.contains("from=sim-0 to=sim-2"), "{note}");
    // Marked once keel's own request confirms the refusal (the monitor's next tick).
    wait_for!(
        "sim-1's credential confirmed broken",
        h.get_json("/keel/health").await["pools"][0]["variants"][1]["credential_broken"] == true
    );
    let health = h.get_json("/keel/health").await;
    let sim1 = &health["pools"][0]["variants"][1];
    assert_eq!(sim1["name"], "sim-1");
    assert_eq!(sim1["credential_broken"], true, "{health}");
    assert_eq!(
        h.metric(
            "keel_variant_credential_broken_total",
            &[("variant", "sim-1")]
        )
        .await,
        1.0
    );
    assert_eq!(
        h.metric(
            "keel_attempts_total",
            &[
                ("variant", "sim-1"),
                ("kind", "continuation"),
                ("outcome", "status_401")
            ]
        )
        .await,
        1.0
    );
    // The decision record lists every attempt with its kind and outcome.
    let decisions = h.get_json("/keel/decisions").await;
    let attempts: Vec<(String, String, String)> = decisions[0]["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let s = |k: &str| a[k].as_str().unwrap().to_owned();
            (s("variant"), s("kind"), s("outcome"))
        })
        .collect();
    let want = [
        ("sim-0", "first", "stall"),
        ("sim-1", "continuation", "status_401"),
        ("sim-2", "continuation", "ok"),
    ]
    .map(|(a, b, c)| (a.to_owned(), b.to_owned(), c.to_owned()));
    assert_eq!(attempts, want);
}

/// Reads a body to its end: the bytes and whether it ended with a transport error.
async fn read_to_end(mut resp: reqwest::Response) -> (Vec<u8>, bool) {
    let mut bytes = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => bytes.extend_from_slice(&c),
            Ok(None) => return (bytes, false),
            Err(_) => return (bytes, true),
        }
    }
}

#[tokio::test]
async fn a_relay_that_panics_never_ends_the_stream_cleanly() {
    for protocol in ["openai", "anthropic"] {
        for http2 in [false, true] {
            let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
                .await
                .unwrap();
            let cfg = pool_over(&fleet, "p", protocol, 1, "hedge = \"off\"");
            let h = Harness::start(fleet, &cfg).await;
            h.gw.hooks
                .relay_panic_after_events
                .store(3, Ordering::Relaxed);
            let (path, body) = if protocol == "openai" {
                ("/v1/chat/completions", stream_body("hello there"))
            } else {
                (
                    "/v1/messages",
                    json!({"model": "p", "max_tokens": 50, "stream": true, "messages": [{"role": "user", "content": "hello there"}]}),
                )
            };
            let mut client = reqwest::Client::builder().no_proxy();
            if http2 {
                client = client.http2_prior_knowledge();
            }
            let resp = client
                .build()
                .unwrap()
                .post(h.url(path))
                .header("anthropic-version", "2023-06-01")
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            assert_eq!(
                resp.version(),
                if http2 {
                    reqwest::Version::HTTP_2
                } else {
                    reqwest::Version::HTTP_11
                }
            );
            let (bytes, aborted) = read_to_end(resp).await;
            let case = format!("{protocol} over HTTP/{}", if http2 { 2 } else { 1 });
            assert!(aborted, "{case}: the body must not end cleanly");
            let events = keel_core::sse::decode_all(&bytes).expect("whole events only");
            assert!(
                !events
                    .iter()
                    .any(|e| e.data == "[DONE]" || e.event.as_deref() == Some("message_stop")),
                "{case}: no terminal event"
            );
            let last = events.last().unwrap();
            let err: Value = serde_json::from_str(&last.data).unwrap();
            let message = if protocol == "openai" {
                &err["error"]["message"]
            } else {
                assert_eq!(last.event.as_deref(), Some("error"), "{case}");
                &err["error"]["message"]
            };
            assert!(
                message
                    .as_str()
                    .unwrap()
                    .contains("the response is incomplete"),
                "{case}: {err}"
            );
            // The request is accounted for as keel's failure, not as a success.
            wait_for!(
                format!("{case}: the request counted as incomplete"),
                h.metric("keel_requests_total", &[("outcome", "incomplete")])
                    .await
                    == 1.0
            );
            // Its attempt is counted once, as keel's own failure.
            assert_eq!(h.metric("keel_attempts_total", &[]).await, 1.0, "{case}");
            assert_eq!(
                h.metric("keel_attempts_total", &[("outcome", "internal_error")])
                    .await,
                1.0,
                "{case}"
            );
        }
    }
}

#[tokio::test]
async fn a_handler_that_panics_answers_500_in_the_clients_protocol() {
    // A non-streaming request is relayed inside its handler (streamed upstream and assembled:
    // a pool of two, where it could migrate): the panic unwinds through it.
    let h = Harness::openai(2, 1, "", "hedge = \"off\"").await;
    h.gw.hooks
        .relay_panic_after_events
        .store(1, Ordering::Relaxed);
    let (status, _, body) = h.chat(&chat_body("hello")).await;
    assert_eq!(status, 500);
    assert_eq!(body["error"]["type"], "api_error", "{body}");
    assert_eq!(
        h.metric("keel_requests_total", &[("outcome", "incomplete")])
            .await,
        1.0
    );
    assert_eq!(
        h.metric("keel_attempts_total", &[("outcome", "internal_error")])
            .await,
        1.0
    );
    // The gateway still serves.
    h.gw.hooks
        .relay_panic_after_events
        .store(0, Ordering::Relaxed);
    let (status, _, _) = h.chat(&chat_body("hello")).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn warm_ups_are_settled_like_any_attempt() {
    // A variant whose key is refused: its warm-up request (before any client traffic) marks the
    // credential, as a client attempt would, and no client request ever reaches it.
    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    add_fault(fleet.get(0), json!({"kind": "error", "status": 401})).await;
    let cfg = pool_over(
        &fleet,
        "p",
        "openai",
        1,
        "hedge = \"off\"\n[pools.health]\nprewarm_requests = 1",
    );
    let h = Harness::start(fleet, &cfg).await;
    wait_for!(
        "the warm-up to mark sim-0's credential",
        h.get_json("/keel/health").await["pools"][0]["variants"][0]["credential_broken"] == true
    );
    let warmup = [
        ("variant", "sim-0"),
        ("kind", "warmup"),
        ("outcome", "status_401"),
    ];
    assert_eq!(h.metric("keel_attempts_total", &warmup).await, 1.0);
    assert_eq!(
        h.metric(
            "keel_variant_credential_broken_total",
            &[("variant", "sim-0")]
        )
        .await,
        1.0
    );
    for _ in 0..5 {
        let (status, headers, _) = h.chat(&chat_body("x")).await;
        assert_eq!(status, 200);
        assert_eq!(header(&headers, "x-keel-variant"), "sim-1");
    }
    let first = [("variant", "sim-0"), ("kind", "first")];
    assert_eq!(h.metric("keel_attempts_total", &first).await, 0.0);
}
