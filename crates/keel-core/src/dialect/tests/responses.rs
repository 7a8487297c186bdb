//! The Responses upstream dialect: requests (and their round trip through the client-side
//! Responses translation, its mirror image), whole answers, streams split at every byte, errors.

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::*;
use crate::protocol::{event_role, EventRole};
use crate::sse::decode_all;
use crate::translate::responses::{
    chat_completion_to_response, responses_to_chat, ChatToResponsesStream, ResponseIds,
    ResponsesContext,
};
use crate::translate::{chat_to_messages, messages_to_chat};

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().expect("an object").clone()
}

fn body_of(r: &DialectRequest) -> Value {
    serde_json::from_slice(&r.body).expect("JSON")
}

const PNG: &str = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

fn rich_chat() -> Value {
    json!({
        "model": "gpt-4.1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use metric units."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "Weather here and in Bergen?"},
                {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}}]},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "call_A", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
                {"id": "call_B", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Bergen\"}"}}]},
            {"role": "tool", "tool_call_id": "call_A", "content": "3 C"},
            {"role": "tool", "tool_call_id": "call_B", "content": [{"type": "text", "text": "5 C"}]},
            {"role": "user", "content": "And tomorrow?"}
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": false,
        "temperature": 0.5,
        "top_p": 0.9,
        "max_completion_tokens": 300,
        "reasoning_effort": "low",
        "stream": true,
        "stream_options": {"include_usage": true},
        "user": "u-1"
    })
}

#[test]
fn a_rich_chat_request_becomes_the_equivalent_responses_request() {
    let r = request(&obj(rich_chat())).unwrap();
    let expected = json!({
        "model": "gpt-4.1",
        "instructions": "Be brief.\n\nUse metric units.",
        "input": [
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Weather here and in Bergen?"},
                {"type": "input_image", "image_url": PNG, "detail": "low"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_A", "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
            {"type": "function_call", "call_id": "call_B", "name": "weather", "arguments": "{\"city\":\"Bergen\"}"},
            {"type": "function_call_output", "call_id": "call_A", "output": "3 C"},
            {"type": "function_call_output", "call_id": "call_B", "output": "5 C"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}
        ],
        "tools": [{"type": "function", "name": "weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "strict": false}],
        "tool_choice": {"type": "function", "name": "weather"},
        "reasoning": {"effort": "low"},
        "max_output_tokens": 300,
        "temperature": 0.5,
        "top_p": 0.9,
        "parallel_tool_calls": false,
        "user": "u-1",
        "stream": true,
        "store": false
    });
    assert_eq!(body_of(&r), expected);
    assert!(r.fixes.is_empty(), "{:?}", r.fixes);
}

#[test]
fn a_trailing_assistant_message_stays_the_last_input_item() {
    // A continuation after a cut stream: the text already delivered, as the last turn.
    let hub = json!({"model": "m", "messages": [
        {"role": "user", "content": "Count to five."},
        {"role": "assistant", "content": "1, 2, 3"}]});
    let body = body_of(&request(&obj(hub)).unwrap());
    assert_eq!(
        body["input"].as_array().unwrap().last().unwrap(),
        &json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "1, 2, 3"}]})
    );
    assert_eq!(body["store"], false);
    assert!(body.get("instructions").is_none());
}

#[test]
fn structured_output_and_verbosity_become_text_format() {
    let hub = json!({"model": "m", "messages": [{"role": "user", "content": "Name a city."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "strict": true,
            "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": false}}},
        "verbosity": "low"});
    let body = body_of(&request(&obj(hub)).unwrap());
    assert_eq!(
        body["text"],
        json!({"format": {"type": "json_schema", "name": "city",
            "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": false},
            "strict": true}, "verbosity": "low"})
    );
    let hub = json!({"model": "m", "messages": [{"role": "user", "content": "JSON please."}],
        "response_format": {"type": "json_object"}});
    let body = body_of(&request(&obj(hub)).unwrap());
    assert_eq!(body["text"], json!({"format": {"type": "json_object"}}));
}

#[test]
fn tool_choice_forms_map_to_responses_forms() {
    let with = |tc: Value| {
        let hub = json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": tc});
        body_of(&request(&obj(hub)).unwrap())
    };
    assert_eq!(with(json!("required"))["tool_choice"], "required");
    assert_eq!(with(json!("none"))["tool_choice"], "none");
    let allowed = with(
        json!({"type": "allowed_tools", "allowed_tools": {"mode": "required",
        "tools": [{"type": "function", "function": {"name": "f"}}]}}),
    );
    assert_eq!(
        allowed["tool_choice"],
        json!({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "f"}]})
    );
    // A function without parameters still has a schema, and is not strict.
    assert_eq!(
        allowed["tools"],
        json!([{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": false}])
    );
}

#[test]
fn what_responses_cannot_express_is_refused_naming_the_field() {
    let refused = |extra: Value, field: &str| {
        let mut hub = obj(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}));
        for (k, v) in obj(extra) {
            hub.insert(k, v);
        }
        let e = request(&hub).unwrap_err();
        assert!(
            e.message.starts_with(&format!("{field}: "))
                && e.message
                    .ends_with("is not supported by Responses variants"),
            "{field}: {}",
            e.message
        );
    };
    refused(json!({"n": 2}), "n");
    refused(json!({"logprobs": true}), "logprobs");
    refused(json!({"modalities": ["text", "audio"]}), "modalities");
    refused(
        json!({"audio": {"voice": "alloy", "format": "wav"}}),
        "audio",
    );
    refused(json!({"functions": [{"name": "f"}]}), "functions");
    refused(
        json!({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}),
        "messages[0].content[0]",
    );
    refused(
        json!({"tools": [{"type": "custom", "custom": {"name": "grammar"}}]}),
        "tools[0].type",
    );
    // n = 1 and logprobs false ask for nothing Responses lacks.
    let hub = json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 1, "logprobs": false});
    assert!(request(&obj(hub)).unwrap().fixes.is_empty());
}

#[test]
fn dropped_and_changed_fields_are_reported() {
    let hub = json!({"model": "m", "max_tokens": 5, "stop": ["\n"], "seed": 7, "store": true,
        "frequency_penalty": 0.5, "some_vendor_knob": 1,
        "messages": [{"role": "user", "name": "ann", "content": "x"},
            {"role": "assistant", "content": "y", "reasoning_content": "thought"},
            {"role": "user", "content": "z"}]});
    let r = request(&obj(hub)).unwrap();
    let body = body_of(&r);
    assert_eq!(body["max_output_tokens"], 16);
    assert_eq!(body["store"], false);
    for key in ["stop", "seed", "frequency_penalty", "some_vendor_knob"] {
        assert!(body.get(key).is_none(), "{key}");
    }
    assert_eq!(
        r.fixes,
        [
            "name_dropped",
            "reasoning_dropped",
            "max_output_tokens_raised",
            "store_dropped",
            "stop_dropped",
            "frequency_penalty_dropped",
            "seed_dropped",
            "some_vendor_knob_dropped"
        ]
    );
}

#[test]
fn a_system_message_after_the_conversation_started_stays_in_place() {
    let hub = json!({"model": "m", "messages": [
        {"role": "user", "content": "x"},
        {"role": "system", "content": "Now answer in French."},
        {"role": "user", "content": "y"}]});
    let body = body_of(&request(&obj(hub)).unwrap());
    assert!(body.get("instructions").is_none());
    assert_eq!(
        body["input"][1],
        json!({"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Now answer in French."}]})
    );
}

/// The Chat body the mirror translation (a Responses client in front of Chat) makes of this
/// dialect's request: the same conversation, tools and settings as the hub body sent.
#[test]
fn the_client_side_translation_reads_the_request_back_as_the_same_chat_body() {
    let hub = rich_chat();
    let sent = body_of(&request(&obj(hub.clone())).unwrap());
    let back = responses_to_chat(&obj(sent)).unwrap().body;
    let back = Value::Object(back);
    let mut expected = hub.clone();
    // What the two tables say differently: system turns merge into `instructions`, image and
    // tool-result parts come back as the client-side mapping writes them, `strict: false` is
    // made explicit, `max_output_tokens` with reasoning is `max_completion_tokens`.
    expected["messages"] = json!([
        {"role": "system", "content": "Be brief.\n\nUse metric units."},
        hub["messages"][2],
        hub["messages"][3],
        hub["messages"][4],
        {"role": "tool", "tool_call_id": "call_B", "content": "5 C"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}
    ]);
    expected["tools"][0]["function"]["strict"] = json!(false);
    assert_eq!(back["messages"], expected["messages"]);
    for key in [
        "model",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "temperature",
        "top_p",
        "max_completion_tokens",
        "reasoning_effort",
        "stream",
        "stream_options",
        "user",
    ] {
        assert_eq!(back[key], expected[key], "{key}");
    }
}

#[test]
fn an_anthropic_client_request_reaches_a_responses_variant() {
    // Messages → the hub (Chat) → Responses: a prefill, a tool turn, a system prompt.
    let messages = json!({"model": "claude-x", "max_tokens": 512, "system": "Be terse.",
        "messages": [
            {"role": "user", "content": "What is 2+2? Use the tool."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"expr": "2+2"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "4"}]},
            {"role": "assistant", "content": "The answer"}],
        "tools": [{"name": "calc", "input_schema": {"type": "object", "properties": {"expr": {"type": "string"}}}}]});
    let hub = messages_to_chat(&obj(messages)).unwrap().body;
    let body = body_of(&request(&hub).unwrap());
    assert_eq!(body["instructions"], "Be terse.");
    assert_eq!(
        body["input"],
        json!([
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2+2? Use the tool."}]},
            {"type": "function_call", "call_id": "toolu_1", "name": "calc", "arguments": "{\"expr\":\"2+2\"}"},
            {"type": "function_call_output", "call_id": "toolu_1", "output": "4"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "The answer"}]}
        ])
    );
    assert_eq!(body["max_output_tokens"], 512);
    // And a Chat client's body, as `chat_to_messages` would see it, is a valid hub body too.
    assert!(chat_to_messages(&obj(rich_chat()), 1024).is_ok());
}

// ---------------------------------------------------------------------------------------------
// Whole answers.

fn response_fixture() -> Value {
    json!({
        "id": "resp_68af4030592c81938ec0a5fbab4a3e9f05438e46b5f69a3b",
        "object": "response",
        "created_at": 1756315696,
        "status": "completed",
        "error": null,
        "incomplete_details": null,
        "instructions": "Be brief.",
        "max_output_tokens": null,
        "model": "o4-mini-2025-04-16",
        "output": [
            {"id": "rs_68af4030baa48193b0b43b4c2a176a1a05438e46b5f69a3b", "type": "reasoning",
             "summary": [{"type": "summary_text", "text": "**Checking the weather**"},
                         {"type": "summary_text", "text": "Two cities, one call each."}]},
            {"id": "msg_68af40337e3881939b4ae6d8ba1d8e3805438e46b5f69a3b", "type": "message", "status": "completed",
             "role": "assistant", "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "Let me look. ✓"}]},
            {"id": "fc_68af4033d5b48193a2b3c7e3c2e4ec1f05438e46b5f69a3b", "type": "function_call", "status": "completed",
             "arguments": "{\"city\":\"Oslo\"}", "call_id": "call_JtGD2oBDKcFmqtJYRpvwZ5sc", "name": "weather"}
        ],
        "parallel_tool_calls": true,
        "previous_response_id": null,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "service_tier": "default",
        "store": false,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": {"input_tokens": 1234, "input_tokens_details": {"cached_tokens": 1024},
                  "output_tokens": 210, "output_tokens_details": {"reasoning_tokens": 192}, "total_tokens": 1444},
        "user": null,
        "metadata": {}
    })
}

fn whole_value(r: &Value, model: &str) -> Value {
    serde_json::from_slice(&whole(r.to_string().as_bytes(), model).unwrap()).unwrap()
}

#[test]
fn a_whole_response_becomes_a_chat_completion() {
    let chat = whole_value(&response_fixture(), "public-name");
    assert_eq!(
        chat,
        json!({
            "id": "resp_68af4030592c81938ec0a5fbab4a3e9f05438e46b5f69a3b",
            "object": "chat.completion",
            "created": 1756315696,
            "model": "public-name",
            "choices": [{"index": 0, "message": {
                "role": "assistant",
                "content": "Let me look. ✓",
                "refusal": null,
                "reasoning_content": "**Checking the weather**\n\nTwo cities, one call each.",
                "tool_calls": [{"id": "call_JtGD2oBDKcFmqtJYRpvwZ5sc", "type": "function",
                    "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
                "logprobs": null, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 1234, "completion_tokens": 210, "total_tokens": 1444,
                "prompt_tokens_details": {"cached_tokens": 1024},
                "completion_tokens_details": {"reasoning_tokens": 192}},
            "service_tier": "default"
        })
    );
    // No public name given: the Response's own.
    assert_eq!(
        whole_value(&response_fixture(), "")["model"],
        "o4-mini-2025-04-16"
    );
}

#[test]
fn incomplete_and_refused_answers_are_finished_answers() {
    let mut r = response_fixture();
    r["status"] = json!("incomplete");
    r["incomplete_details"] = json!({"reason": "max_output_tokens"});
    assert_eq!(
        whole_value(&r, "m")["choices"][0]["finish_reason"],
        "length"
    );
    r["incomplete_details"] = json!({"reason": "content_filter"});
    assert_eq!(
        whole_value(&r, "m")["choices"][0]["finish_reason"],
        "content_filter"
    );

    let mut r = response_fixture();
    r["output"] = json!([{"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
        "content": [{"type": "refusal", "refusal": "I can't help with that."}]}]);
    let chat = whole_value(&r, "m");
    assert_eq!(chat["choices"][0]["finish_reason"], "stop");
    assert_eq!(chat["choices"][0]["message"]["content"], Value::Null);
    assert_eq!(
        chat["choices"][0]["message"]["refusal"],
        "I can't help with that."
    );
}

#[test]
fn a_failed_or_foreign_whole_body_is_an_error() {
    let mut r = response_fixture();
    r["status"] = json!("failed");
    r["error"] = json!({"code": "server_error", "message": "The model failed."});
    let e = whole(r.to_string().as_bytes(), "m").unwrap_err();
    assert!(e.contains("server_error"), "{e}");
    assert!(whole(b"<html>", "m").is_err());
    assert!(whole(b"{\"choices\": []}", "m").is_err());
}

fn chat_completion_fixture() -> Value {
    json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Two calls.",
            "reasoning_content": "Think first.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
                {"id": "call_2", "type": "function", "function": {"name": "b", "arguments": "{\"x\":1}"}}]},
            "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
            "prompt_tokens_details": {"cached_tokens": 4}}})
}

/// The mirror image: the client-side translation's Response for a Chat answer reads back as
/// that answer.
#[test]
fn a_response_made_by_the_client_side_translation_reads_back_as_its_chat_answer() {
    let chat = chat_completion_fixture();
    let ids = ResponseIds {
        id: "resp_x".into(),
        model: "m".into(),
        created_at: 7,
    };
    let r = chat_completion_to_response(&chat, &ResponsesContext::default(), &ids);
    let back = whole_value(&r, "m");
    let (c, b) = (&chat["choices"][0], &back["choices"][0]);
    assert_eq!(b["finish_reason"], c["finish_reason"]);
    for key in ["content", "reasoning_content", "tool_calls"] {
        assert_eq!(b["message"][key], c["message"][key], "{key}");
    }
    assert_eq!(back["usage"]["prompt_tokens"], 10);
    assert_eq!(back["usage"]["completion_tokens"], 5);
    assert_eq!(back["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
}

// ---------------------------------------------------------------------------------------------
// Streams.

/// A Responses stream as OpenAI writes it: each event named, numbered.
fn sse(events: &[Value]) -> String {
    events
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let mut e = e.clone();
            e["sequence_number"] = json!(i);
            format!("event: {}\ndata: {}\n\n", e["type"].as_str().unwrap(), e)
        })
        .collect()
}

const RID: &str = "resp_68af4030592c81938ec0a5fbab4a3e9f05438e46b5f69a3b";

fn created() -> Vec<Value> {
    let r = json!({"id": RID, "object": "response", "created_at": 1756315696, "status": "in_progress",
        "error": null, "incomplete_details": null, "model": "o4-mini-2025-04-16", "output": [], "usage": null, "store": false});
    vec![
        json!({"type": "response.created", "response": r}),
        json!({"type": "response.in_progress", "response": r}),
    ]
}

/// Reasoning (two summary parts), text, a function call, then `ending`.
fn stream_fixture(ending: Value) -> String {
    let rs = "rs_68af4030baa48193b0b43b4c2a176a1a05438e46b5f69a3b";
    let msg = "msg_68af40337e3881939b4ae6d8ba1d8e3805438e46b5f69a3b";
    let fc = "fc_68af4033d5b48193a2b3c7e3c2e4ec1f05438e46b5f69a3b";
    let mut events = created();
    events.extend([
        json!({"type": "response.output_item.added", "output_index": 0, "item": {"id": rs, "type": "reasoning", "summary": []}}),
        json!({"type": "response.reasoning_summary_part.added", "item_id": rs, "output_index": 0, "summary_index": 0, "part": {"type": "summary_text", "text": ""}}),
        json!({"type": "response.reasoning_summary_text.delta", "item_id": rs, "output_index": 0, "summary_index": 0, "delta": "**Checking"}),
        json!({"type": "response.reasoning_summary_text.delta", "item_id": rs, "output_index": 0, "summary_index": 0, "delta": " the weather**"}),
        json!({"type": "response.reasoning_summary_text.done", "item_id": rs, "output_index": 0, "summary_index": 0, "text": "**Checking the weather**"}),
        json!({"type": "response.reasoning_summary_part.done", "item_id": rs, "output_index": 0, "summary_index": 0, "part": {"type": "summary_text", "text": "**Checking the weather**"}}),
        json!({"type": "response.reasoning_summary_part.added", "item_id": rs, "output_index": 0, "summary_index": 1, "part": {"type": "summary_text", "text": ""}}),
        json!({"type": "response.reasoning_summary_text.delta", "item_id": rs, "output_index": 0, "summary_index": 1, "delta": "Two cities, one call each."}),
        json!({"type": "response.reasoning_summary_text.done", "item_id": rs, "output_index": 0, "summary_index": 1, "text": "Two cities, one call each."}),
        json!({"type": "response.output_item.done", "output_index": 0, "item": {"id": rs, "type": "reasoning", "summary": [
            {"type": "summary_text", "text": "**Checking the weather**"}, {"type": "summary_text", "text": "Two cities, one call each."}]}}),
        json!({"type": "response.output_item.added", "output_index": 1, "item": {"id": msg, "type": "message", "status": "in_progress", "role": "assistant", "content": []}}),
        json!({"type": "response.content_part.added", "item_id": msg, "output_index": 1, "content_index": 0, "part": {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}}),
        json!({"type": "response.output_text.delta", "item_id": msg, "output_index": 1, "content_index": 0, "delta": "Let", "logprobs": []}),
        json!({"type": "response.output_text.delta", "item_id": msg, "output_index": 1, "content_index": 0, "delta": " me look. ✓", "logprobs": []}),
        json!({"type": "response.output_text.done", "item_id": msg, "output_index": 1, "content_index": 0, "text": "Let me look. ✓", "logprobs": []}),
        json!({"type": "response.content_part.done", "item_id": msg, "output_index": 1, "content_index": 0, "part": {"type": "output_text", "annotations": [], "logprobs": [], "text": "Let me look. ✓"}}),
        json!({"type": "response.output_item.done", "output_index": 1, "item": {"id": msg, "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "Let me look. ✓"}]}}),
        json!({"type": "response.output_item.added", "output_index": 2, "item": {"id": fc, "type": "function_call", "status": "in_progress", "arguments": "", "call_id": "call_JtGD2oBDKcFmqtJYRpvwZ5sc", "name": "weather"}}),
        json!({"type": "response.function_call_arguments.delta", "item_id": fc, "output_index": 2, "delta": "{\"city\":"}),
        json!({"type": "response.function_call_arguments.delta", "item_id": fc, "output_index": 2, "delta": "\"Oslo\"}"}),
        json!({"type": "response.function_call_arguments.done", "item_id": fc, "output_index": 2, "arguments": "{\"city\":\"Oslo\"}"}),
        json!({"type": "response.output_item.done", "output_index": 2, "item": {"id": fc, "type": "function_call", "status": "completed", "arguments": "{\"city\":\"Oslo\"}", "call_id": "call_JtGD2oBDKcFmqtJYRpvwZ5sc", "name": "weather"}}),
        ending,
    ]);
    sse(&events)
}

fn completed() -> Value {
    json!({"type": "response.completed", "response": response_fixture()})
}

fn run(input: &[&[u8]], model: &str, include_usage: bool) -> Vec<u8> {
    let mut s = Stream::new(model, include_usage);
    let mut out = Vec::new();
    for piece in input {
        s.feed(piece, &mut out).unwrap();
    }
    s.end(&mut out).unwrap();
    out
}

fn chunks(out: &[u8]) -> Vec<Value> {
    decode_all(out)
        .unwrap()
        .into_iter()
        .map(|e| {
            if e.data == "[DONE]" {
                json!("[DONE]")
            } else {
                serde_json::from_str(&e.data).unwrap()
            }
        })
        .collect()
}

fn chunk(delta: Value, finish: Value) -> Value {
    json!({"id": RID, "object": "chat.completion.chunk", "created": 1756315696, "model": "public",
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
}

#[test]
fn a_stream_becomes_chat_chunks_named_after_the_response() {
    let input = stream_fixture(completed());
    let out = run(&[input.as_bytes()], "public", true);
    let expected = vec![
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(json!({"reasoning_content": "**Checking"}), Value::Null),
        chunk(json!({"reasoning_content": " the weather**"}), Value::Null),
        chunk(
            json!({"reasoning_content": "\n\nTwo cities, one call each."}),
            Value::Null,
        ),
        chunk(json!({"content": "Let"}), Value::Null),
        chunk(json!({"content": " me look. ✓"}), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_JtGD2oBDKcFmqtJYRpvwZ5sc", "type": "function",
                "function": {"name": "weather", "arguments": ""}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]}),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
        json!({"id": RID, "object": "chat.completion.chunk", "created": 1756315696, "model": "public", "choices": [],
            "usage": {"prompt_tokens": 1234, "completion_tokens": 210, "total_tokens": 1444,
                "prompt_tokens_details": {"cached_tokens": 1024}, "completion_tokens_details": {"reasoning_tokens": 192}}}),
        json!("[DONE]"),
    ];
    assert_eq!(chunks(&out), expected);
    // The hub reader sees a role chunk, output, and the clean end.
    let events = decode_all(&out).unwrap();
    assert_eq!(
        event_role(Protocol::OpenAi, &events[0]),
        EventRole::Preamble
    );
    assert_eq!(event_role(Protocol::OpenAi, &events[1]), EventRole::Output);
    assert_eq!(
        event_role(Protocol::OpenAi, events.last().unwrap()),
        EventRole::Terminal
    );
}

#[test]
fn a_stream_split_at_every_byte_gives_the_same_chunks() {
    let input = stream_fixture(completed());
    let whole_out = run(&[input.as_bytes()], "public", true);
    let bytes = input.as_bytes();
    for cut in 0..=bytes.len() {
        let out = run(&[&bytes[..cut], &bytes[cut..]], "public", true);
        assert_eq!(out, whole_out, "cut at {cut}");
    }
    let singles: Vec<&[u8]> = bytes.chunks(1).collect();
    assert_eq!(run(&singles, "public", true), whole_out);
}

#[test]
fn the_streamed_answer_is_the_whole_answer() {
    let input = stream_fixture(completed());
    let got = accumulate(&chunks(&run(&[input.as_bytes()], "public", true)));
    let mut want = whole_value(&response_fixture(), "public");
    // Chat streams carry the service tier on every chunk, which this comparison does not read.
    want.as_object_mut().unwrap().remove("service_tier");
    assert_eq!(got, want);
}

/// A Chat answer accumulated from its chunks the way the OpenAI SDKs do, with the fields this
/// dialect fills.
fn accumulate(chunks: &[Value]) -> Value {
    let (mut content, mut reasoning, mut refusal) = (String::new(), String::new(), String::new());
    let mut calls: Vec<Value> = Vec::new();
    let (mut finish, mut usage) = (Value::Null, Value::Null);
    let (mut id, mut created, mut model) = (Value::Null, Value::Null, Value::Null);
    for c in chunks.iter().filter(|c| c.is_object()) {
        id = c["id"].clone();
        created = c["created"].clone();
        model = c["model"].clone();
        if c.get("usage").is_some_and(|u| u.is_object()) {
            usage = c["usage"].clone();
        }
        let Some(choice) = c.pointer("/choices/0") else {
            continue;
        };
        let d = &choice["delta"];
        content += d["content"].as_str().unwrap_or("");
        reasoning += d["reasoning_content"].as_str().unwrap_or("");
        refusal += d["refusal"].as_str().unwrap_or("");
        for t in d["tool_calls"].as_array().into_iter().flatten() {
            let i = t["index"].as_u64().unwrap() as usize;
            if calls.len() <= i {
                calls.push(json!({"id": t["id"], "type": "function",
                    "function": {"name": t["function"]["name"], "arguments": ""}}));
            }
            let args = calls[i]["function"]["arguments"]
                .as_str()
                .unwrap()
                .to_owned()
                + t["function"]["arguments"].as_str().unwrap_or("");
            calls[i]["function"]["arguments"] = args.into();
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    let mut message = json!({"role": "assistant",
        "content": if content.is_empty() && (!calls.is_empty() || !refusal.is_empty()) { Value::Null } else { content.into() },
        "refusal": if refusal.is_empty() { Value::Null } else { refusal.into() }});
    if !reasoning.is_empty() {
        message["reasoning_content"] = reasoning.into();
    }
    if !calls.is_empty() {
        message["tool_calls"] = calls.into();
    }
    let mut out = json!({"id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}]});
    if !usage.is_null() {
        out["usage"] = usage;
    }
    out
}

#[test]
fn a_stream_cut_before_its_end_has_no_finish_and_no_done() {
    let input = stream_fixture(completed());
    let cut = input.find("event: response.completed").unwrap();
    let out = run(&[&input.as_bytes()[..cut]], "public", true);
    let got = chunks(&out);
    assert!(!got.is_empty());
    assert!(got.iter().all(|c| c.is_object()), "no [DONE]");
    assert!(got.iter().all(|c| c["choices"]
        .as_array()
        .is_some_and(|cs| cs.iter().all(|ch| ch["finish_reason"].is_null()))));
    // Cut inside an event: the same.
    let out = run(&[&input.as_bytes()[..cut + 30]], "public", true);
    assert_eq!(chunks(&out), got);
}

#[test]
fn an_incomplete_response_finishes_with_length_and_no_usage_chunk_unless_asked() {
    let mut r = response_fixture();
    r["status"] = json!("incomplete");
    r["incomplete_details"] = json!({"reason": "max_output_tokens"});
    let mut events = created();
    events.push(json!({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "Once upon"}));
    events.push(json!({"type": "response.incomplete", "response": r}));
    let out = chunks(&run(&[sse(&events).as_bytes()], "public", false));
    assert_eq!(
        out,
        vec![
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"content": "Once upon"}), Value::Null),
            chunk(json!({}), json!("length")),
            json!("[DONE]"),
        ]
    );
}

#[test]
fn a_refusal_and_a_content_filter_stop_are_finished_answers() {
    let mut r = response_fixture();
    r["status"] = json!("incomplete");
    r["incomplete_details"] = json!({"reason": "content_filter"});
    r["output"] = json!([]);
    let mut events = created();
    events.push(json!({"type": "response.refusal.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "I can't"}));
    events.push(json!({"type": "response.refusal.done", "item_id": "msg_1", "output_index": 0, "content_index": 0, "refusal": "I can't help."}));
    events.push(json!({"type": "response.incomplete", "response": r}));
    let out = chunks(&run(&[sse(&events).as_bytes()], "public", false));
    assert_eq!(
        out[1..],
        [
            chunk(json!({"refusal": "I can't"}), Value::Null),
            chunk(json!({"refusal": " help."}), Value::Null),
            chunk(json!({}), json!("content_filter")),
            json!("[DONE]"),
        ]
    );
}

#[test]
fn a_failed_response_and_an_error_event_end_in_an_openai_error_without_done() {
    let mut r = response_fixture();
    r["status"] = json!("failed");
    r["error"] =
        json!({"code": "rate_limit_exceeded", "message": "Rate limit reached for o4-mini."});
    let mut events = created();
    events.push(json!({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "Hel"}));
    events.push(json!({"type": "response.failed", "response": r}));
    let out = run(&[sse(&events).as_bytes()], "public", true);
    let evs = decode_all(&out).unwrap();
    let last = evs.last().unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(&last.data).unwrap(),
        json!({"error": {"message": "Rate limit reached for o4-mini.", "type": "rate_limit_error",
            "param": null, "code": "rate_limit_exceeded"}})
    );
    assert!(matches!(
        event_role(Protocol::OpenAi, last),
        EventRole::Error(_)
    ));
    assert!(evs.iter().all(|e| e.data != "[DONE]"));

    let mut events = created();
    events.push(
        json!({"type": "error", "code": "server_is_overloaded", "message": "Busy.", "param": null}),
    );
    let out = chunks(&run(&[sse(&events).as_bytes()], "public", true));
    assert_eq!(
        out.last().unwrap(),
        &json!({"error": {"message": "Busy.", "type": "overloaded_error", "param": null, "code": "server_is_overloaded"}})
    );
    assert_eq!(out.len(), 2);
}

#[test]
fn arguments_and_text_only_in_done_events_are_not_lost() {
    // A server that sends a function call whole (no deltas) and text only in its `.done`.
    let mut events = created();
    events.push(json!({"type": "response.output_text.done", "item_id": "msg_1", "output_index": 0, "content_index": 0, "text": "Calling."}));
    events.push(json!({"type": "response.output_item.done", "output_index": 1, "item": {"id": "fc_1", "type": "function_call",
        "status": "completed", "arguments": "{\"a\":1}", "call_id": "call_1", "name": "f"}}));
    let mut r = response_fixture();
    r["output"] = json!([]);
    r["usage"] = Value::Null;
    events.push(json!({"type": "response.completed", "response": r}));
    let got = accumulate(&chunks(&run(&[sse(&events).as_bytes()], "public", false)));
    assert_eq!(got["choices"][0]["message"]["content"], "Calling.");
    assert_eq!(
        got["choices"][0]["message"]["tool_calls"],
        json!([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}])
    );
    assert_eq!(got["choices"][0]["finish_reason"], "tool_calls");
}

#[test]
fn a_malformed_event_is_an_error() {
    let mut s = Stream::new("m", false);
    let mut out = Vec::new();
    assert!(s
        .feed(b"event: response.created\ndata: {nope\n\n", &mut out)
        .is_err());
    let mut s = Stream::new("m", false);
    let orphan = sse(&[
        json!({"type": "response.function_call_arguments.delta", "output_index": 3, "delta": "{"}),
    ]);
    assert!(s.feed(orphan.as_bytes(), &mut out).is_err());
}

// ---------------------------------------------------------------------------------------------
// Round trip through the client-side translation: Chat chunks → Responses events (what an
// OpenAI Responses server sends, as keel's own Responses front writes them) → this dialect.

fn chat_chunks(text: &[String], args: &[String], finish: &str) -> Vec<crate::sse::SseEvent> {
    let ev = |v: Value| crate::sse::SseEvent::new(None, &v.to_string());
    let c = |delta: Value, finish: Value| {
        ev(
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
        )
    };
    let mut out = vec![c(json!({"role": "assistant", "content": ""}), Value::Null)];
    out.push(c(json!({"reasoning_content": "Hmm."}), Value::Null));
    for t in text {
        out.push(c(json!({"content": t}), Value::Null));
    }
    if !args.is_empty() {
        out.push(c(
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
            Value::Null,
        ));
        for a in args {
            out.push(c(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": a}}]}),
                Value::Null,
            ));
        }
    }
    out.push(c(json!({}), json!(finish)));
    out.push(ev(json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 2}}})));
    out.push(crate::sse::SseEvent::new(None, "[DONE]"));
    out
}

proptest! {
    #[test]
    fn chat_through_the_responses_front_and_back_is_the_same_answer(
        text in proptest::collection::vec("[a-zé ]{0,6}", 0..5),
        args in proptest::collection::vec("[{}\":a-z0-9]{1,5}", 0..4),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let finish = if args.is_empty() { "stop" } else { "tool_calls" };
        let chat = chat_chunks(&text, &args, finish);
        let ids = ResponseIds { id: "resp_rt".into(), model: "m".into(), created_at: 7 };
        let mut front = ChatToResponsesStream::new(ResponsesContext::default(), ids);
        let mut responses = Vec::new();
        for e in &chat {
            front.push(e, &mut responses).unwrap();
        }
        let wire: Vec<u8> = responses.iter().flat_map(|e| e.raw.clone()).collect();
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
        points.extend([0, wire.len()]);
        points.sort_unstable();
        points.dedup();
        let pieces: Vec<&[u8]> = points.windows(2).map(|w| &wire[w[0]..w[1]]).collect();
        let mut got = accumulate(&chunks(&run(&pieces, "m", true)));
        // The Responses usage always has reasoning tokens (0 here); the Chat usage had none.
        got["usage"].as_object_mut().unwrap().remove("completion_tokens_details");
        let want = chat_chunks(&text, &args, finish);
        let want: Vec<Value> = want.iter().map(|e| serde_json::from_str(&e.data).unwrap_or(json!("[DONE]"))).collect();
        let mut want = accumulate(&want);
        want["id"] = json!("resp_rt");
        prop_assert_eq!(got, want);
    }
}

// ---------------------------------------------------------------------------------------------
// Errors.

#[test]
fn error_bodies_stay_openai_shaped_and_complete() {
    let body = br#"{"error": {"message": "Invalid 'input[2].content': empty.", "type": "invalid_request_error", "param": "input[2].content", "code": "empty_array"}}"#;
    let got: Value = serde_json::from_slice(&error(400, body)).unwrap();
    assert_eq!(got, serde_json::from_slice::<Value>(body).unwrap());

    let body = br#"{"error": {"message": "Rate limit reached.", "code": "rate_limit_exceeded"}}"#;
    let got: Value = serde_json::from_slice(&error(429, body)).unwrap();
    assert_eq!(
        got,
        json!({"error": {"message": "Rate limit reached.", "type": "rate_limit_error", "param": null, "code": "rate_limit_exceeded"}})
    );

    let got: Value =
        serde_json::from_slice(&error(503, b"<html>Service Unavailable</html>")).unwrap();
    assert_eq!(
        got,
        json!({"error": {"message": "HTTP 503 from the Responses upstream", "type": "overloaded_error", "param": null, "code": null}})
    );
    let got: Value = serde_json::from_slice(&error(404, br#"{"detail": "Not Found"}"#)).unwrap();
    assert_eq!(got["error"]["message"], "Not Found");
    assert_eq!(got["error"]["type"], "not_found_error");
}
