//! Decision records and what keel says about itself: scripted traffic on keel-sim (a fallback, a
//! hedge, a migration, a throttle), the exact metric series each leaves, and the record fetched
//! by the response's `x-keel-request-id` explaining it; the ring's filters and eviction;
//! `x-keel-overhead-us`; keel's own answers labelled with their own routes.

use std::time::Instant;

use serde_json::{json, Value};

use keel_sim::{Fleet, ServerConfig};

use crate::harness::*;

/// The decision record of request `id`, once the request has let go of it (a stream's record
/// is kept when its relay ends, which may be just after the client read the last byte).
async fn record(h: &Harness, id: &str) -> Value {
    let url = h.url(&format!("/keel/decisions/{id}"));
    let mut found = None;
    wait_for!(format!("the decision record of {id}"), {
        let r = keel_sim::http_client().get(&url).send().await.unwrap();
        if r.status() == 200 {
            found = Some(r.json::<Value>().await.unwrap());
        }
        found.is_some()
    });
    found.unwrap()
}

async fn get(h: &Harness, path: &str) -> reqwest::Response {
    keel_sim::http_client()
        .get(h.url(path))
        .send()
        .await
        .unwrap()
}

/// `keel_requests_total` for pool `p`'s chat completions with this route and outcome.
async fn requests(h: &Harness, route: &str, outcome: &str) -> f64 {
    h.metric(
        "keel_requests_total",
        &[
            ("pool", "p"),
            ("endpoint", "chat_completions"),
            ("route", route),
            ("outcome", outcome),
        ],
    )
    .await
}

async fn attempts(h: &Harness, variant: &str, kind: &str, outcome: &str) -> f64 {
    h.metric(
        "keel_attempts_total",
        &[
            ("pool", "p"),
            ("variant", variant),
            ("kind", kind),
            ("outcome", outcome),
        ],
    )
    .await
}

/// The record's attempts as (variant, kind, outcome), in order.
fn attempt_list(rec: &Value) -> Vec<(String, String, String)> {
    rec["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let s = |k: &str| a[k].as_str().unwrap().to_owned();
            (s("variant"), s("kind"), s("outcome"))
        })
        .collect()
}

fn owned(v: &[(&str, &str, &str)]) -> Vec<(String, String, String)> {
    v.iter()
        .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
        .collect()
}

#[tokio::test]
async fn a_fallback_is_counted_and_its_record_explains_it() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "hedge = \"off\"").await;
    add_fault(
        h.server(0),
        json!({"kind": "error", "status": 503, "count": 1}),
    )
    .await;
    let sent = Instant::now();
    let resp = forced_sim0(&h, &chat_body("fall back")).await;
    let total_us = sent.elapsed().as_micros() as u64;
    assert_eq!(resp.status(), 200);
    let id = header(resp.headers(), "x-keel-request-id").to_owned();
    assert_eq!(header(resp.headers(), "x-keel-route"), "fallback");
    assert_eq!(header(resp.headers(), "x-keel-variant"), "sim-1");
    let overhead: u64 = header(resp.headers(), "x-keel-overhead-us")
        .parse()
        .expect("x-keel-overhead-us is a whole number of microseconds");
    assert!(
        overhead < total_us,
        "overhead {overhead} µs within the request's {total_us} µs"
    );

    assert_eq!(requests(&h, "fallback", "ok").await, 1.0);
    assert_eq!(requests(&h, "direct", "ok").await, 0.0);
    assert_eq!(attempts(&h, "sim-0", "first", "status_503").await, 1.0);
    assert_eq!(attempts(&h, "sim-1", "fallback", "ok").await, 1.0);
    let m = h.metrics().await;
    assert_eq!(
        parse_metric(
            &m,
            "keel_overhead_seconds_count",
            &[("pool", "p"), ("endpoint", "chat_completions")]
        ),
        1.0
    );

    let rec = record(&h, &id).await;
    assert_eq!(rec["request_id"], id);
    assert_eq!(rec["pool"], "p");
    assert_eq!(rec["endpoint"], "chat_completions");
    assert_eq!(rec["route"], "fallback");
    assert_eq!(rec["variant"], "sim-1");
    assert_eq!(rec["status"], 200);
    assert_eq!(rec["outcome"], "ok");
    assert_eq!(rec["overhead_us"], overhead);
    assert_eq!(
        attempt_list(&rec),
        owned(&[
            ("sim-0", "first", "status_503"),
            ("sim-1", "fallback", "ok")
        ])
    );
    let a = rec["attempts"].as_array().unwrap();
    let ms = |v: &Value, k: &str| v[k].as_f64().unwrap();
    assert!(ms(&a[0], "start_ms") <= ms(&a[0], "end_ms"));
    assert!(
        ms(&a[0], "end_ms") <= ms(&a[1], "start_ms"),
        "the fallback starts after the first attempt failed"
    );
    assert!(ms(&a[1], "ttft_ms") <= ms(&a[1], "end_ms"));
    // Every candidate with the factors of its cost.
    let cands = rec["candidates"].as_array().unwrap();
    assert_eq!(cands.len(), 2);
    for c in cands {
        for k in ["predicted_ttft_ms", "health", "weight", "in_flight", "tier"] {
            assert!(c[k].is_number(), "candidate field {k}: {c}");
        }
        for k in [
            "tgsv_ms",
            "error_rate",
            "kv_usage",
            "queue_waiting",
            "factors",
        ] {
            assert!(c.get(k).is_some(), "candidate field {k}: {c}");
        }
        assert_eq!(c["configured_weight"], 1);
        assert_eq!(c["eligible"], true);
    }
    assert_eq!(rec["plan"].as_array().unwrap().len(), 2);
    assert!(rec["hedges"].as_array().unwrap().is_empty());
    assert!(rec["migrations"].as_array().unwrap().is_empty());
}

#[tokio::test]
async fn a_hedge_is_counted_and_its_record_names_both_variants() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "hedge = 100").await;
    add_fault(
        h.server(0),
        json!({"kind": "stall", "after_tokens": 0, "count": 1}),
    )
    .await;
    let resp = forced_sim0(&h, &stream_body("hedge me")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(resp.headers(), "x-keel-route"), "hedged");
    let id = header(resp.headers(), "x-keel-request-id").to_owned();
    let overhead: u64 = header(resp.headers(), "x-keel-overhead-us")
        .parse()
        .unwrap();
    let events = read_stream(resp).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");

    let rec = record(&h, &id).await;
    assert_eq!(rec["route"], "hedged");
    assert_eq!(rec["variant"], "sim-1");
    assert_eq!(rec["overhead_us"], overhead);
    let hedges = rec["hedges"].as_array().unwrap();
    assert_eq!(hedges.len(), 1, "{rec}");
    assert_eq!(hedges[0]["from"], "sim-0");
    assert_eq!(hedges[0]["to"], "sim-1");
    assert_eq!(hedges[0]["reason"], "first_token_late");
    let mut list = attempt_list(&rec);
    list.sort();
    assert_eq!(
        list,
        owned(&[
            ("sim-0", "first", "race_cancelled"),
            ("sim-1", "hedge", "ok")
        ])
    );

    assert_eq!(requests(&h, "hedged", "ok").await, 1.0);
    assert_eq!(
        h.metric("keel_hedges_total", &[("pool", "p"), ("outcome", "won")])
            .await,
        1.0
    );
    assert_eq!(attempts(&h, "sim-0", "first", "race_cancelled").await, 1.0);
    assert_eq!(attempts(&h, "sim-1", "hedge", "ok").await, 1.0);
}

#[tokio::test]
async fn a_migration_is_counted_and_its_record_says_after_how_many_tokens() {
    let h = Harness::openai(2, 1, "allow_force_variant = true", "hedge = \"off\"").await;
    add_fault(
        h.server(0),
        json!({"kind": "close", "after_tokens": 4, "count": 1}),
    )
    .await;
    let resp = forced_sim0(&h, &stream_body("move me")).await;
    assert_eq!(resp.status(), 200);
    let id = header(resp.headers(), "x-keel-request-id").to_owned();
    let events = read_stream(resp).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let note = events
        .iter()
        .filter(|e| e.comment_only)
        .map(|e| String::from_utf8_lossy(&e.raw).into_owned())
        .find(|c| c.contains("keel migrated"))
        .expect("the seam is marked in the stream");

    let rec = record(&h, &id).await;
    assert_eq!(rec["route"], "migrated");
    assert_eq!(rec["variant"], "sim-1");
    let migrations = rec["migrations"].as_array().unwrap();
    assert_eq!(migrations.len(), 1, "{rec}");
    let m = &migrations[0];
    assert_eq!(m["from"], "sim-0");
    assert_eq!(m["to"], "sim-1");
    assert_eq!(m["reason"], "error");
    // The record and the stream's own note agree on where the seam is.
    let tokens = m["after_tokens"].as_u64().unwrap();
    assert!(note.contains(&format!("after_tokens={tokens}")), "{note}");
    assert_eq!(tokens, 4);
    assert_eq!(
        attempt_list(&rec),
        owned(&[
            ("sim-0", "first", "io_error"),
            ("sim-1", "continuation", "ok")
        ])
    );

    assert_eq!(requests(&h, "migrated", "ok").await, 1.0);
    assert_eq!(
        h.metric(
            "keel_migrations_total",
            &[("pool", "p"), ("reason", "error"), ("outcome", "ok")]
        )
        .await,
        1.0
    );
    assert_eq!(attempts(&h, "sim-0", "first", "io_error").await, 1.0);
    assert_eq!(attempts(&h, "sim-1", "continuation", "ok").await, 1.0);
}

#[tokio::test]
async fn a_throttled_request_is_labelled_and_its_record_shows_the_full_variant() {
    let cfg = ServerConfig {
        ttft_ms: 2_000.0,
        ..ServerConfig::fast("s")
    };
    let fleet = Fleet::start_n(1, cfg).await.unwrap();
    let mut config = pool_over(&fleet, "p", "openai", 1, "hedge = \"off\"\nqueue_ms = 50");
    config.push_str("max_concurrency = 1\n");
    let h = Harness::start(fleet, &config).await;
    let blocker = {
        let url = h.url("/v1/chat/completions");
        tokio::spawn(async move {
            keel_sim::http_client()
                .post(url)
                .json(&chat_body("hold the slot"))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    wait_for!("the slot taken", h.server(0).state.stats().running > 0);
    let (status, headers, body) = h.chat(&chat_body("no room")).await;
    assert!(status == 503 || status == 429, "{status}: {body}");
    assert_eq!(header(&headers, "x-keel-route"), "throttled");
    assert!(!header(&headers, "x-keel-overhead-us").is_empty());
    let id = header(&headers, "x-keel-request-id").to_owned();
    assert_eq!(blocker.await.unwrap(), 200);

    let outcome = if status == 503 {
        "error"
    } else {
        "client_error"
    };
    assert_eq!(requests(&h, "throttled", outcome).await, 1.0);
    assert_eq!(
        h.metric("keel_queue_refused_total", &[("pool", "p")]).await,
        1.0
    );
    let rec = record(&h, &id).await;
    assert_eq!(rec["route"], "throttled");
    assert_eq!(rec["status"], status);
    assert!(rec["attempts"].as_array().unwrap().is_empty());
    let c = &rec["candidates"][0];
    assert_eq!(c["variant"], "sim-0");
    assert_eq!(c["eligible"], false, "at its limit: {c}");
    assert_eq!(c["in_flight"], 1);
    assert_eq!(c["concurrency_limit"], 1);
}

#[tokio::test]
async fn the_ring_keeps_the_latest_and_filters_them() {
    let h = Harness::openai(
        2,
        1,
        "allow_force_variant = true\ndecisions_kept = 3",
        "hedge = \"off\"",
    )
    .await;
    let mut ids = Vec::new();
    for i in 0..4 {
        let resp = h
            .post_with(
                "/v1/chat/completions",
                &[(
                    "x-keel-force-variant",
                    if i % 2 == 0 { "sim-0" } else { "sim-1" },
                )],
                &chat_body(&format!("n{i}")),
            )
            .await;
        assert_eq!(resp.status(), 200);
        ids.push(header(resp.headers(), "x-keel-request-id").to_owned());
        resp.bytes().await.unwrap();
    }
    // A bad request is kept too, as `rejected`.
    let resp = h
        .post(
            "/v1/chat/completions",
            &json!({"model": "p", "messages": 3}),
        )
        .await;
    assert_eq!(resp.status(), 400);
    assert_eq!(header(resp.headers(), "x-keel-route"), "rejected");
    ids.push(header(resp.headers(), "x-keel-request-id").to_owned());
    record(&h, &ids[4]).await;

    let listed = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r["request_id"].as_str().unwrap().to_owned())
            .collect()
    };
    // Newest first; the two oldest were evicted.
    let all = h.get_json("/keel/decisions").await;
    assert_eq!(
        listed(&all),
        [ids[4].clone(), ids[3].clone(), ids[2].clone()]
    );
    let gone = get(&h, &format!("/keel/decisions/{}", ids[0])).await;
    assert_eq!(gone.status(), 404);
    assert_eq!(header(gone.headers(), "x-keel-route"), "rejected");
    let err: Value = gone.json().await.unwrap();
    assert_eq!(err["error"]["type"], "not_found_error", "{err}");
    assert_eq!(get(&h, "/keel/decisions/no-such-id").await.status(), 404);

    assert_eq!(
        listed(&h.get_json("/keel/decisions?variant=sim-1").await),
        [ids[3].clone()]
    );
    assert_eq!(
        listed(&h.get_json("/keel/decisions?route=rejected").await),
        [ids[4].clone()]
    );
    assert_eq!(
        listed(
            &h.get_json("/keel/decisions?pool=p&route=direct&limit=1")
                .await
        ),
        [ids[3].clone()]
    );
    for bad in ["limit=0", "limit=1001", "limit=ten", "colour=red"] {
        let r = get(&h, &format!("/keel/decisions?{bad}")).await;
        assert_eq!(r.status(), 400, "{bad}");
        let err: Value = r.json().await.unwrap();
        assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
    }
    let rejected = record(&h, &ids[4]).await;
    assert_eq!(rejected["status"], 400);
    assert_eq!(rejected["pool"], "none", "refused before a pool was chosen");
    assert_eq!(
        h.metric(
            "keel_requests_total",
            &[
                ("pool", "none"),
                ("endpoint", "chat_completions"),
                ("route", "rejected"),
                ("outcome", "client_error")
            ]
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn keels_own_answers_carry_a_request_id_and_their_own_route() {
    let h = Harness::openai(1, 1, "", "").await;
    for (method, path, status, route) in [
        ("GET", "/v1/models", 200, "local"),
        ("GET", "/keel/health", 200, "local"),
        ("GET", "/keel/decisions", 200, "local"),
        ("GET", "/metrics", 200, "local"),
        ("GET", "/v1/nope", 404, "rejected"),
        ("POST", "/keel/health", 405, "rejected"),
        ("GET", "/v1/models/unknown", 404, "rejected"),
    ] {
        let r = keel_sim::http_client()
            .request(method.parse().unwrap(), h.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{method} {path}");
        assert_eq!(
            header(r.headers(), "x-keel-route"),
            route,
            "{method} {path}"
        );
        let id = header(r.headers(), "x-keel-request-id");
        assert_eq!(id.len(), 36, "{method} {path}: a UUID, got `{id}`");
    }
    // An unknown model is keel's own refusal, not a `direct` answer.
    let (status, headers, _) = h
        .chat(&json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}))
        .await;
    assert_eq!(status, 404);
    assert_eq!(header(&headers, "x-keel-route"), "rejected");
    let overhead: u64 = header(&headers, "x-keel-overhead-us").parse().unwrap();
    let rec = record(&h, header(&headers, "x-keel-request-id")).await;
    assert_eq!(rec["overhead_us"], overhead);
    assert_eq!(rec["route"], "rejected");
}

/// A pool larger than a record lists: the record names the chosen variant and the plan's head
/// among at most 16 candidates, and counts the others.
#[tokio::test]
async fn a_large_pools_record_lists_sixteen_candidates_and_counts_the_rest() {
    let h = Harness::openai(20, 1, "", "hedge = \"off\"").await;
    let (status, headers, body) = h.chat(&chat_body("large pool")).await;
    assert_eq!(status, 200, "{body}");
    let id = header(&headers, "x-keel-request-id").to_owned();
    let rec = record(&h, &id).await;
    let cands = rec["candidates"].as_array().unwrap();
    assert_eq!(cands.len(), 16, "{rec}");
    let listed: Vec<&str> = cands
        .iter()
        .map(|c| c["variant"].as_str().unwrap())
        .collect();
    let variant = rec["variant"].as_str().unwrap();
    assert!(listed.contains(&variant), "{variant} not in {listed:?}");
    let plan = rec["plan"].as_array().unwrap();
    assert!(!plan.is_empty() && plan.len() <= 16, "{rec}");
    assert!(listed.contains(&plan[0].as_str().unwrap()));
    let omitted = &rec["candidates_omitted"];
    assert_eq!(omitted["count"], 4, "{omitted}");
    let by_state: u64 = omitted["by_state"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(by_state, 4, "{omitted}");
    assert!(omitted["eligible"].as_u64().unwrap() <= 4);
    assert!(omitted["plan_tail"].is_number());
}
