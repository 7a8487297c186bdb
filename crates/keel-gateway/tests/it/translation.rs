//! Mixed-protocol pools: a client of either protocol served by a variant of the other, through
//! translation at the attempt boundary (whole, streamed, errors, failover, tool calls).

use keel_core::sse::SseEvent;
use serde_json::{json, Value};

use crate::harness::*;

/// A pool `p` over the fleet with each server's variant speaking the given protocol (first
/// server weight `w0`, others 1).
fn mixed_pool(fleet: &keel_sim::Fleet, protocols: &[&str], w0: u32, extra: &str) -> String {
    let mut s = format!(
        "allow_force_variant = true\n[[pools]]\nname = \"p\"\n{extra}\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n"
    );
    for (i, proto) in protocols.iter().enumerate() {
        let srv = fleet.get(i);
        let url = if *proto == "openai" {
            srv.openai_base()
        } else {
            srv.anthropic_base()
        };
        s.push_str(&variant(
            &srv.name,
            &url,
            proto,
            if i == 0 { w0 } else { 1 },
        ));
    }
    s
}

async fn start(protocols: &[&str], w0: u32, extra: &str) -> Harness {
    let fleet = keel_sim::Fleet::start_n(protocols.len(), keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let cfg = mixed_pool(&fleet, protocols, w0, extra);
    Harness::start(fleet, &cfg).await
}

fn anthropic_text(events: &[SseEvent]) -> String {
    events
        .iter()
        .filter(|e| e.event.as_deref() == Some("content_block_delta"))
        .filter_map(|e| {
            serde_json::from_str::<Value>(&e.data).ok()?["delta"]["text"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

fn chat(prompt: &str, stream: bool) -> Value {
    json!({"model": "p", "max_tokens": 48, "stream": stream, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": prompt}]})
}

fn messages(prompt: &str, stream: bool) -> Value {
    json!({"model": "p", "max_tokens": 48, "stream": stream, "system": "be brief",
        "messages": [{"role": "user", "content": prompt}]})
}

#[tokio::test]
async fn openai_client_served_by_anthropic_variant() {
    let h = start(&["anthropic"], 1, "").await;
    // The simulator's text depends on the conversation, not the protocol: the OpenAI endpoint
    // of the same server is the reference.
    let body = chat("tell me about routing", false);
    let want = reference(&h, 0, "/v1/chat/completions", &body).await;
    let want_text = want["choices"][0]["message"]["content"].as_str().unwrap();

    let (status, headers, v) = h.chat(&body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "p");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want_text);
    assert_eq!(
        v["choices"][0]["finish_reason"],
        want["choices"][0]["finish_reason"]
    );
    assert_eq!(
        v["usage"]["completion_tokens"],
        want["usage"]["completion_tokens"]
    );
    assert_eq!(header(&headers, "x-keel-variant"), "sim-0");
    // Nothing was dropped or changed.
    assert!(headers.get("x-keel-prompt-fix").is_none());

    // Streamed.
    let r = h
        .post("/v1/chat/completions", &chat("tell me about routing", true))
        .await;
    assert_eq!(r.status(), 200);
    assert!(header(r.headers(), "content-type").starts_with("text/event-stream"));
    let events = read_stream(r).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert_eq!(openai_stream_text(&events), want_text);
    for e in events
        .iter()
        .filter(|e| !e.comment_only && e.data != "[DONE]")
    {
        let c: Value = serde_json::from_str(&e.data).unwrap();
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "p");
    }
    let finishes: Vec<Value> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .map(|c| c["choices"][0]["finish_reason"].clone())
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, vec![want["choices"][0]["finish_reason"].clone()]);

    // Fixes are reported: no max_tokens (defaulted) and a penalty Anthropic does not know.
    let body = json!({"model": "p", "frequency_penalty": 0.5, "messages": [{"role": "user", "content": "hi"}]});
    let (status, headers, v) = h.chat(&body).await;
    assert_eq!(status, 200, "{v}");
    let fixes = header(&headers, "x-keel-prompt-fix");
    assert!(fixes.contains("max_tokens_defaulted"), "{fixes}");
    assert!(fixes.contains("frequency_penalty_dropped"), "{fixes}");
}

#[tokio::test]
async fn anthropic_client_served_by_openai_variant() {
    let h = start(&["openai"], 1, "").await;
    let body = messages("tell me about routing", false);
    let want = reference(&h, 0, "/v1/messages", &body).await;
    let want_text = want["content"][0]["text"].as_str().unwrap();

    let r = h.post("/v1/messages", &body).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["model"], "p");
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(v["content"][0]["text"], want_text);
    assert_eq!(v["stop_reason"], want["stop_reason"]);
    assert_eq!(v["usage"]["output_tokens"], want["usage"]["output_tokens"]);

    let r = h
        .post("/v1/messages", &messages("tell me about routing", true))
        .await;
    assert_eq!(r.status(), 200);
    let events = read_stream(r).await;
    let names: Vec<&str> = events.iter().filter_map(|e| e.event.as_deref()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert_eq!(names.last(), Some(&"message_stop"), "{names:?}");
    assert_eq!(
        names.iter().filter(|n| **n == "message_stop").count(),
        1,
        "{names:?}"
    );
    let start: Value = serde_json::from_str(&events[0].data).unwrap();
    assert_eq!(start["message"]["model"], "p");
    assert_eq!(anthropic_text(&events), want_text);
    let delta = events
        .iter()
        .find(|e| e.event.as_deref() == Some("message_delta"))
        .unwrap();
    let delta: Value = serde_json::from_str(&delta.data).unwrap();
    assert_eq!(delta["delta"]["stop_reason"], want["stop_reason"]);

    // count_tokens cannot go to an OpenAI variant: answered by keel's estimate, as for an
    // OpenAI pool.
    let r = h
        .post(
            "/v1/messages/count_tokens",
            &json!({"model": "p", "messages": [{"role": "user", "content": "hi there"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["input_tokens"].as_u64().unwrap() > 0, "{v}");
}

#[tokio::test]
async fn fails_over_from_openai_to_anthropic_variant_before_the_first_byte() {
    for stream in [false, true] {
        let h = start(&["openai", "anthropic"], 1000, "").await;
        add_fault(h.server(0), json!({"kind": "error", "status": 503})).await;
        let body = chat("failover please", stream);
        let want = reference(&h, 1, "/v1/messages", &messages("failover please", false)).await;
        let want_text = want["content"][0]["text"].as_str().unwrap();
        let r = h.post("/v1/chat/completions", &body).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(r.headers(), "x-keel-variant"), "sim-1");
        assert_eq!(header(r.headers(), "x-keel-route"), "fallback");
        assert_eq!(header(r.headers(), "x-keel-attempts"), "2");
        if stream {
            let events = read_stream(r).await;
            assert_eq!(events.last().unwrap().data, "[DONE]");
            assert_eq!(openai_stream_text(&events), want_text);
        } else {
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["model"], "p");
            assert_eq!(v["choices"][0]["message"]["content"], want_text);
        }
    }
}

#[tokio::test]
async fn cross_protocol_client_errors_reach_the_client_in_its_shape() {
    // An OpenAI client, an Anthropic variant answering 400.
    let h = start(&["anthropic"], 1, "").await;
    add_fault(h.server(0), json!({"kind": "error", "status": 400})).await;
    let (status, _, v) = h.chat(&chat("x", false)).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(v.get("type").is_none(), "OpenAI shape: {v}");

    // An Anthropic client, an OpenAI variant answering 400.
    let h = start(&["openai"], 1, "").await;
    add_fault(h.server(0), json!({"kind": "error", "status": 400})).await;
    let r = h.post("/v1/messages", &messages("x", true)).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
}

#[tokio::test]
async fn untranslatable_requests_go_to_a_variant_that_can_take_them() {
    // Audio output has no Messages form: the Anthropic primary is skipped for the OpenAI
    // variant.
    let h = start(&["anthropic", "openai"], 1000, "").await;
    let mut body = chat("two please", false);
    body["modalities"] = json!(["text", "audio"]);
    let (status, headers, v) = h.chat(&body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(header(&headers, "x-keel-variant"), "sim-1");
    assert_eq!(header(&headers, "x-keel-attempts"), "1");
    assert_eq!(h.server(0).state.stats().requests, 0);

    // With no variant that can take it: a 400 in the client's shape naming the field.
    let h = start(&["anthropic"], 1, "").await;
    let (status, _, v) = h.chat(&body).await;
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("modalities:"), "{msg}");
    assert_eq!(h.server(0).state.stats().requests, 0);

    // /v1/completions on a pool without an OpenAI variant.
    let r = h
        .post(
            "/v1/completions",
            &json!({"model": "p", "prompt": "Once", "max_tokens": 5}),
        )
        .await;
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("anthropic protocol"));
}

#[tokio::test]
async fn streamed_tool_call_across_protocols() {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}}}}]);
    let h = start(&["anthropic"], 1, "").await;
    let body = json!({"model": "p", "max_tokens": 64, "stream": true, "tools": tools,
        "tool_choice": "required",
        "messages": [{"role": "user", "content": "what is the weather in Paris"}]});
    let want = reference(&h, 0, "/v1/chat/completions", &body).await;
    let want_call = &want["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(want_call["function"]["name"], "get_weather", "{want}");

    let r = h.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status(), 200);
    let events = read_stream(r).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let chunks: Vec<Value> = events
        .iter()
        .filter(|e| !e.comment_only && e.data != "[DONE]")
        .map(|e| serde_json::from_str(&e.data).unwrap())
        .collect();
    let mut name = String::new();
    let mut args = String::new();
    let mut ids = Vec::new();
    for c in &chunks {
        for tc in c["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            assert_eq!(tc["index"], 0);
            if let Some(id) = tc["id"].as_str() {
                ids.push(id.to_owned());
            }
            name.push_str(tc["function"]["name"].as_str().unwrap_or(""));
            args.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(ids.len(), 1, "{chunks:?}");
    assert_eq!(name, "get_weather");
    let args: Value = serde_json::from_str(&args).unwrap();
    let want_args: Value =
        serde_json::from_str(want_call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, want_args);
    let finish = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect::<Vec<_>>();
    assert_eq!(finish, vec!["tool_calls"]);
}

#[tokio::test]
async fn mixed_pool_config_is_accepted() {
    let text = r#"
[[pools]]
name = "m"
[[pools.variants]]
name = "gpt"
url = "https://api.openai.com/v1"
protocol = "openai"
upstream_model = "gpt-4o"
[[pools.variants]]
name = "claude"
url = "https://api.anthropic.com"
protocol = "anthropic"
upstream_model = "claude-sonnet-4-5"
default_max_tokens = 2048
"#;
    let cfg = keel_gateway::Config::parse(text, "mixed.toml", &Default::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let vs = &cfg.pools[0].variants;
    assert_eq!(vs[0].default_max_tokens, 4096);
    assert_eq!(vs[1].default_max_tokens, 2048);
    let bad = text.replace("default_max_tokens = 2048", "default_max_tokens = 0");
    let e = keel_gateway::Config::parse(&bad, "mixed.toml", &Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("default_max_tokens"), "{e}");
}

#[tokio::test]
async fn streams_migrate_across_protocols_by_prefill() {
    for (client, protocols) in [
        ("/v1/messages", ["anthropic", "openai"]),
        ("/v1/chat/completions", ["openai", "anthropic"]),
    ] {
        for n in [1u64, 7] {
            let h = start(&protocols, 1000, "hedge = \"off\"").await;
            add_fault(h.server(0), json!({"kind": "close", "after_tokens": n})).await;
            let body = if client == "/v1/messages" {
                messages("write a long story", true)
            } else {
                chat("write a long story", true)
            };
            // The whole answer as the continuing server would give it.
            let want = reference(&h, 1, client, &body).await;
            let r = h
                .post_with(client, &[("x-keel-force-variant", "sim-0")], &body)
                .await;
            assert_eq!(r.status(), 200);
            let events = read_stream(r).await;
            let data: Vec<&SseEvent> = events.iter().filter(|e| !e.comment_only).collect();
            if client == "/v1/messages" {
                let names: Vec<&str> = data.iter().filter_map(|e| e.event.as_deref()).collect();
                assert_eq!(
                    names.iter().filter(|n| **n == "message_start").count(),
                    1,
                    "{names:?}"
                );
                assert_eq!(names.last(), Some(&"message_stop"), "{names:?}");
                assert_eq!(
                    anthropic_text(&events),
                    want["content"][0]["text"].as_str().unwrap(),
                    "{client} after {n}"
                );
            } else {
                assert_eq!(data.last().unwrap().data, "[DONE]");
                assert_eq!(
                    openai_stream_text(&events),
                    want["choices"][0]["message"]["content"].as_str().unwrap(),
                    "{client} after {n}"
                );
            }
            // The continuation reached the other protocol's server.
            assert!(h.server(1).state.stats().requests >= 1);
            assert!(
                events.iter().any(|e| e.comment_only
                    && String::from_utf8_lossy(&e.raw)
                        .contains("keel migrated from=sim-0 to=sim-1")),
                "{client} after {n}: no migration note"
            );
        }
    }
}
