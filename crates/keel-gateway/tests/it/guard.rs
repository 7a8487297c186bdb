//! The PII and secret guard in the request's path: what reaches the upstream, what the client
//! gets back, what is refused, and what the operator sees (header, metric, access log).

use keel_gateway::Config;
use keel_sim::{Fleet, ServerConfig};
use serde_json::json;

use crate::harness::*;

const EMAIL: &str = "jane.doe@corp.example";
const AWS_KEY: &str = "AKIAIOSFODNN7EXAMPLE";
const GUARD: &str =
    "[pools.guard]\nrequest = { default = \"mask\", secret = \"block\", ip = \"redact\" }\n";

/// One fast server answering `answer`, behind pool `p` of `protocol` with `pool_extra`.
async fn guarded(protocol: &str, answer: Option<&str>, top: &str, pool_extra: &str) -> Harness {
    let cfg = ServerConfig {
        answer: answer.map(str::to_owned),
        ..ServerConfig::fast("s")
    };
    let fleet = Fleet::start_n(1, cfg).await.unwrap();
    let config = format!(
        "{top}\n{}",
        pool_over(
            &fleet,
            "p",
            protocol,
            1,
            &format!("hedge = \"off\"\n{pool_extra}")
        )
    );
    Harness::start(fleet, &config).await
}

#[tokio::test]
async fn masked_values_never_reach_the_upstream_and_come_back_restored() {
    let h = guarded("openai", Some("I wrote to <EMAIL_1> as asked."), "", GUARD).await;
    let prompt = format!("Email {EMAIL} from 10.1.2.3; cc {EMAIL}");
    let r = h.post("/v1/chat/completions", &chat_body(&prompt)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(r.headers(), "x-keel-guard"),
        "masked=email:2;redacted=ip:1"
    );
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        format!("I wrote to {EMAIL} as asked.")
    );
    let sent = h.server(0).state.last_body();
    assert_eq!(
        sent["messages"][0]["content"],
        "Email <EMAIL_1> from [REDACTED_IP]; cc <EMAIL_1>"
    );
    assert_eq!(
        h.metric(
            "keel_guard_findings_total",
            &[
                ("entity", "email"),
                ("action", "mask"),
                ("direction", "request")
            ]
        )
        .await,
        2.0
    );
    let metrics = h.metrics().await;
    assert!(!metrics.contains(EMAIL) && !metrics.contains("10.1.2.3"));
}

#[tokio::test]
async fn a_zero_width_obfuscated_value_is_still_found() {
    let h = guarded("openai", None, "", GUARD).await;
    let r = h
        .post(
            "/v1/chat/completions",
            &chat_body("mail jane.doe\u{200B}@corp.example"),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        h.server(0).state.last_body()["messages"][0]["content"],
        "mail <EMAIL_1>"
    );
}

#[tokio::test]
async fn block_is_a_400_in_the_clients_protocol_naming_types_never_values() {
    for protocol in ["openai", "anthropic"] {
        let h = guarded(protocol, None, "", GUARD).await;
        let before = h.server(0).state.last_body();
        let prompt = format!("my key is {AWS_KEY}, mail {EMAIL}");
        let (path, body) = if protocol == "openai" {
            ("/v1/chat/completions", chat_body(&prompt))
        } else {
            (
                "/v1/messages",
                json!({"model": "p", "max_tokens": 16, "messages": [{"role": "user", "content": prompt}]}),
            )
        };
        let r = h.post(path, &body).await;
        assert_eq!(r.status(), 400, "{protocol}");
        let text = r.text().await.unwrap();
        let err: serde_json::Value = serde_json::from_str(&text).unwrap();
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains("secret: 1"), "{message}");
        assert!(!text.contains(AWS_KEY) && !text.contains(EMAIL), "{text}");
        if protocol == "anthropic" {
            assert_eq!(err["type"], "error");
            assert_eq!(err["error"]["type"], "invalid_request_error");
        } else {
            assert_eq!(err["error"]["type"], "invalid_request_error");
        }
        assert_eq!(
            h.server(0).state.last_body(),
            before,
            "nothing reached the upstream"
        );
    }
}

#[tokio::test]
async fn a_keys_policy_overrides_its_pools_entity_by_entity() {
    let secret = "sk-keel-guard-test-key";
    let top = format!(
        "[[keys]]\nid = \"k\"\nhash = \"{}\"\nguard = {{ request = {{ email = \"detect\" }} }}\n",
        keel_gateway::state::keys::hash_text(&keel_gateway::state::keys::hash_secret(secret))
    );
    let h = guarded("openai", None, &top, GUARD).await;
    let r = keel_sim::http_client()
        .post(h.url("/v1/chat/completions"))
        .bearer_auth(secret)
        .json(&chat_body(&format!("mail {EMAIL} key {AWS_KEY}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "the pool's secret = block still applies");
    let r = keel_sim::http_client()
        .post(h.url("/v1/chat/completions"))
        .bearer_auth(secret)
        .json(&chat_body(&format!("mail {EMAIL}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(r.headers(), "x-keel-guard"), "detected=email:1");
    assert_eq!(
        h.server(0).state.last_body()["messages"][0]["content"],
        format!("mail {EMAIL}")
    );
}

fn config_error(pool_extra: &str) -> String {
    let toml = format!(
        "[[pools]]\nname = \"p\"\n{pool_extra}\n{}",
        variant("a", "http://127.0.0.1:9/v1", "openai", 1)
    );
    match Config::parse(&toml, "test.toml", &Default::default()) {
        Ok(_) => panic!("accepted: {pool_extra}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_guard_config_is_refused_naming_the_key() {
    let e = config_error("[pools.guard]\nrequest = { mail = \"mask\" }\n");
    assert!(
        e.contains("pools[0].guard.request.mail") && e.contains("unknown entity"),
        "{e}"
    );
    let e = config_error("[pools.guard]\nrequest = { email = \"hide\" }\n");
    assert!(
        e.contains("pools[0].guard.request.email") && e.contains("`hide`"),
        "{e}"
    );
    let e = config_error("[pools.guard]\nanswer = { email = \"mask\" }\n");
    assert!(e.contains("pools[0].guard.answer.email"), "{e}");
    let e = config_error(
        "[pools.guard]\n[[pools.guard.patterns]]\nname = \"ticket\"\nregex = \"(TCK\"\n",
    );
    assert!(
        e.contains("\"ticket\"") && e.contains("does not compile"),
        "{e}"
    );
    let e = config_error("[pools.guard]\n[[pools.guard.patterns]]\nname = \"t\"\nregex = \"x*\"\n");
    assert!(e.contains("empty string"), "{e}");
}

#[tokio::test]
async fn operator_patterns_join_the_policy() {
    let extra = "[pools.guard]\nrequest = { ticket = \"redact\", codename = \"mask\" }\n[[pools.guard.patterns]]\nname = \"ticket\"\nregex = \"TCK-[0-9]{6}\"\n[[pools.guard.patterns]]\nname = \"codename\"\nwords = [\"bluebird\"]\n";
    let h = guarded("openai", None, "", extra).await;
    let r = h
        .post(
            "/v1/chat/completions",
            &chat_body("TCK-123456 is about Bluebird"),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(r.headers(), "x-keel-guard"),
        "masked=codename:1;redacted=ticket:1"
    );
    assert_eq!(
        h.server(0).state.last_body()["messages"][0]["content"],
        "[REDACTED_TICKET] is about <CODENAME_1>"
    );
}

#[tokio::test]
async fn streamed_answers_are_restored_in_both_protocols() {
    for protocol in ["openai", "anthropic"] {
        let h = guarded(protocol, Some("Done: <EMAIL_1> is on file."), "", GUARD).await;
        let prompt = format!("remember {EMAIL}");
        let (path, body) = if protocol == "openai" {
            ("/v1/chat/completions", stream_body(&prompt))
        } else {
            (
                "/v1/messages",
                json!({"model": "p", "max_tokens": 64, "stream": true, "messages": [{"role": "user", "content": prompt}]}),
            )
        };
        let r = h.post(path, &body).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(r.headers(), "x-keel-guard"), "masked=email:1");
        let events = read_stream(r).await;
        let mut text = String::new();
        for ev in &events {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&ev.data) else {
                continue;
            };
            let piece = v["choices"][0]["delta"]["content"]
                .as_str()
                .or(v["delta"]["text"].as_str())
                .unwrap_or("");
            assert!(!piece.contains("<EMAIL"), "{protocol}: {piece:?}");
            text.push_str(piece);
        }
        assert_eq!(text, format!("Done: {EMAIL} is on file."), "{protocol}");
    }
}

#[tokio::test]
async fn secrets_a_model_emits_are_redacted_in_whole_and_streamed_answers() {
    let leak = format!("Sure, the key is {AWS_KEY}; write to {EMAIL}.");
    let extra = "[pools.guard]\nanswer = { secret = \"redact\", email = \"detect\" }\n";
    let h = guarded("openai", Some(&leak), "", extra).await;
    let want = leak.replace(AWS_KEY, "[REDACTED_SECRET]");
    let (status, _, body) = h.chat(&chat_body("what is the key?")).await;
    assert_eq!(status, 200);
    assert_eq!(body["choices"][0]["message"]["content"], want);
    let r = h.post("/v1/chat/completions", &stream_body("again?")).await;
    let text = openai_stream_text(&read_stream(r).await);
    assert_eq!(text, want);
    assert_eq!(
        h.metric(
            "keel_guard_findings_total",
            &[
                ("entity", "secret"),
                ("action", "redact"),
                ("direction", "answer")
            ]
        )
        .await,
        2.0
    );
}

#[tokio::test]
async fn a_migrated_stream_continues_from_the_masked_text_and_the_client_sees_its_own() {
    let answer = "Done: <EMAIL_1> is on file, and a copy went to <EMAIL_1> as well.";
    let mut prefills_with_placeholder = 0;
    for after in [2, 4, 7, 12] {
        let cfg = ServerConfig {
            answer: Some(answer.to_owned()),
            ..ServerConfig::fast("s")
        };
        let fleet = Fleet::start_n(2, cfg).await.unwrap();
        let config = format!(
            "allow_force_variant = true\n{}",
            pool_over(
                &fleet,
                "p",
                "openai",
                1,
                &format!("hedge = \"off\"\n{GUARD}")
            )
        );
        let h = Harness::start(fleet, &config).await;
        add_fault(h.server(0), json!({"kind": "close", "after_tokens": after})).await;
        let first = h.server(0).name.clone();
        let r = h
            .post_with(
                "/v1/chat/completions",
                &[("x-keel-force-variant", first.as_str())],
                &stream_body(&format!("file {EMAIL}")),
            )
            .await;
        assert_eq!(r.status(), 200);
        let text = openai_stream_text(&read_stream(r).await);
        assert_eq!(
            text,
            answer.replace("<EMAIL_1>", EMAIL),
            "cut after {after} tokens"
        );
        let continuation = h.server(1).state.last_body();
        assert!(!continuation.to_string().contains(EMAIL), "{continuation}");
        let last = &continuation["messages"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone();
        assert_eq!(
            last["role"], "assistant",
            "continued by prefill: {continuation}"
        );
        if last["content"].as_str().unwrap().contains("<EMAIL_1>") {
            prefills_with_placeholder += 1;
        }
    }
    assert!(
        prefills_with_placeholder >= 1,
        "some cut fell after the placeholder"
    );
}

/// Requests the simulated fleet received.
fn upstream(h: &Harness) -> u64 {
    h.fleet
        .servers
        .iter()
        .map(|s| s.state.stats().requests)
        .sum()
}

#[tokio::test]
async fn the_cache_keys_on_the_masked_form_and_each_client_sees_its_own_values() {
    let h = guarded(
        "openai",
        Some("Noted: <EMAIL_1>."),
        "",
        &format!("{GUARD}[pools.cache]\n"),
    )
    .await;
    let ask = |email: &str, stream: bool| {
        json!({"model": "p", "temperature": 0, "max_tokens": 24, "stream": stream,
            "messages": [{"role": "user", "content": format!("note {email}")}]})
    };
    let r = h.post("/v1/chat/completions", &ask(EMAIL, false)).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "stored");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        format!("Noted: {EMAIL}.")
    );
    let other = "max.mustermann@firma.example";
    let r = h.post("/v1/chat/completions", &ask(other, false)).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        format!("Noted: {other}.")
    );
    let r = h.post("/v1/chat/completions", &ask(other, true)).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    assert_eq!(
        openai_stream_text(&read_stream(r).await),
        format!("Noted: {other}.")
    );
    assert_eq!(upstream(&h), 1);
}

#[tokio::test]
async fn no_value_reaches_the_access_log_decision_records_or_metrics() {
    let path = std::env::temp_dir().join(format!("keel-guard-access-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let top = format!(
        "[log]\nformat = \"json\"\naccess = {:?}\n",
        path.display().to_string()
    );
    let extra = format!("normalize = \"syntax\"\n{GUARD}");
    let h = guarded("openai", Some("Mailed <EMAIL_1>."), &top, &extra).await;
    let obfuscated = "jane.doe\u{200B}@corp.example";
    let r = h
        .post(
            "/v1/chat/completions",
            &chat_body(&format!("mail {obfuscated} from 10.9.8.7")),
        )
        .await;
    assert_eq!(r.status(), 200);
    let id = header(r.headers(), "x-keel-request-id").to_owned();
    let blocked = h
        .post(
            "/v1/chat/completions",
            &chat_body(&format!("key {AWS_KEY}")),
        )
        .await;
    assert_eq!(blocked.status(), 400);
    wait_for!(
        "two access lines",
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .count()
            == 2
    );
    let log = std::fs::read_to_string(&path).unwrap();
    let record = h
        .get_json(&format!("/keel/decisions/{id}"))
        .await
        .to_string();
    let metrics = h.metrics().await;
    for (what, text) in [
        ("access log", &log),
        ("decision record", &record),
        ("metrics", &metrics),
    ] {
        for value in [EMAIL, obfuscated, "10.9.8.7", AWS_KEY, "jane.doe"] {
            assert!(!text.contains(value), "`{value}` in the {what}: {text}");
        }
    }
    let line: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    assert_eq!(line["guard"], "masked=email:1;redacted=ip:1");
    assert!(record.contains("masked=email:1;redacted=ip:1"), "{record}");
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn an_upstream_refusal_passes_through_the_guard_unchanged() {
    let h = guarded(
        "openai",
        Some("I cannot help with <EMAIL_1> at all, sorry."),
        "",
        GUARD,
    )
    .await;
    add_fault(h.server(0), json!({"kind": "refusal", "after_tokens": 3})).await;
    let r = h
        .post(
            "/v1/chat/completions",
            &stream_body(&format!("write to {EMAIL}")),
        )
        .await;
    assert_eq!(r.status(), 200);
    let events = read_stream(r).await;
    let finish: Vec<String> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(&e.data).ok())
        .filter_map(|v| v["choices"][0]["finish_reason"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        finish,
        ["content_filter"],
        "the refusal reaches the client as it was given"
    );
    assert_eq!(upstream(&h), 1, "the guard does not route around it");
}

/// Shadow copies are of the request as the upstream saw it: masked, never the client's values.
#[tokio::test]
async fn shadow_copies_carry_the_masked_form() {
    let cfg = ServerConfig {
        answer: Some("Sent to <EMAIL_1>.".to_owned()),
        ..ServerConfig::fast("s")
    };
    let fleet = Fleet::start_n(2, cfg).await.unwrap();
    let config = format!(
        "[[pools]]\nname = \"p\"\nhedge = \"off\"\n{GUARD}[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}\
         [pools.shadow]\nsample = 1.0\nmax_in_flight = 8\nmax_per_minute = 1000\n\
         [[pools.shadow.variants]]\nname = \"shadow\"\nurl = \"{}\"\nprotocol = \"openai\"\nupstream_model = \"sim\"\n",
        variant("s-0", &fleet.get(0).openai_base(), "openai", 1),
        fleet.get(1).openai_base(),
    );
    let h = Harness::start(fleet, &config).await;
    let r = h
        .post("/v1/chat/completions", &chat_body(&format!("mail {EMAIL}")))
        .await;
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        format!("Sent to {EMAIL}.")
    );
    wait_for!("the shadow copy", h.server(1).state.stats().requests >= 1);
    let copy = h.server(1).state.last_body().to_string();
    assert!(copy.contains("<EMAIL_1>"), "{copy}");
    assert!(!copy.contains(EMAIL), "{copy}");
}

/// The semantic cache embeds the masked prompt (the embeddings pool's upstream never sees a
/// value) and a near prompt with another person's value is answered from the masked entry,
/// restored with that request's own value.
#[tokio::test]
async fn the_semantic_cache_embeds_and_keys_the_masked_form() {
    let cfg = ServerConfig {
        answer: Some("Noted: <EMAIL_1>.".to_owned()),
        ..ServerConfig::fast("s")
    };
    let fleet = Fleet::start_n(2, cfg).await.unwrap();
    let config = format!(
        "[[pools]]\nname = \"p\"\nhedge = \"off\"\n{GUARD}[pools.cache]\nsemantic = {{ embeddings_pool = \"e\", max_distance = 0.15 }}\n\
         [pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}\
         [[pools]]\nname = \"e\"\nhedge = \"off\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}",
        variant("s-0", &fleet.get(0).openai_base(), "openai", 1),
        variant("e-0", &fleet.get(1).openai_base(), "openai", 1),
    );
    let h = Harness::start(fleet, &config).await;
    let ask = |text: &str| {
        json!({"model": "p", "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": text}]})
    };
    let other = "max.mustermann@firma.example";
    let r = h
        .post(
            "/v1/chat/completions",
            &ask(&format!(
                "Please email the quarterly report to {EMAIL} today."
            )),
        )
        .await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "stored");
    let embedded = h.server(1).state.last_body().to_string();
    assert!(embedded.contains("<EMAIL_1>"), "{embedded}");
    assert!(!embedded.contains(EMAIL), "{embedded}");
    let r = h
        .post(
            "/v1/chat/completions",
            &ask(&format!(
                "please email the quarterly report to {other} today"
            )),
        )
        .await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        format!("Noted: {other}.")
    );
    let embedded = h.server(1).state.last_body().to_string();
    assert!(!embedded.contains(other), "{embedded}");
    assert_eq!(h.server(0).state.stats().requests, 1);
}
