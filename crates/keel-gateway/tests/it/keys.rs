//! Virtual keys in front of keel-sim: authentication shapes, exact limits, reservations and
//! their reconciliation, rate-limit headers, the admin endpoint, and the client's key never
//! reaching an upstream.

use std::time::Instant;

use futures_util::future::join_all;
use keel_gateway::state::keys::{hash_secret, hash_text};
use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};

use crate::harness::*;

const KEY_A: &str = "sk-keel-test-key-a";
const KEY_B: &str = "sk-keel-test-key-b";
const ADMIN: &str = "sk-keel-test-admin";

fn hash(k: &str) -> String {
    hash_text(&hash_secret(k))
}

/// Two pools (`p`, `q`) over one sim; key `a` with `a_limits`, key `b` restricted to `q`.
async fn keyed(server: ServerConfig, a_limits: &str) -> Harness {
    let fleet = Fleet::start_n(1, server).await.unwrap();
    let cfg = format!(
        "[admin]\nkey_hash = \"{}\"\n\n[[keys]]\nid = \"a\"\nhash = \"{}\"\ntenant = \"team-a\"\n{a_limits}\n\n[[keys]]\nid = \"b\"\nhash = \"{}\"\npools = [\"q\"]\n\n{}\n{}",
        hash(ADMIN),
        hash(KEY_A),
        hash(KEY_B),
        pool_over(&fleet, "p", "openai", 1, ""),
        pool_over(&fleet, "q", "openai", 1, ""),
    );
    let mut h = Harness::start(fleet, &cfg).await;
    h.ops_key = Some(ADMIN.into());
    h
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

async fn chat_as(h: &Harness, key: &str, body: &Value) -> reqwest::Response {
    h.post_with(
        "/v1/chat/completions",
        &[("authorization", &bearer(key))],
        body,
    )
    .await
}

async fn usage(h: &Harness, id: &str) -> Value {
    keel_sim::http_client()
        .get(h.url(&format!("/keel/keys/{id}/usage")))
        .header("authorization", bearer(ADMIN))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn messages_body(model: &str) -> Value {
    json!({"model": model, "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]})
}

#[tokio::test]
async fn missing_unknown_and_forbidden_keys_in_each_protocols_shape() {
    let h = keyed(ServerConfig::fast("s"), "").await;
    // OpenAI: no key, an unknown key, a pool the key may not use.
    let r = h.post("/v1/chat/completions", &chat_body("x")).await;
    assert_eq!(r.status(), 401);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "authentication_error");
    let r = chat_as(&h, "sk-wrong", &chat_body("x")).await;
    assert_eq!(r.status(), 401);
    let r = chat_as(&h, KEY_B, &chat_body("x")).await;
    assert_eq!(r.status(), 403);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "permission_error");
    assert!(b["error"]["message"].as_str().unwrap().contains("`b`"));
    // Anthropic, with x-api-key.
    let anthropic = |key: &'static str| {
        let h = &h;
        async move {
            let mut hs = vec![("anthropic-version", "2023-06-01")];
            if !key.is_empty() {
                hs.push(("x-api-key", key));
            }
            let r = h.post_with("/v1/messages", &hs, &messages_body("p")).await;
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (s, b) = anthropic("").await;
    assert_eq!(
        (s, b["type"].as_str(), b["error"]["type"].as_str()),
        (401, Some("error"), Some("authentication_error"))
    );
    let (s, b) = anthropic(KEY_B).await;
    assert_eq!(
        (s, b["error"]["type"].as_str()),
        (403, Some("permission_error"))
    );
    let (s, _) = anthropic(KEY_A).await;
    assert_eq!(s, 200);
    // The model list: 401 without a key, only the key's pools with one.
    let models = |key: Option<&'static str>| {
        let h = &h;
        async move {
            let mut r = keel_sim::http_client().get(h.url("/v1/models"));
            if let Some(k) = key {
                r = r.header("authorization", bearer(k));
            }
            let r = r.send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    assert_eq!(models(None).await.0, 401);
    let (s, b) = models(Some(KEY_B)).await;
    assert_eq!(s, 200);
    let ids: Vec<&str> = b["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["q"]);
    assert_eq!(
        models(Some(KEY_A)).await.1["data"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

#[tokio::test]
async fn the_clients_key_never_reaches_the_upstream() {
    let h = keyed(ServerConfig::fast("s"), "").await;
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("authorization", &bearer(KEY_A)), ("x-api-key", KEY_A)],
            &chat_body("x"),
        )
        .await;
    assert_eq!(r.status(), 200);
    let seen = h.server(0).state.last_headers();
    assert!(!seen.is_empty());
    for (k, v) in &seen {
        assert!(
            !v.contains(KEY_A),
            "the client's key reached the upstream in `{k}`"
        );
    }
}

#[tokio::test]
async fn rpm_admits_exactly_the_limit_and_says_the_gcra_wait() {
    let h = keyed(ServerConfig::fast("s"), "rpm = 3").await;
    let before = Instant::now();
    for _ in 0..3 {
        assert_eq!(chat_as(&h, KEY_A, &chat_body("x")).await.status(), 200);
    }
    let r = chat_as(&h, KEY_A, &chat_body("x")).await;
    let elapsed_ms = before.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-keel-route"], "throttled");
    let ms: f64 = r.headers()["retry-after-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // GCRA at 3/min: one request every 20 s. Three taken from t0 leave the theoretical
    // arrival time at t0 + 60 s; a fourth at t3 waits until t0 + 20 s, i.e. 20 s − (t3 − t0),
    // and t3 − t0 lies within what this test measured around the four requests.
    assert!(
        ms <= 20_000.0 && ms >= 20_000.0 - elapsed_ms - 1.0,
        "retry-after-ms {ms}, elapsed {elapsed_ms}"
    );
    assert_eq!(r.headers()["retry-after"], "20");
    assert_eq!(r.headers()["x-ratelimit-remaining-requests"], "0");
    let b: Value = r.json().await.unwrap();
    let msg = b["error"]["message"].as_str().unwrap();
    assert!(msg.contains("rpm") && msg.contains("`a`"), "{msg}");
    assert_eq!(h.server(0).state.stats().requests, 3);
    assert_eq!(
        h.metric(
            "keel_ratelimited_total",
            &[("key", "a"), ("kind", "requests")]
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn tpm_reserves_max_tokens_and_gives_back_what_was_not_used() {
    let h = keyed(ServerConfig::fast("s"), "tpm = 1000").await;
    let mut body = chat_body("x");
    body["max_tokens"] = json!(600);
    let r = chat_as(&h, KEY_A, &body).await;
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let used = b["usage"]["total_tokens"].as_u64().unwrap();
    assert!(used < 300, "the sim's answer is short ({used} tokens)");
    // Reserved ~610, used far less: the rest comes back, so a second reservation of ~610
    // fits in 1000 only thanks to the reconciliation.
    wait_for!("reconciliation", {
        let u = usage(&h, "a").await;
        u["limits"]["tokens"]["remaining"].as_u64().unwrap() >= 1000 - used - 1
    });
    assert_eq!(chat_as(&h, KEY_A, &body).await.status(), 200);
    // A request larger than the whole limit can never fit: 400.
    body["max_tokens"] = json!(2000);
    let r = chat_as(&h, KEY_A, &body).await;
    assert_eq!(r.status(), 400);
    let b: Value = r.json().await.unwrap();
    assert!(b["error"]["message"]
        .as_str()
        .unwrap()
        .contains("can never fit"));
    assert!(
        h.metric(
            "keel_tokens_total",
            &[("key", "a"), ("direction", "output")]
        )
        .await
            > 0.0
    );
}

#[tokio::test]
async fn a_budget_under_concurrency_sends_no_more_than_it_can_pay() {
    // Slow first tokens: all 20 requests are admitted while the first ones are in flight.
    let server = ServerConfig {
        ttft_ms: 1500.0,
        ..ServerConfig::fast("s")
    };
    // Each request reserves its prompt (a few tokens) + 1000: five fit in 5500, six do not.
    let h = keyed(server, "daily_tokens = 5500").await;
    let mut body = chat_body("x");
    body["max_tokens"] = json!(1000);
    let all = join_all((0..20).map(|_| chat_as(&h, KEY_A, &body))).await;
    let ok = all.iter().filter(|r| r.status() == 200).count();
    let refused = all.iter().filter(|r| r.status() == 429).count();
    assert_eq!((ok, refused), (5, 15));
    assert_eq!(h.server(0).state.stats().requests, 5);
    assert_eq!(
        h.metric(
            "keel_ratelimited_total",
            &[("key", "a"), ("kind", "budget")]
        )
        .await,
        15.0
    );
}

#[tokio::test]
async fn max_concurrency_holds_a_slot_until_the_stream_ends() {
    let server = ServerConfig {
        gap_ms: 20.0,
        ..ServerConfig::fast("s")
    };
    let h = keyed(server, "max_concurrency = 2").await;
    let s1 = chat_as(&h, KEY_A, &stream_body("x")).await;
    let s2 = chat_as(&h, KEY_A, &stream_body("y")).await;
    assert_eq!((s1.status().as_u16(), s2.status().as_u16()), (200, 200));
    assert_eq!(usage(&h, "a").await["in_flight"], 2);
    let r = chat_as(&h, KEY_A, &stream_body("z")).await;
    assert_eq!(r.status(), 429);
    assert!(r.text().await.unwrap().contains("max_concurrency"));
    // Read both streams to their end: the slots come back.
    s1.text().await.unwrap();
    s2.text().await.unwrap();
    wait_for!("slots released", usage(&h, "a").await["in_flight"] == 0);
    let r = chat_as(&h, KEY_A, &stream_body("z")).await;
    assert_eq!(r.status(), 200);
    r.text().await.unwrap();
}

#[tokio::test]
async fn rate_limit_headers_in_each_protocol() {
    let h = keyed(ServerConfig::fast("s"), "rpm = 10\ntpm = 100000").await;
    let r = chat_as(&h, KEY_A, &stream_body("x")).await;
    assert_eq!(r.status(), 200);
    let hs = r.headers().clone();
    r.text().await.unwrap();
    assert_eq!(hs["x-ratelimit-limit-requests"], "10");
    assert_eq!(hs["x-ratelimit-remaining-requests"], "9");
    assert_eq!(hs["x-ratelimit-reset-requests"], "6s");
    assert_eq!(hs["x-ratelimit-limit-tokens"], "100000");
    assert!(hs.contains_key("x-ratelimit-remaining-tokens"));
    assert!(!hs.contains_key("anthropic-ratelimit-requests-limit"));
    let r = h
        .post_with(
            "/v1/messages",
            &[("x-api-key", KEY_A), ("anthropic-version", "2023-06-01")],
            &messages_body("p"),
        )
        .await;
    assert_eq!(r.status(), 200);
    let hs = r.headers();
    assert_eq!(hs["anthropic-ratelimit-requests-limit"], "10");
    assert_eq!(hs["anthropic-ratelimit-requests-remaining"], "8");
    let reset = hs["anthropic-ratelimit-tokens-reset"].to_str().unwrap();
    assert!(
        reset.len() == 20 && reset.ends_with('Z') && reset.as_bytes()[10] == b'T',
        "{reset}"
    );
    assert!(!hs.contains_key("x-ratelimit-limit-requests"));
    // A key without limits gets none.
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("authorization", &bearer(KEY_B))],
            &json!({"model": "q", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert!(!r.headers().contains_key("x-ratelimit-limit-requests"));
}

#[tokio::test]
async fn admin_usage_needs_the_admin_key_and_shows_limits_and_budgets() {
    let h = keyed(
        ServerConfig::fast("s"),
        "rpm = 5\ndaily_tokens = 100000\nmonthly_spend_usd = 2.5",
    )
    .await;
    assert_eq!(chat_as(&h, KEY_A, &chat_body("x")).await.status(), 200);
    let get = |key: Option<&'static str>, id: &'static str| {
        let h = &h;
        async move {
            let mut r = keel_sim::http_client().get(h.url(&format!("/keel/keys/{id}/usage")));
            if let Some(k) = key {
                r = r.header("authorization", bearer(k));
            }
            r.send().await.unwrap().status().as_u16()
        }
    };
    assert_eq!(get(None, "a").await, 401);
    assert_eq!(get(Some(KEY_A), "a").await, 403);
    assert_eq!(get(Some(ADMIN), "nobody").await, 404);
    assert_eq!(get(Some(ADMIN), "a").await, 200);
    wait_for!("settled", {
        let u = usage(&h, "a").await;
        u["budgets"][0]["used"].as_f64().unwrap() > 0.0 && u["in_flight"] == 0
    });
    let u = usage(&h, "a").await;
    assert_eq!(u["id"], "a");
    assert_eq!(u["tenant"], "team-a");
    assert_eq!(u["limits"]["requests"]["limit"], 5);
    assert_eq!(u["limits"]["requests"]["remaining"], 4);
    assert!(u["limits"]["requests"]["reset_ms"].as_u64().unwrap() <= 12_000);
    let daily = &u["budgets"][0];
    assert_eq!(daily["unit"], "tokens");
    assert_eq!(daily["limit"], 100000.0);
    let used = daily["used"].as_f64().unwrap();
    assert_eq!(daily["remaining"].as_f64().unwrap(), 100000.0 - used);
    assert!(daily["window_end"]
        .as_str()
        .unwrap()
        .ends_with("T00:00:00Z"));
    assert_eq!(u["budgets"][1]["unit"], "usd");
    assert_eq!(u["budgets"][1]["limit"], 2.5);
}

/// A key at its rpm is refused before keel spends CPU on its prompt: the second request asks
/// for `full` normalization of a JSON example and gets a 429 with no normalization run (no fix
/// counted, no repair work counted).
#[tokio::test]
async fn a_key_at_its_rpm_is_refused_before_costly_normalization() {
    let h = keyed(
        ServerConfig::fast("s"),
        "rpm = 1\nclient_normalize = [\"syntax\", \"full\"]",
    )
    .await;
    let body = chat_body("Reply like {\"ok\": true");
    let auth = bearer(KEY_A);
    let headers = [
        ("authorization", auth.as_str()),
        ("x-keel-normalize", "full"),
    ];
    let full = || h.post_with("/v1/chat/completions", &headers, &body);
    let fixes = || async {
        let text = h.metrics().await;
        (
            parse_metric(
                &text,
                "keel_prompt_fixes_total",
                &[("fix", "schema_brace_recovered")],
            ),
            parse_metric(&text, "keel_prompt_repair_bytes_total", &[("pool", "p")]),
        )
    };
    let r = full().await;
    assert_eq!(r.status(), 200);
    assert!(header(r.headers(), "x-keel-prompt-fix").contains("schema_brace_recovered"));
    let (fixed, work) = fixes().await;
    assert_eq!(fixed, 1.0);
    assert!(work > 0.0);

    let r = full().await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-ratelimit-remaining-requests"], "0");
    assert_eq!(fixes().await, (fixed, work), "normalization did not run");
    assert_eq!(h.server(0).state.stats().requests, 1);
}

/// A `max_tokens` of 2^64 − 1 never wraps to a small reservation: with a tpm or a token budget
/// it can never fit (400 naming the limit), and nothing reaches the upstream. (Spend, with
/// prices, is `limits::tests`'.)
#[tokio::test]
async fn a_huge_max_tokens_never_wraps_past_tpm_or_budgets() {
    for limits in ["tpm = 1000", "daily_tokens = 5000"] {
        let h = keyed(ServerConfig::fast("s"), limits).await;
        let mut body = chat_body("x");
        body["max_tokens"] = json!(u64::MAX);
        let r = chat_as(&h, KEY_A, &body).await;
        assert_eq!(r.status(), 400, "{limits}");
        let b: Value = r.json().await.unwrap();
        let msg = b["error"]["message"].as_str().unwrap();
        assert!(msg.contains("can never fit"), "{limits}: {msg}");
        let limit = limits.split(' ').next().unwrap();
        assert!(msg.contains(limit), "{limits}: {msg}");
        assert_eq!(h.server(0).state.stats().requests, 0);
        // The key's limits are untouched: a normal request still fits.
        body["max_tokens"] = json!(32);
        assert_eq!(chat_as(&h, KEY_A, &body).await.status(), 200);
    }
}

/// `n` answers are reserved `n` times: a tpm that fits one answer refuses `n = 128` with the
/// limit named.
#[tokio::test]
async fn n_answers_reserve_n_times_max_tokens() {
    let h = keyed(ServerConfig::fast("s"), "tpm = 1000").await;
    let mut body = chat_body("x");
    body["max_tokens"] = json!(100);
    body["n"] = json!(1);
    assert_eq!(chat_as(&h, KEY_A, &body).await.status(), 200);
    body["n"] = json!(128);
    let r = chat_as(&h, KEY_A, &body).await;
    assert_eq!(r.status(), 400);
    let b: Value = r.json().await.unwrap();
    let msg = b["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("tpm limit is 1000")
            && msg.contains("128 answers")
            && msg.contains("needs 128"),
        "{msg}"
    );
    assert_eq!(h.server(0).state.stats().requests, 1);
    // Ten answers of 100 and the prompt never fit in 1000 either (keel-sim serves n = 1 only,
    // so the boundary itself is `limits::tests`').
    body["n"] = json!(10);
    assert_eq!(chat_as(&h, KEY_A, &body).await.status(), 400);
}

/// A consensus asks several variants for an answer each: the key reserves every answer.
#[tokio::test]
async fn a_consensus_reserves_an_answer_per_variant() {
    let fleet = Fleet::start_n(3, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "[[keys]]\nid = \"a\"\nhash = \"{}\"\ntpm = 1000\n\n{}",
        hash(KEY_A),
        pool_over(&fleet, "p", "openai", 1, "hedge = \"off\"\n"),
    );
    let h = Harness::start(fleet, &cfg).await;
    let body = json!({"model": "p", "max_tokens": 400, "response_format": {"type": "json_object"},
        "messages": [{"role": "user", "content": "x"}]});
    let auth = bearer(KEY_A);
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("authorization", auth.as_str()), ("x-keel-consensus", "3")],
            &body,
        )
        .await;
    assert_eq!(r.status(), 400);
    let b: Value = r.json().await.unwrap();
    let msg = b["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("tpm limit is 1000") && msg.contains("3 answers"),
        "{msg}"
    );
    let sent: u64 = (0..3).map(|i| h.server(i).state.stats().requests).sum();
    assert_eq!(sent, 0);
    // One answer of 400 fits.
    assert_eq!(chat_as(&h, KEY_A, &body).await.status(), 200);
}
