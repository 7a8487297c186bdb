//! The access log: one line per request, written where `[log] access` says, with what keel
//! decided and measured, and never a secret.

use keel_gateway::state::keys::{hash_secret, hash_text};
use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};

use crate::harness::*;

const KEY: &str = "sk-keel-access-log-key";
const PROMPT: &str = "a prompt that must never reach the log";

/// A fresh path under the system temp dir for one test's log.
fn log_path(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("keel-{name}-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

fn lines(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Two sims, the first failing every request with a 503 and weighted to be tried first.
async fn failing_first(top: &str) -> Harness {
    let fleet = Fleet::start_n(2, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!("{top}\n{}", pool_over(&fleet, "p", "openai", 1000, ""));
    let h = Harness::start(fleet, &cfg).await;
    add_fault(h.server(0), json!({"kind": "error", "status": 503})).await;
    h
}

#[tokio::test]
async fn one_json_line_per_request_with_decisions_and_no_secrets() {
    let path = log_path("access-json");
    let top = format!(
        "[log]\nformat = \"json\"\naccess = {:?}\n\n[[keys]]\nid = \"app\"\nhash = \"{}\"\ntenant = \"team-a\"\n",
        path.display().to_string(),
        hash_text(&hash_secret(KEY))
    );
    let h = failing_first(&top).await;
    let auth = format!("Bearer {KEY}");
    let body = json!({"model": "p", "messages": [{"role": "user", "content": PROMPT}]});
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("authorization", &auth), ("x-api-key", KEY)],
            &body,
        )
        .await;
    assert_eq!(r.status(), 200);
    let id = header(r.headers(), "x-keel-request-id").to_owned();
    let answer: Value = r.json().await.unwrap();
    // A refused request (no key) is logged too, as the client's error.
    let refused = h.post("/v1/chat/completions", &body).await;
    assert_eq!(refused.status(), 401);

    wait_for!("two access lines", lines(&path).len() == 2);
    let text = std::fs::read_to_string(&path).unwrap();
    for secret in [KEY, auth.as_str(), PROMPT, "sk-upstream-secret"] {
        assert!(!text.contains(secret), "`{secret}` in the log: {text}");
    }
    assert!(!text.contains('\u{1b}'), "colour codes in a file: {text}");

    let served: Value = serde_json::from_str(&lines(&path)[0]).unwrap();
    let keys: Vec<&str> = served
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "ts",
            "request_id",
            "tenant",
            "key_id",
            "api",
            "pool",
            "variant",
            "variants_tried",
            "route",
            "attempts",
            "hedges",
            "migrations",
            "prompt_fixes",
            "guard",
            "status",
            "outcome",
            "detail",
            "ttft_ms",
            "total_ms",
            "tokens_in",
            "tokens_out",
            "overhead_us",
            "cache",
            "cached_from",
            "trace_id",
        ],
        "the documented fields, in their order"
    );
    let ts = served["ts"].as_str().unwrap();
    assert!(
        ts.len() == 24 && ts.ends_with('Z') && ts.as_bytes()[10] == b'T',
        "{ts}"
    );
    assert_eq!(served["request_id"], id.as_str());
    assert_eq!(served["tenant"], "team-a");
    assert_eq!(served["key_id"], "app");
    assert_eq!(served["api"], "chat_completions");
    assert_eq!(served["pool"], "p");
    assert_eq!(served["variant"], "sim-1");
    assert_eq!(served["variants_tried"], json!(["sim-0", "sim-1"]));
    assert_eq!(served["route"], "fallback");
    assert_eq!(served["attempts"], 2);
    assert_eq!(served["hedges"], 0);
    assert_eq!(served["migrations"], 0);
    assert_eq!(served["prompt_fixes"], json!([]));
    assert_eq!(served["status"], 200);
    assert_eq!(served["outcome"], "ok");
    assert_eq!(served["detail"], Value::Null);
    let (ttft, total) = (
        served["ttft_ms"].as_f64().unwrap(),
        served["total_ms"].as_f64().unwrap(),
    );
    assert!(ttft > 0.0 && ttft <= total, "ttft {ttft} total {total}");
    // The upstream's own usage, as the client saw it.
    assert_eq!(served["tokens_in"], answer["usage"]["prompt_tokens"]);
    assert_eq!(served["tokens_out"], answer["usage"]["completion_tokens"]);
    assert!(answer["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    assert!(served.as_object().unwrap().contains_key("overhead_us"));
    assert_eq!(served["trace_id"], Value::Null, "no tracing configured");

    let refused: Value = serde_json::from_str(&lines(&path)[1]).unwrap();
    assert_eq!(refused["status"], 401);
    assert_eq!(refused["outcome"], "client_error");
    assert_eq!(refused["key_id"], Value::Null);
    assert_eq!(refused["attempts"], 0);
    assert_eq!(refused["variants_tried"], json!([]));
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn text_format_and_streams() {
    let path = log_path("access-text");
    let top = format!(
        "[log]\nformat = \"text\"\naccess = {:?}\n",
        path.display().to_string()
    );
    let h = failing_first(&top).await;
    let r = h.post("/v1/chat/completions", &stream_body("hi")).await;
    assert_eq!(r.status(), 200);
    let id = header(r.headers(), "x-keel-request-id").to_owned();
    read_stream(r).await;
    // A stream is logged when it ends, from the relay.
    wait_for!("one access line", lines(&path).len() == 1);
    let line = &lines(&path)[0];
    assert!(line.starts_with("request ts="), "{line}");
    for field in [
        format!("request_id={id}"),
        "api=chat_completions".into(),
        "variants_tried=sim-0,sim-1".into(),
        "route=fallback".into(),
        "attempts=2".into(),
        "status=200".into(),
        "outcome=ok".into(),
    ] {
        assert!(
            line.contains(&format!(" {field} ")),
            "{field} missing: {line}"
        );
    }
    assert!(!line.contains('\u{1b}'), "{line}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn log_config_is_validated() {
    let pool = "[[pools]]\nname = \"p\"\n[[pools.variants]]\nname = \"a\"\nurl = \"http://127.0.0.1:9/v1\"\nprotocol = \"openai\"\nupstream_model = \"m\"\n";
    let parse = |top: &str| {
        keel_gateway::Config::parse(&format!("{top}\n{pool}"), "t.toml", &Default::default())
    };
    let e = parse("[log]\nformat = \"jsn\"").unwrap_err().to_string();
    assert!(
        e.contains("log.format") && e.contains("did you mean `json`"),
        "{e}"
    );
    let e = parse("[log]\naccess = \"\"").unwrap_err().to_string();
    assert!(e.contains("log.access"), "{e}");
    let e = parse("[telemetry]\notlp_endpoint = \"127.0.0.1:4318\"")
        .unwrap_err()
        .to_string();
    assert!(e.contains("telemetry.otlp_endpoint"), "{e}");
    let c =
        parse("[log]\naccess = \"off\"\n[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318/\"")
            .unwrap();
    assert_eq!(c.log.access, keel_gateway::config::AccessLogTarget::Off);
    assert_eq!(
        c.telemetry.otlp_endpoint.as_deref(),
        Some("http://127.0.0.1:4318")
    );
}

#[tokio::test]
async fn a_migrated_stream_logs_its_move_and_the_usage_of_both_segments() {
    let path = log_path("access-migrated");
    let top = format!(
        "allow_force_variant = true\n[log]\naccess = {:?}\n",
        path.display().to_string()
    );
    let fleet = Fleet::start_n(2, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!("{top}\n{}", pool_over(&fleet, "p", "openai", 1, ""));
    let h = Harness::start(fleet, &cfg).await;
    // sim-0 serves the first tokens, then its connection dies: the stream moves to sim-1.
    add_fault(h.server(0), json!({"kind": "close", "after_tokens": 4})).await;
    let body = json!({"model": "p", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "move me"}]});
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-force-variant", "sim-0")],
            &body,
        )
        .await;
    assert_eq!(r.status(), 200);
    read_stream(r).await;
    wait_for!("one access line", lines(&path).len() == 1);
    let l: Value = serde_json::from_str(&lines(&path)[0]).unwrap();
    assert_eq!(l["route"], "migrated", "{l}");
    assert_eq!(l["migrations"], 1, "{l}");
    assert_eq!(l["variants_tried"], json!(["sim-0", "sim-1"]), "{l}");
    assert_eq!(l["variant"], "sim-1", "{l}");
    assert_eq!(l["outcome"], "ok", "{l}");
    // Four tokens relayed from sim-0 (no usage: it died) plus sim-1's reported output.
    assert!(l["tokens_out"].as_u64().unwrap() > 4, "{l}");
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn fingerprinted_pools_log_keys_and_templates_never_text() {
    let path = log_path("access-fingerprint");
    let top = format!("[log]\naccess = {:?}\n", path.display().to_string());
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "{top}\n{}\n{}",
        pool_over(&fleet, "p", "openai", 1, "fingerprint = true"),
        pool_over(&fleet, "q", "openai", 1, "")
    );
    let h = Harness::start(fleet, &cfg).await;
    let ask = |model: &str, text: &str, extra: Value| {
        let mut b = json!({"model": model, "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": text}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let bodies = [
        ask(
            "p",
            "Summarize order 12 for Alice, secret-word-zq",
            json!({}),
        ),
        // The same but for a doubled space: raw keys differ, `syntax` merges them.
        ask(
            "p",
            "Summarize  order 12 for Alice, secret-word-zq",
            json!({}),
        ),
        ask(
            "p",
            "Summarize order 99 for Bob, secret-word-zq",
            json!({"temperature": 0.7}),
        ),
        ask(
            "q",
            "Summarize order 12 for Alice, secret-word-zq",
            json!({}),
        ),
    ];
    for (i, b) in bodies.iter().enumerate() {
        assert_eq!(h.post("/v1/chat/completions", b).await.status(), 200);
        wait_for!("the access line", lines(&path).len() == i + 1);
    }
    let text = std::fs::read_to_string(&path).unwrap();
    for word in ["secret-word-zq", "Summarize", "Alice"] {
        assert!(!text.contains(word), "`{word}` in the log: {text}");
    }
    let l: Vec<Value> = lines(&path)
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let key = |i: usize, f: &str| l[i][f].as_str().unwrap_or("").to_owned();
    assert_eq!(key(0, "cache_key").len(), 64, "{}", l[0]);
    // No normalization on the pool: its cache uses the raw key.
    assert_eq!(key(0, "cache_key"), key(0, "cache_key_raw"));
    assert_ne!(key(0, "cache_key_raw"), key(1, "cache_key_raw"));
    assert_eq!(key(0, "cache_key_syntax"), key(1, "cache_key_syntax"));
    assert_eq!(key(0, "template"), key(1, "template"));
    assert_eq!(key(0, "template").len(), 16);
    assert_eq!(l[0]["deterministic"], true);
    assert_eq!(l[2]["deterministic"], false);
    assert_eq!(l[2]["temperature"], 0.7);
    assert_eq!(l[0]["tools"], false);
    assert!(l[0]["spend_usd"].is_number(), "{}", l[0]);
    // A pool that does not fingerprint logs none of it.
    assert_eq!(l[3]["pool"], "q");
    for f in [
        "cache_key",
        "cache_key_raw",
        "template",
        "deterministic",
        "spend_usd",
    ] {
        assert!(l[3].get(f).is_none(), "{f} in {}", l[3]);
    }
    for (pool, n) in [("p", 3.0), ("q", 0.0)] {
        let counted = h
            .metric("keel_fingerprinted_requests_total", &[("pool", pool)])
            .await;
        assert_eq!(counted, n, "{pool}");
    }
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn the_live_analysis_answers_only_the_operations_plane() {
    const ADMIN: &str = "sk-keel-analyze-admin-0123456789";
    const TEAM_A: &str = "sk-keel-analyze-team-a-012345678";
    const TEAM_B: &str = "sk-keel-analyze-team-b-012345678";
    let h_ = |k: &str| hash_text(&hash_secret(k));
    let top = format!(
        "[log]\naccess = \"off\"\n[admin]\nkey_hash = \"{}\"\n[[keys]]\nid = \"a\"\nhash = \"{}\"\ntenant = \"team-a\"\n[[keys]]\nid = \"b\"\nhash = \"{}\"\ntenant = \"team-b\"\n",
        h_(ADMIN),
        h_(TEAM_A),
        h_(TEAM_B)
    );
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "{top}\n{}",
        pool_over(&fleet, "p", "openai", 1, "fingerprint = true")
    );
    let h = Harness::start(fleet, &cfg).await;
    let body = |text: &str| {
        json!({"model": "p", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": text}]})
    };
    // Team a asks one question three times and another once; team b asks the first once (its
    // own namespace: not a repeat of team a's).
    for (key, text) in [
        (TEAM_A, "Summarize order 1"),
        (TEAM_A, "Summarize order 1"),
        (TEAM_A, "Summarize order 1"),
        (TEAM_A, "Summarize order 2"),
        (TEAM_B, "Summarize order 1"),
    ] {
        let auth = format!("Bearer {key}");
        let r = h
            .post_with(
                "/v1/chat/completions",
                &[("authorization", &auth)],
                &body(text),
            )
            .await;
        assert_eq!(r.status(), 200);
    }
    let get = |key: Option<&'static str>| {
        let mut req = keel_sim::http_client().get(h.url("/keel/analyze"));
        if let Some(k) = key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        req.send()
    };
    assert_eq!(get(None).await.unwrap().status(), 401);
    assert_eq!(get(Some(TEAM_A)).await.unwrap().status(), 403);
    let r = get(Some(ADMIN)).await.unwrap();
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.unwrap();
    assert_eq!(doc["window"]["fingerprinting_pools"], json!(["p"]), "{doc}");
    let p = &doc["report"]["pools"][0];
    assert_eq!(p["pool"], "p", "{doc}");
    assert_eq!(p["requests"], 5, "{doc}");
    assert_eq!(p["repeats_raw"], 2, "{doc}");
    // Two of the five would have been answered from a cache.
    assert_eq!(p["simulated"]["hits"], 2, "{doc}");
    assert!(doc.to_string().find("Summarize").is_none(), "{doc}");
}
