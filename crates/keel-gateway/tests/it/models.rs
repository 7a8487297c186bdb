//! What a client is told about models: `GET /v1/models` (and `/v1/models/{id}`) in the
//! client's protocol, and the `model` of every answer (the name the client asked for, unless
//! the pool keeps the upstream's with `response_model = "upstream"`).

use keel_core::sse::SseEvent;
use serde_json::{json, Value};

use crate::harness::*;

/// Two pools over one server: `p` (aliases `p-alias`, `p2`; OpenAI variant) and `q` (an
/// Anthropic variant), `extra` added to both pools.
async fn start(extra: &str) -> Harness {
    let fleet = keel_sim::Fleet::start_n(1, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let srv = fleet.get(0);
    let health = "[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n";
    let cfg = format!(
        "[[pools]]\nname = \"p\"\naliases = [\"p-alias\", \"p2\"]\n{extra}\n{health}{}\
         [[pools]]\nname = \"q\"\n{extra}\n{health}{}",
        variant("o", &srv.openai_base(), "openai", 1),
        variant("a", &srv.anthropic_base(), "anthropic", 1),
    );
    Harness::start(fleet, &cfg).await
}

async fn get(h: &Harness, path: &str, anthropic: bool) -> (u16, Value) {
    let mut r = keel_sim::http_client().get(h.url(path));
    if anthropic {
        r = r
            .header("anthropic-version", "2023-06-01")
            .header("x-api-key", "k");
    }
    let r = r.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

fn chat(model: &str, stream: bool) -> Value {
    json!({"model": model, "max_tokens": 32, "stream": stream,
        "messages": [{"role": "user", "content": "hello there"}]})
}

/// The `model` of a whole answer (either protocol).
async fn whole_model(h: &Harness, path: &str, model: &str) -> String {
    let r = h.post(path, &chat(model, false)).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    v["model"].as_str().unwrap().to_owned()
}

/// Every `model` a streamed answer carries: each OpenAI chunk's, or `message_start`'s.
async fn stream_models(h: &Harness, path: &str, model: &str) -> Vec<String> {
    let r = h.post(path, &chat(model, true)).await;
    assert_eq!(r.status(), 200);
    let events: Vec<SseEvent> = read_stream(r).await;
    let models: Vec<String> = events
        .iter()
        .filter(|e| e.data != "[DONE]" && !e.comment_only)
        .filter_map(|e| {
            let v: Value = serde_json::from_str(&e.data).ok()?;
            let m = if v["type"] == "message_start" {
                &v["message"]["model"]
            } else {
                &v["model"]
            };
            m.as_str().map(str::to_owned)
        })
        .collect();
    assert!(!models.is_empty(), "{events:?}");
    models
}

#[tokio::test]
async fn openai_list_holds_every_pool_and_alias() {
    let h = start("").await;
    let (status, v) = get(&h, "/v1/models", false).await;
    assert_eq!(status, 200);
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["p", "p-alias", "p2", "q"]);
    for m in v["data"].as_array().unwrap() {
        assert_eq!(m["object"], "model");
        assert_eq!(m["owned_by"], "keel");
        assert!(m["created"].is_u64());
    }
    let (status, m) = get(&h, "/v1/models/p-alias", false).await;
    assert_eq!(status, 200);
    assert_eq!(
        m,
        json!({"id": "p-alias", "object": "model", "created": 0, "owned_by": "keel"})
    );
    let (status, e) = get(&h, "/v1/models/nope", false).await;
    assert_eq!(status, 404);
    assert!(
        e["error"]["message"].as_str().unwrap().contains("nope"),
        "{e}"
    );
}

#[tokio::test]
async fn anthropic_list_has_anthropic_shape() {
    let h = start("").await;
    let (status, v) = get(&h, "/v1/models", true).await;
    assert_eq!(status, 200);
    assert_eq!(v["has_more"], false);
    assert_eq!(v["first_id"], "p");
    assert_eq!(v["last_id"], "q");
    assert!(v.get("object").is_none());
    let data = v["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["p", "p-alias", "p2", "q"]);
    for m in data {
        assert_eq!(m["type"], "model");
        assert_eq!(m["display_name"], m["id"]);
        assert!(m["created_at"].as_str().unwrap().ends_with('Z'));
    }
    let (status, m) = get(&h, "/v1/models/q", true).await;
    assert_eq!(status, 200);
    assert_eq!(m["type"], "model");
    assert_eq!(m["id"], "q");
    let (status, e) = get(&h, "/v1/models/nope", true).await;
    assert_eq!(status, 404);
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "not_found_error");
}

#[tokio::test]
async fn answers_carry_the_requested_name_by_default() {
    let h = start("").await;
    for (path, model) in [
        // Same protocol (upstream answers "sim") and translated, under name and alias.
        ("/v1/chat/completions", "p"),
        ("/v1/chat/completions", "p-alias"),
        ("/v1/messages", "q"),
        ("/v1/messages", "p2"),
        ("/v1/chat/completions", "q"),
    ] {
        assert_eq!(whole_model(&h, path, model).await, model, "{path} {model}");
        let streamed = stream_models(&h, path, model).await;
        assert!(
            streamed.iter().all(|m| m == model),
            "{path} {model}: {streamed:?}"
        );
    }
}

#[tokio::test]
async fn response_model_upstream_keeps_the_upstreams() {
    let h = start("response_model = \"upstream\"").await;
    for (path, model) in [
        ("/v1/chat/completions", "p"),
        ("/v1/chat/completions", "p-alias"),
        ("/v1/messages", "q"),
        ("/v1/messages", "p"),
        ("/v1/chat/completions", "q"),
    ] {
        assert_eq!(whole_model(&h, path, model).await, "sim", "{path} {model}");
        let streamed = stream_models(&h, path, model).await;
        assert!(
            streamed.iter().all(|m| m == "sim"),
            "{path} {model}: {streamed:?}"
        );
    }
}

#[tokio::test]
async fn response_model_is_validated() {
    let fleet = keel_sim::Fleet::start_n(1, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let cfg = format!(
        "[[pools]]\nname = \"p\"\nresponse_model = \"upstreem\"\n{}",
        variant("o", &fleet.get(0).openai_base(), "openai", 1)
    );
    let e = keel_gateway::Config::parse(&cfg, "t.toml", &Default::default()).unwrap_err();
    let e = e.to_string();
    assert!(e.contains("did you mean `upstream`"), "{e}");
}
