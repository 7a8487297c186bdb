//! The OpenAI Responses API (`POST /v1/responses`), served by variants of either protocol:
//! whole and streamed answers, tool calls, a migration mid-stream, and its errors.

use keel_core::sse::SseEvent;
use serde_json::{json, Value};

use crate::harness::*;

async fn start(protocol: &str, n: usize) -> Harness {
    let fleet = keel_sim::Fleet::start_n(n, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let mut cfg = "allow_force_variant = true\n[[pools]]\nname = \"p\"\nhedge = \"off\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n".to_owned();
    for i in 0..n {
        let srv = fleet.get(i);
        let url = if protocol == "openai" {
            srv.openai_base()
        } else {
            srv.anthropic_base()
        };
        cfg.push_str(&variant(
            &srv.name,
            &url,
            protocol,
            if i == 0 { 1000 } else { 1 },
        ));
    }
    Harness::start(fleet, &cfg).await
}

fn request(prompt: &str, stream: bool) -> Value {
    json!({"model": "p", "instructions": "be brief", "input": prompt, "max_output_tokens": 48, "stream": stream})
}

/// The text server `i` generates for the same conversation (its Chat endpoint is the reference:
/// the simulator's text depends on the conversation, not the protocol).
async fn reference_text(h: &Harness, i: usize, prompt: &str) -> String {
    let chat = json!({"model": "p", "max_tokens": 48, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]});
    let v = reference(h, i, "/v1/chat/completions", &chat).await;
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn data(events: &[SseEvent]) -> Vec<Value> {
    events
        .iter()
        .filter(|e| !e.comment_only)
        .map(|e| {
            let v: Value = serde_json::from_str(&e.data).unwrap();
            assert_eq!(e.event.as_deref(), v["type"].as_str(), "event name = type");
            v
        })
        .collect()
}

fn deltas(events: &[Value], kind: &str) -> String {
    events
        .iter()
        .filter(|v| v["type"] == kind)
        .map(|v| v["delta"].as_str().unwrap())
        .collect()
}

/// The events are numbered from 0, start with `response.created` and end with
/// `response.completed` (or `response.incomplete` when the output limit cut the answer);
/// returns the final response.
fn completed(events: &[Value]) -> Value {
    for (n, v) in events.iter().enumerate() {
        assert_eq!(v["sequence_number"], n);
    }
    assert_eq!(events[0]["type"], "response.created");
    let last = events.last().unwrap();
    let status = last["response"]["status"].as_str().unwrap();
    assert_eq!(last["type"], format!("response.{status}"), "{events:?}");
    assert!(status == "completed" || status == "incomplete", "{status}");
    last["response"].clone()
}

#[tokio::test]
async fn text_answers_whole_and_streamed_from_either_protocol() {
    for protocol in ["openai", "anthropic"] {
        let h = start(protocol, 1).await;
        let want = reference_text(&h, 0, "tell me about routing").await;

        let r = h
            .post("/v1/responses", &request("tell me about routing", false))
            .await;
        assert_eq!(r.status(), 200, "{protocol}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["object"], "response");
        assert!(
            v["status"] == "completed" || v["status"] == "incomplete",
            "{v}"
        );
        assert_eq!(v["model"], "p");
        assert!(v["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(v["instructions"], "be brief");
        assert_eq!(v["output"][0]["type"], "message");
        assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
        assert_eq!(
            v["output"][0]["content"][0]["text"],
            want.as_str(),
            "{protocol}"
        );
        assert!(v["usage"]["output_tokens"].as_u64().unwrap() > 0);
        assert_eq!(
            v["usage"]["total_tokens"].as_u64().unwrap(),
            v["usage"]["input_tokens"].as_u64().unwrap()
                + v["usage"]["output_tokens"].as_u64().unwrap()
        );

        let r = h
            .post("/v1/responses", &request("tell me about routing", true))
            .await;
        assert_eq!(r.status(), 200);
        assert!(header(r.headers(), "content-type").starts_with("text/event-stream"));
        let events = data(&read_stream(r).await);
        assert_eq!(
            deltas(&events, "response.output_text.delta"),
            want,
            "{protocol}"
        );
        let last = completed(&events);
        assert_eq!(last["output"][0]["content"][0]["text"], want.as_str());
        assert_eq!(last["model"], "p");
        assert!(
            last["usage"]["input_tokens"].as_u64().unwrap() > 0,
            "{last}"
        );
    }
}

#[tokio::test]
async fn tool_calls_arrive_as_function_call_items_from_either_protocol() {
    let tools = json!([{"type": "function", "name": "weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]);
    for protocol in ["openai", "anthropic"] {
        let h = start(protocol, 1).await;
        let mut body = request("what is the weather in Oslo?", false);
        body["tools"] = tools.clone();
        body["tool_choice"] = json!({"type": "function", "name": "weather"});
        let v: Value = h.post("/v1/responses", &body).await.json().await.unwrap();
        let call = v["output"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["type"] == "function_call")
            .unwrap_or_else(|| panic!("{protocol}: {v}"))
            .clone();
        assert_eq!(call["name"], "weather");
        assert!(!call["call_id"].as_str().unwrap().is_empty());
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"].is_string(), "{args}");
        assert_eq!(v["tools"], tools, "the request's tools are echoed");

        body["stream"] = json!(true);
        let events = data(&read_stream(h.post("/v1/responses", &body).await).await);
        let streamed = deltas(&events, "response.function_call_arguments.delta");
        let done = events
            .iter()
            .find(|e| e["type"] == "response.function_call_arguments.done")
            .unwrap();
        assert_eq!(done["arguments"].as_str().unwrap(), streamed);
        serde_json::from_str::<Value>(&streamed).expect("whole JSON arguments");
        let last = completed(&events);
        assert!(last["output"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["type"] == "function_call"));

        // The tool's result goes back as a function_call_output item.
        let follow = json!({"model": "p", "max_output_tokens": 32, "input": [
            {"role": "user", "content": "what is the weather in Oslo?"},
            {"type": "function_call", "call_id": call["call_id"], "name": "weather", "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "3 C and clear"}],
            "tools": tools});
        let r = h.post("/v1/responses", &follow).await;
        assert_eq!(r.status(), 200, "{protocol}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["output"][0]["type"], "message", "{v}");
    }
}

#[tokio::test]
async fn a_stream_cut_mid_generation_continues_as_one_response() {
    for protocol in ["openai", "anthropic"] {
        let h = start(protocol, 2).await;
        add_fault(h.server(0), json!({"kind": "close", "after_tokens": 5})).await;
        let want = reference_text(&h, 1, "write a long story").await;
        let r = h
            .post_with(
                "/v1/responses",
                &[("x-keel-force-variant", "sim-0")],
                &request("write a long story", true),
            )
            .await;
        assert_eq!(r.status(), 200);
        let events = data(&read_stream(r).await);
        assert_eq!(
            events
                .iter()
                .filter(|e| e["type"] == "response.created")
                .count(),
            1
        );
        assert_eq!(
            deltas(&events, "response.output_text.delta"),
            want,
            "{protocol}"
        );
        let last = completed(&events);
        assert_eq!(
            last["output"].as_array().unwrap().len(),
            1,
            "one message item"
        );
        assert_eq!(
            h.metric("keel_migrations_total", &[]).await,
            1.0,
            "{protocol}"
        );
    }
}

#[tokio::test]
async fn bad_requests_get_openai_errors_naming_the_field() {
    let h = start("openai", 1).await;
    let cases = [
        (
            json!({"model": "p", "input": "x", "previous_response_id": "resp_1"}),
            400,
            "previous_response_id",
        ),
        (
            json!({"model": "p", "input": "x", "tools": [{"type": "web_search"}]}),
            400,
            "tools[0].type",
        ),
        (json!({"model": "p"}), 400, "input"),
        (json!({"input": "x"}), 400, "model"),
        (json!({"model": "nope", "input": "x"}), 404, "nope"),
    ];
    for (body, status, field) in cases {
        let r = h.post("/v1/responses", &body).await;
        assert_eq!(r.status(), status, "{body}");
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{v}"
        );
        assert_eq!(
            v["error"]["type"],
            if status == 404 {
                "not_found_error"
            } else {
                "invalid_request_error"
            }
        );
    }
    let r = keel_sim::http_client()
        .get(h.url("/v1/responses"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);

    // Dropped fields are reported, with the attempt's own fixes.
    let r = h
        .post(
            "/v1/responses",
            &json!({"model": "p", "input": "hi", "store": true, "truncation": "auto"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(r.headers(), "x-keel-prompt-fix"),
        "truncation_dropped,store_dropped"
    );
    assert_eq!(
        h.metric(
            "keel_requests_total",
            &[("endpoint", "responses"), ("outcome", "ok")]
        )
        .await,
        1.0
    );
}
