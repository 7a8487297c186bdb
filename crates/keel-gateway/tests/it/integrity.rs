//! Output integrity and consensus on the simulator: a truncated answer is continued into the
//! uninterrupted reference text byte for byte (whole and streamed, both protocols); invalid
//! JSON is retried once and then flagged; a consensus returns the majority of each field; the
//! consensus refusals are 400s in the client's protocol.

use serde_json::{json, Value};

use keel_sim::{FleetConfig, GenerationConfig, ServerConfig};

use crate::harness::*;

/// Migration off (`max_migrations = 0`): every continuation seen is integrity's own, even when
/// a loaded machine makes a stream look quiet (which would race a migration).
const INTEGRITY: &str =
    "max_migrations = 0\n[pools.integrity]\nauto_continue = true\njson_retry = true";

/// Two servers of one family; sim-0 (forced first) cuts its next answer after `after` tokens.
async fn truncating(protocol: &str, integrity: &str, after: u64) -> Harness {
    let fleet = keel_sim::Fleet::start_n(2, ServerConfig::fast("s"))
        .await
        .unwrap();
    add_fault(
        fleet.get(0),
        json!({"kind": "truncate", "after_tokens": after, "count": 1}),
    )
    .await;
    let cfg = format!(
        "allow_force_variant = true\n{}",
        pool_over(&fleet, "p", protocol, 1, integrity)
    );
    Harness::start(fleet, &cfg).await
}

async fn forced(h: &Harness, path: &str, body: &Value) -> reqwest::Response {
    h.post_with(path, &[("x-keel-force-variant", "sim-0")], body)
        .await
}

fn comments(events: &[keel_core::sse::SseEvent]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.comment_only)
        .map(|e| String::from_utf8_lossy(&e.raw).trim().to_owned())
        .collect()
}

async fn decision(h: &Harness, id: &str) -> Value {
    h.get_json(&format!("/keel/decisions/{id}")).await
}

#[tokio::test]
async fn a_truncated_whole_answer_is_continued_into_the_reference_text() {
    let h = truncating("openai", INTEGRITY, 5).await;
    let body = json!({"model": "p", "max_tokens": 400, "messages": [{"role": "user", "content": "a whole answer, cut"}]});
    let want = reference(&h, 1, "/v1/chat/completions", &body).await;
    let resp = forced(&h, "/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(resp.headers(), "x-keel-route"), "continued");
    assert_eq!(header(resp.headers(), "x-keel-integrity"), "");
    let id = header(resp.headers(), "x-keel-request-id").to_owned();
    let got: Value = resp.json().await.unwrap();
    assert_eq!(
        got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"],
        "byte for byte the uninterrupted answer"
    );
    assert_eq!(
        got["choices"][0]["finish_reason"],
        want["choices"][0]["finish_reason"]
    );
    assert_eq!(
        got["usage"]["completion_tokens"],
        want["usage"]["completion_tokens"]
    );
    assert_eq!(
        h.metric(
            "keel_integrity_total",
            &[("issue", "truncated"), ("action", "continued")]
        )
        .await,
        1.0
    );
    let d = decision(&h, &id).await;
    assert_eq!(d["route"], "continued");
    assert_eq!(d["integrity"], json!(["truncated:continued"]));
    assert_eq!(d["migrations"][0]["reason"], "truncated");
}

#[tokio::test]
async fn a_truncated_stream_is_continued_seamlessly() {
    let h = truncating("openai", INTEGRITY, 4).await;
    let body = json!({"model": "p", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "a streamed answer, cut"}]});
    let want = reference(&h, 1, "/v1/chat/completions", &body).await;
    let resp = forced(&h, "/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let id = header(resp.headers(), "x-keel-request-id").to_owned();
    let events = read_stream(resp).await;
    assert_eq!(
        openai_stream_text(&events),
        want["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let data: Vec<_> = events.iter().filter(|e| !e.comment_only).collect();
    assert_eq!(data.iter().filter(|e| e.data == "[DONE]").count(), 1);
    let finishes: Vec<Value> = data
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter_map(|c| c["choices"].get(0).map(|c| c["finish_reason"].clone()))
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(
        finishes,
        vec![json!("stop")],
        "the cut's `length` never reaches the client"
    );
    let notes = comments(&events);
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0]
            .starts_with(": keel continued from=sim-0 to=sim-0 reason=truncated after_tokens=4"),
        "{notes:?}"
    );
    wait_for!(
        "the decision record",
        decision(&h, &id).await["route"] == "continued"
    );
}

#[tokio::test]
async fn an_anthropic_answer_is_continued_in_one_text_block() {
    let h = truncating("anthropic", INTEGRITY, 6).await;
    let body = json!({"model": "p", "max_tokens": 300, "messages": [{"role": "user", "content": "an anthropic answer, cut"}]});
    let want = reference(&h, 1, "/v1/messages", &body).await;
    let resp = forced(&h, "/v1/messages", &body).await;
    assert_eq!(resp.status(), 200);
    let id = header(resp.headers(), "x-keel-request-id").to_owned();
    let route = header(resp.headers(), "x-keel-route").to_owned();
    assert_eq!(route, "continued", "{}", decision(&h, &id).await);
    let got: Value = resp.json().await.unwrap();
    assert_eq!(
        got["content"], want["content"],
        "one text block, the reference text"
    );
    assert_eq!(got["stop_reason"], want["stop_reason"]);
    assert_eq!(
        got["usage"]["output_tokens"],
        want["usage"]["output_tokens"]
    );
}

#[tokio::test]
async fn answers_that_used_the_clients_limit_or_repairs_off_are_left_unchanged() {
    // The client's own limit reached: a `length` stop that is no truncation.
    let h = truncating("openai", INTEGRITY, 1000).await;
    let body = json!({"model": "p", "max_tokens": 6, "messages": [{"role": "user", "content": "short on purpose"}]});
    let want = reference(&h, 1, "/v1/chat/completions", &body).await;
    let resp = forced(&h, "/v1/chat/completions", &body).await;
    assert_eq!(header(resp.headers(), "x-keel-route"), "direct");
    assert_eq!(header(resp.headers(), "x-keel-integrity"), "");
    let got: Value = resp.json().await.unwrap();
    assert_eq!(got["choices"][0]["finish_reason"], "length");
    assert_eq!(
        got["choices"][0]["message"]["content"],
        want["choices"][0]["message"]["content"]
    );

    // Repairs off: flagged, unchanged.
    let h = truncating(
        "openai",
        "max_migrations = 0\n[pools.integrity]\nauto_continue = false",
        5,
    )
    .await;
    let body = json!({"model": "p", "messages": [{"role": "user", "content": "cut and kept"}]});
    let want = reference(&h, 1, "/v1/chat/completions", &body).await;
    let resp = forced(&h, "/v1/chat/completions", &body).await;
    assert_eq!(header(resp.headers(), "x-keel-route"), "direct");
    assert_eq!(header(resp.headers(), "x-keel-integrity"), "truncated");
    let got: Value = resp.json().await.unwrap();
    assert_eq!(got["choices"][0]["finish_reason"], "length");
    let text = got["choices"][0]["message"]["content"].as_str().unwrap();
    let full = want["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        full.starts_with(text) && text.len() < full.len(),
        "{text:?} / {full:?}"
    );

    // A stream is flagged by a comment before its end.
    let body = json!({"model": "p", "stream": true, "messages": [{"role": "user", "content": "cut stream"}]});
    add_fault(
        h.server(0),
        json!({"kind": "truncate", "after_tokens": 3, "count": 1}),
    )
    .await;
    let events = read_stream(forced(&h, "/v1/chat/completions", &body).await).await;
    assert_eq!(
        comments(&events),
        vec![": keel integrity=truncated".to_owned()]
    );
}

fn json_body(prompt: &str) -> Value {
    json!({"model": "p", "response_format": {"type": "json_object"},
        "messages": [{"role": "user", "content": prompt}]})
}

#[tokio::test]
async fn invalid_json_is_retried_once_then_flagged() {
    let h = Harness::openai(1, 1, "", INTEGRITY).await;
    // Once: the retry's answer is served.
    add_fault(h.server(0), json!({"kind": "invalid_json", "count": 1})).await;
    let (status, headers, got) = h.chat(&json_body("a json answer")).await;
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "x-keel-integrity"), "");
    assert_eq!(header(&headers, "x-keel-attempts"), "2");
    let text = got["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(text).unwrap().is_object(),
        "{text}"
    );
    let d = decision(&h, header(&headers, "x-keel-request-id")).await;
    assert_eq!(d["integrity"], json!(["invalid_json:retried"]));

    // Always: retried once, then the answer is returned unchanged and flagged.
    add_fault(h.server(0), json!({"kind": "invalid_json"})).await;
    let (status, headers, got) = h.chat(&json_body("another json answer")).await;
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "x-keel-integrity"), "invalid_json");
    assert_eq!(
        header(&headers, "x-keel-attempts"),
        "2",
        "one retry, no more"
    );
    let text = got["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(serde_json::from_str::<Value>(text).is_err(), "{text}");
    assert_eq!(
        h.metric(
            "keel_integrity_total",
            &[("issue", "invalid_json"), ("action", "flagged")]
        )
        .await,
        1.0
    );
    // A valid answer is never touched.
    h.server(0).state.clear_faults();
    let (_, headers, _) = h.chat(&json_body("a fine json answer")).await;
    assert_eq!(header(&headers, "x-keel-attempts"), "1");
    assert_eq!(header(&headers, "x-keel-integrity"), "");
}

/// Three servers that each give a fixed JSON answer.
async fn voters(answers: [Value; 3]) -> Harness {
    let servers = answers
        .iter()
        .enumerate()
        .map(|(i, a)| ServerConfig {
            answer: Some(a.to_string()),
            ..ServerConfig::fast(&format!("sim-{i}"))
        })
        .collect();
    let fleet = keel_sim::Fleet::start(&FleetConfig {
        generation: GenerationConfig::default(),
        servers,
    })
    .await
    .unwrap();
    let cfg = pool_over(&fleet, "p", "openai", 1, "hedge_budget = 1.0");
    Harness::start(fleet, &cfg).await
}

#[tokio::test]
async fn consensus_returns_the_majority_of_each_field() {
    let h = voters([
        json!({"name": "Ada", "age": 36, "ok": true, "address": {"city": "London", "zip": "N1"}}),
        json!({"name": "Ada", "age": 37, "ok": true, "address": {"city": "Paris", "zip": "N1"}}),
        json!({"name": "Bob", "age": 37, "ok": true, "address": {"city": "London", "zip": "N1"}}),
    ])
    .await;
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-consensus", "3")],
            &json_body("vote"),
        )
        .await;
    assert_eq!(r.status(), 200);
    let headers = r.headers().clone();
    assert_eq!(header(&headers, "x-keel-route"), "consensus");
    assert_eq!(header(&headers, "x-keel-consensus-answers"), "3/3");
    assert_eq!(header(&headers, "x-keel-consensus-fields"), "2/5");
    assert_eq!(header(&headers, "x-keel-consensus-agreement"), "0.40");
    assert_eq!(header(&headers, "x-keel-attempts"), "3");
    let got: Value = r.json().await.unwrap();
    let merged: Value =
        serde_json::from_str(got["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert_eq!(
        merged,
        json!({"name": "Ada", "age": 37, "ok": true, "address": {"city": "London", "zip": "N1"}})
    );
    let d = decision(&h, header(&headers, "x-keel-request-id")).await;
    let c = &d["consensus"];
    assert_eq!(c["asked"], 3);
    assert_eq!(c["fields_total"], 5);
    let mut fields: Vec<&str> = c["disagreements"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["field"].as_str().unwrap())
        .collect();
    fields.sort();
    assert_eq!(fields, ["/address/city", "/age", "/name"]);
    assert_eq!(
        h.metric("keel_consensus_total", &[("result", "split")])
            .await,
        1.0
    );
}

#[tokio::test]
async fn consensus_refusals_are_400s_in_the_clients_protocol() {
    let a = json!({"x": 1});
    let h = voters([a.clone(), a.clone(), a]).await;
    let cases = [
        (
            "2",
            json!({"model": "p", "stream": true, "response_format": {"type": "json_object"}, "messages": [{"role": "user", "content": "s"}]}),
            "stream",
        ),
        ("2", chat_body("text only"), "structured-output"),
        ("1", json_body("one"), "at least 2"),
        ("4", json_body("four"), "has 3 variants"),
        ("three", json_body("words"), "expected the number"),
    ];
    for (n, body, why) in cases {
        let r = h
            .post_with("/v1/chat/completions", &[("x-keel-consensus", n)], &body)
            .await;
        assert_eq!(r.status(), 400, "{n} {body}");
        let e: Value = r.json().await.unwrap();
        let m = e["error"]["message"].as_str().unwrap();
        assert!(
            m.starts_with("x-keel-consensus: ") && m.contains(why),
            "{m}"
        );
    }
    let r = h
        .post_with(
            "/v1/messages",
            &[("x-keel-consensus", "2"), ("anthropic-version", "2023-06-01")],
            &json!({"model": "p", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["type"], "error");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("structured-output"));
}
