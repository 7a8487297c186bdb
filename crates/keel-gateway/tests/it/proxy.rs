//! Transparent proxying in both protocols.

use serde_json::{json, Value};

use crate::harness::*;

#[tokio::test]
async fn openai_whole_and_streamed_match_the_upstream() {
    let h = Harness::openai(2, 1, "", "").await;
    let direct: Value = keel_sim::http_client()
        .post(format!("{}/chat/completions", h.server(0).openai_base()))
        .json(&chat_body("hello keel"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let want = direct["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();

    let (status, headers, body) = h.chat(&chat_body("hello keel")).await;
    assert_eq!(status, 200);
    assert_eq!(body["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(
        body["model"], "p",
        "the upstream's answer, with the name the client asked for"
    );
    assert_eq!(header(&headers, "x-keel-route"), "direct");
    assert_eq!(header(&headers, "x-keel-attempts"), "1");
    assert!(["sim-0", "sim-1"].contains(&header(&headers, "x-keel-variant")));
    let id = header(&headers, "x-keel-request-id").to_owned();
    assert_eq!(uuid::Uuid::parse_str(&id).unwrap().get_version_num(), 7);

    let resp = h
        .post("/v1/chat/completions", &stream_body("hello keel"))
        .await;
    assert_eq!(resp.status(), 200);
    assert!(header(resp.headers(), "content-type").starts_with("text/event-stream"));
    assert_eq!(header(resp.headers(), "x-keel-attempts"), "1");
    let events = read_stream(resp).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert_eq!(openai_stream_text(&events), want);
}

#[tokio::test]
async fn anthropic_whole_and_streamed() {
    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let cfg = pool_over(&fleet, "claude", "anthropic", 1, "");
    let h = Harness::start(fleet, &cfg).await;
    let body = json!({"model": "claude", "max_tokens": 64, "system": "be brief", "messages": [{"role": "user", "content": "hi"}]});
    let r = h.post("/v1/messages", &body).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "message");
    let text = v["content"][0]["text"].as_str().unwrap().to_owned();

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let events = read_stream(h.post("/v1/messages", &sbody).await).await;
    let names: Vec<&str> = events.iter().filter_map(|e| e.event.as_deref()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names.last(), Some(&"message_stop"));
    let streamed: String = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("content_block_delta"))
        .map(|e| {
            serde_json::from_str::<Value>(&e.data).unwrap()["delta"]["text"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(streamed, text);

    // count_tokens is forwarded to an Anthropic upstream.
    let r = h
        .post(
            "/v1/messages/count_tokens",
            &json!({"model": "claude", "messages": [{"role": "user", "content": "hi there"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert!(
        r.json::<Value>().await.unwrap()["input_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    // The OpenAI endpoint reaches an Anthropic pool through translation (see `translation`);
    // /v1/completions, which has no Messages form, gets a clear error.
    let r = h
        .post(
            "/v1/chat/completions",
            &json!({"model": "claude", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let r = h
        .post(
            "/v1/completions",
            &json!({"model": "claude", "prompt": "x"}),
        )
        .await;
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("anthropic protocol"));
}

#[tokio::test]
async fn completions_endpoint_and_unknown_fields_pass_through() {
    let h = Harness::openai(1, 1, "", "").await;
    let body = json!({"model": "p", "prompt": "Once upon a time", "max_tokens": 5, "x_vendor_flag": {"deep": [1, 2]}, "temperature": 0});
    let r = h.post("/v1/completions", &body).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    let seen = h.server(0).state.last_body();
    assert_eq!(seen["x_vendor_flag"], json!({"deep": [1, 2]}));
    assert_eq!(
        seen["model"], "sim",
        "the public name is replaced by the upstream model"
    );
    assert_eq!(seen["temperature"], 0);
}

#[tokio::test]
async fn credentials_are_the_variants_and_never_leak() {
    let cfg = keel_sim::ServerConfig {
        api_key: Some("sk-upstream-secret".into()),
        ..keel_sim::ServerConfig::fast("s")
    };
    let fleet = keel_sim::Fleet::start_n(1, cfg).await.unwrap();
    let toml = format!(
        "[[pools]]\nname = \"p\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n[[pools.variants]]\nname = \"a\"\nurl = \"{}\"\nprotocol = \"openai\"\nupstream_model = \"sim\"\napi_key = \"${{UPSTREAM_KEY}}\"\nparams = {{ max_tokens = 3 }}\n",
        fleet.get(0).openai_base()
    );
    let h = Harness::start(fleet, &toml).await;
    let r = keel_sim::http_client()
        .post(h.url("/v1/chat/completions"))
        .bearer_auth("client-key")
        .header("x-api-key", "client-key-2")
        .header("x-keel-session", "s1")
        .header("openai-beta", "x")
        .json(&json!({"model": "p", "max_tokens": 50, "messages": [{"role": "user", "content": "x"}]}))
        .send().await.unwrap();
    assert_eq!(
        r.status(),
        200,
        "the sim accepted the variant's key, not the client's"
    );
    let text = r.text().await.unwrap();
    assert!(!text.contains("sk-upstream-secret"));
    let seen: std::collections::HashMap<String, String> =
        h.server(0).state.last_headers().into_iter().collect();
    assert_eq!(seen["authorization"], "Bearer sk-upstream-secret");
    assert!(
        !seen.contains_key("x-api-key"),
        "client's x-api-key is not forwarded"
    );
    assert!(!seen.keys().any(|k| k.starts_with("x-keel-")));
    assert!(
        !seen.contains_key("openai-beta"),
        "other client headers pass only when forward_headers lists them"
    );
    assert_eq!(
        h.server(0).state.last_body()["max_tokens"],
        3,
        "variant params cap max_tokens"
    );
    assert!(!h.metrics().await.contains("sk-upstream-secret"));
    let health = keel_sim::http_client()
        .get(h.url("/keel/health"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!health.contains("sk-upstream-secret"));
}

#[tokio::test]
async fn models_health_and_metrics_endpoints() {
    let fleet = keel_sim::Fleet::start_n(1, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let cfg = pool_over(&fleet, "models-pool", "openai", 1, "aliases = [\"mp\"]");
    let h = Harness::start(fleet, &cfg).await;
    let v: Value = h.get_json("/v1/models").await;
    assert_eq!(v["data"][0]["id"], "models-pool");
    let a: Value = keel_sim::http_client()
        .get(h.url("/v1/models"))
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(a["data"][0]["type"], "model");
    // An alias routes to its pool.
    let (status, _, _) = h
        .chat(&json!({"model": "mp", "messages": [{"role": "user", "content": "x"}]}))
        .await;
    assert_eq!(status, 200);
    let health: Value = h.get_json("/keel/health").await;
    assert_eq!(health["pools"][0]["variants"][0]["available"], true);
    let m = h.metrics().await;
    let requests = [
        ("pool", "models-pool"),
        ("endpoint", "chat_completions"),
        ("route", "direct"),
        ("outcome", "ok"),
    ];
    assert_eq!(
        parse_metric(&m, "keel_requests_total", &requests),
        1.0,
        "{m}"
    );
    let attempts = [
        ("pool", "models-pool"),
        ("variant", "sim-0"),
        ("kind", "first"),
        ("outcome", "ok"),
    ];
    assert_eq!(
        parse_metric(&m, "keel_attempts_total", &attempts),
        1.0,
        "{m}"
    );
    assert!(m.contains("keel_request_duration_seconds_bucket{pool=\"models-pool\""));
    assert!(m.contains("keel_ttft_seconds_bucket{pool=\"models-pool\""));
}

#[tokio::test]
async fn count_tokens_on_an_openai_pool_is_estimated_locally() {
    let h = Harness::openai(1, 1, "", "").await;
    let r = h
        .post(
            "/v1/messages/count_tokens",
            &json!({"model": "p", "messages": [{"role": "user", "content": "Hello, world."}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    // The text's 4 tokens (keel's rule for a model it has no tokenizer for) plus the framing
    // every message costs (`keel_core::fit::MESSAGE_OVERHEAD_TOKENS`).
    assert_eq!(
        r.json::<Value>().await.unwrap()["input_tokens"],
        4 + keel_core::fit::MESSAGE_OVERHEAD_TOKENS
    );
    assert_eq!(h.server(0).state.stats().requests, 0);
}

/// Sequential requests, whole and streamed, share one keep-alive connection to the upstream:
/// keel's own pool gives a connection back when its response was read (the relay stops at
/// the stream's terminal event, before the transfer's own end).
#[tokio::test]
async fn sequential_requests_reuse_the_upstream_connection() {
    let h = Harness::openai(1, 1, "", "").await;
    for i in 0..10 {
        let (status, _, _) = h.chat(&chat_body(&format!("whole {i}"))).await;
        assert_eq!(status, 200);
        let resp = h
            .post(
                "/v1/chat/completions",
                &stream_body(&format!("streamed {i}")),
            )
            .await;
        assert_eq!(resp.status(), 200);
        let events = read_stream(resp).await;
        assert!(!openai_stream_text(&events).is_empty());
    }
    let opened = h
        .metric("keel_upstream_connections_opened_total", &[("pool", "p")])
        .await;
    assert!(
        (1.0..=2.0).contains(&opened),
        "20 requests one after the other opened {opened} connections"
    );
}
