//! Responses API: request translation (and its round trip through Messages), whole answers,
//! streams replayed the way the SDKs accumulate them.

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::*;
use crate::assemble::Assembler;
use crate::protocol::{Endpoint, Protocol};
use crate::sse::SseEvent;
use crate::translate::tests::split_at;
use crate::translate::{chat_to_messages, messages_to_chat};

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().expect("an object").clone()
}

fn ids() -> ResponseIds {
    ResponseIds {
        id: "resp_abc".into(),
        model: "public".into(),
        created_at: 7,
    }
}

fn rich_request() -> Value {
    json!({
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Weather in Oslo and Bergen?"},
                {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_A", "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
            {"type": "function_call", "call_id": "call_B", "name": "weather", "arguments": "{\"city\":\"Bergen\"}"},
            {"type": "function_call_output", "call_id": "call_A", "output": "3 C"},
            {"type": "function_call_output", "call_id": "call_B", "output": "5 C"},
            {"role": "user", "content": "And tomorrow?"}
        ],
        "tools": [{"type": "function", "name": "weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
        "tool_choice": {"type": "function", "name": "weather"},
        "parallel_tool_calls": false,
        "temperature": 0.5,
        "top_p": 0.9,
        "max_output_tokens": 300,
        "stream": true,
        "user": "u-1",
        "metadata": {"team": "x"}
    })
}

#[test]
fn a_rich_request_becomes_the_equivalent_chat_request() {
    let t = responses_to_chat(&obj(rich_request())).unwrap();
    let expected = json!({
        "model": "m",
        "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": 0.5,
        "top_p": 0.9,
        "parallel_tool_calls": false,
        "user": "u-1",
        "max_tokens": 300,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": [
                {"type": "text", "text": "Weather in Oslo and Bergen?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}}]},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "call_A", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
                {"id": "call_B", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Bergen\"}"}}]},
            {"role": "tool", "tool_call_id": "call_A", "content": "3 C"},
            {"role": "tool", "tool_call_id": "call_B", "content": "5 C"},
            {"role": "user", "content": "And tomorrow?"}
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}}
    });
    assert_eq!(Value::Object(t.body), expected);
    assert!(t.fixes.is_empty(), "{:?}", t.fixes);
}

#[test]
fn through_messages_and_back_the_chat_request_keeps_every_supported_field() {
    let mut req = rich_request();
    // Messages has no developer role and no image detail: the round trip reports those.
    req["input"][0]["role"] = json!("system");
    req["input"][1]["content"][1]
        .as_object_mut()
        .unwrap()
        .remove("detail");
    let chat = responses_to_chat(&obj(req)).unwrap().body;
    let messages = chat_to_messages(&chat, 1024).unwrap();
    let back = messages_to_chat(&messages.body).unwrap().body;
    for key in [
        "model",
        "temperature",
        "top_p",
        "max_tokens",
        "tools",
        "tool_choice",
        "user",
        "parallel_tool_calls",
        "stream",
    ] {
        assert_eq!(back.get(key), chat.get(key), "{key}");
    }
    // Both system prompts arrive, as system messages; the rest turn by turn.
    let turns = |m: &Map<String, Value>| -> Vec<Value> {
        m["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] != "system")
            .cloned()
            .collect()
    };
    assert_eq!(turns(&back), turns(&chat));
}

#[test]
fn structured_output_reasoning_and_dropped_fields() {
    let t = responses_to_chat(&obj(json!({
        "model": "m", "input": "Give me a city.",
        "text": {"format": {"type": "json_schema", "name": "city", "strict": true,
            "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
        "reasoning": {"effort": "low", "summary": "auto"},
        "max_output_tokens": 50,
        "store": true, "include": ["reasoning.encrypted_content"], "truncation": "auto",
        "something_new": 1
    })))
    .unwrap();
    assert_eq!(
        t.body["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "city", "strict": true,
            "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}})
    );
    assert_eq!(t.body["reasoning_effort"], "low");
    assert_eq!(t.body["max_completion_tokens"], 50);
    assert!(!t.body.contains_key("max_tokens"));
    assert_eq!(
        t.fixes,
        [
            "reasoning_summary_dropped",
            "include_dropped",
            "truncation_dropped",
            "store_dropped",
            "something_new_dropped"
        ]
    );
    let ctx_resp = chat_completion_to_response(&json!({}), &t.context, &ids());
    assert_eq!(ctx_resp["text"]["format"]["name"], "city");
    assert_eq!(ctx_resp["store"], false);
}

#[test]
fn what_needs_stored_state_or_hosted_tools_is_refused_naming_the_field() {
    let cases = [
        (
            json!({"model": "m", "input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (
            json!({"model": "m", "input": "x", "background": true}),
            "background",
        ),
        (
            json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}),
            "input[0]",
        ),
        (
            json!({"model": "m", "input": [{"type": "computer_call", "id": "c"}]}),
            "input[0]",
        ),
        (
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}),
            "input[0].content[0].file_id",
        ),
        (
            json!({"model": "m", "input": [{"role": "tool", "content": "x"}]}),
            "input[0].role",
        ),
        (json!({"model": "m"}), "input"),
        (json!({"model": "m", "input": []}), "input"),
        (json!({"model": "m", "input": 3}), "input"),
        (
            json!({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}),
            "text.format.schema",
        ),
        (
            json!({"model": "m", "input": "x", "tool_choice": {"type": "mcp"}}),
            "tool_choice",
        ),
        (
            json!({"model": "m", "instructions": "only this", "input": [{"type": "reasoning", "id": "rs", "summary": []}]}),
            "input",
        ),
    ];
    for (body, field) in cases {
        let e = responses_to_chat(&obj(body.clone())).unwrap_err();
        assert!(e.message.contains(field), "{body}: {}", e.message);
    }
}

fn chat_completion() -> Value {
    json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "up",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant",
            "reasoning_content": "Two cities.", "content": "Checking.",
            "tool_calls": [
                {"id": "call_A", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
                {"id": "call_B", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Bergen\"}"}}]}}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 25, "total_tokens": 125,
            "prompt_tokens_details": {"cached_tokens": 90}, "completion_tokens_details": {"reasoning_tokens": 4}}})
}

#[test]
fn a_whole_completion_becomes_a_response_with_items_in_order() {
    let r = chat_completion_to_response(&chat_completion(), &ResponsesContext::default(), &ids());
    assert_eq!(r["id"], "resp_abc");
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["model"], "public");
    assert_eq!(
        r["output"],
        json!([
            {"type": "reasoning", "id": "rs_abc_0", "status": "completed", "summary": [], "content": [{"type": "reasoning_text", "text": "Two cities."}]},
            {"type": "message", "id": "msg_abc_1", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "id": "fc_abc_2", "status": "completed", "call_id": "call_A", "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
            {"type": "function_call", "id": "fc_abc_3", "status": "completed", "call_id": "call_B", "name": "weather", "arguments": "{\"city\":\"Bergen\"}"}
        ])
    );
    assert_eq!(
        r["usage"],
        json!({"input_tokens": 100, "input_tokens_details": {"cached_tokens": 90},
            "output_tokens": 25, "output_tokens_details": {"reasoning_tokens": 4}, "total_tokens": 125})
    );
    let mut cut = chat_completion();
    cut["choices"][0]["finish_reason"] = json!("length");
    let r = chat_completion_to_response(&cut, &ResponsesContext::default(), &ids());
    assert_eq!(r["status"], "incomplete");
    assert_eq!(
        r["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
}

fn chunk(delta: Value, finish: Value) -> SseEvent {
    SseEvent::new(
        None,
        &json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "up",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        .to_string(),
    )
}

fn usage_chunk() -> SseEvent {
    SseEvent::new(
        None,
        &json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "up", "choices": [],
            "usage": {"prompt_tokens": 100, "completion_tokens": 25, "total_tokens": 125,
                "prompt_tokens_details": {"cached_tokens": 90}, "completion_tokens_details": {"reasoning_tokens": 4}}})
        .to_string(),
    )
}

fn translate(events: &[SseEvent]) -> Vec<SseEvent> {
    let mut s = ChatToResponsesStream::new(ResponsesContext::default(), ids());
    let mut out = Vec::new();
    for e in events {
        s.push(e, &mut out).unwrap();
    }
    assert!(s.is_done());
    out
}

/// Replays a Responses stream the way the SDKs accumulate it (items added, parts added, deltas
/// appended), checking every `.done` event against what the deltas built and that sequence
/// numbers count up from 0. Returns the accumulated output and the final response.
fn replay(events: &[SseEvent]) -> (Vec<Value>, Value) {
    let mut output: Vec<Value> = Vec::new();
    let mut last = None;
    for (n, e) in events.iter().enumerate() {
        let v: Value = serde_json::from_str(&e.data).unwrap();
        let kind = v["type"].as_str().unwrap();
        assert_eq!(e.event.as_deref(), Some(kind));
        assert_eq!(v["sequence_number"], n, "{kind}");
        let i = v["output_index"].as_u64().unwrap_or(0) as usize;
        let c = v["content_index"].as_u64().unwrap_or(0) as usize;
        let delta = v["delta"].as_str().unwrap_or("");
        match kind {
            "response.output_item.added" => {
                assert_eq!(i, output.len());
                output.push(v["item"].clone());
            }
            "response.content_part.added" => output[i]["content"]
                .as_array_mut()
                .unwrap()
                .push(v["part"].clone()),
            "response.output_text.delta" => append(&mut output[i]["content"][c]["text"], delta),
            "response.refusal.delta" => append(&mut output[i]["content"][c]["refusal"], delta),
            "response.reasoning_text.delta" => append(&mut output[i]["content"][c]["text"], delta),
            "response.function_call_arguments.delta" => append(&mut output[i]["arguments"], delta),
            "response.output_text.done" | "response.reasoning_text.done" => {
                assert_eq!(output[i]["content"][c]["text"], v["text"])
            }
            "response.function_call_arguments.done" => {
                assert_eq!(output[i]["arguments"], v["arguments"])
            }
            "response.content_part.done" => assert_eq!(output[i]["content"][c], v["part"]),
            "response.output_item.done" => {
                output[i]["status"] = v["item"]["status"].clone();
                assert_eq!(output[i], v["item"]);
            }
            "response.completed" | "response.incomplete" => last = Some(v["response"].clone()),
            "response.created" | "response.in_progress" => {
                assert_eq!(v["response"]["status"], "in_progress")
            }
            other => panic!("unexpected event {other}"),
        }
    }
    (output, last.expect("a final response event"))
}

fn append(slot: &mut Value, delta: &str) {
    let s = slot.as_str().unwrap_or("").to_owned() + delta;
    *slot = Value::String(s);
}

#[test]
fn a_streamed_completion_with_reasoning_text_and_parallel_tool_calls() {
    let events = vec![
        chunk(
            json!({"role": "assistant", "reasoning_content": "Two "}),
            Value::Null,
        ),
        chunk(json!({"reasoning_content": "cities."}), Value::Null),
        chunk(json!({"content": "Check"}), Value::Null),
        chunk(json!({"content": "ing."}), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_A", "type": "function", "function": {"name": "weather", "arguments": ""}}]}),
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
        chunk(
            json!({"tool_calls": [{"index": 1, "id": "call_B", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Bergen\"}"}}]}),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
        usage_chunk(),
        SseEvent::new(None, "[DONE]"),
    ];
    let out = translate(&events);
    let (output, last) = replay(&out);
    let whole =
        chat_completion_to_response(&chat_completion(), &ResponsesContext::default(), &ids());
    assert_eq!(
        last, whole,
        "the stream's final response is the whole translation"
    );
    assert_eq!(Value::Array(output), whole["output"]);
    assert_eq!(out[0].event.as_deref(), Some("response.created"));
    assert_eq!(
        out.last().unwrap().event.as_deref(),
        Some("response.completed")
    );
}

#[test]
fn an_error_event_carries_an_error_object_and_ends_the_stream() {
    let events = vec![
        chunk(json!({"content": "Hel"}), Value::Null),
        SseEvent::new(None, &json!({"error": {"message": "upstream died", "type": "server_error", "code": null, "param": null}}).to_string()),
        chunk(json!({"content": "lo"}), Value::Null),
    ];
    let out = translate(&events);
    let last: Value = serde_json::from_str(&out.last().unwrap().data).unwrap();
    assert_eq!(out.last().unwrap().event.as_deref(), Some("error"));
    assert_eq!(last["type"], "error");
    assert_eq!(last["code"], "server_error");
    assert_eq!(last["message"], "upstream died");
    assert_eq!(last["error"]["message"], "upstream died");
    assert!(
        !out.iter().any(|e| e.data.contains("\"lo\"")),
        "nothing after the error"
    );
}

#[test]
fn a_cut_stream_is_incomplete_and_comments_pass_through() {
    let events = vec![
        SseEvent {
            event: None,
            data: String::new(),
            comment_only: true,
            raw: b": ping\n\n".to_vec(),
        },
        chunk(json!({"content": "Hi"}), Value::Null),
        chunk(json!({}), json!("length")),
        SseEvent::new(None, "[DONE]"),
    ];
    let out = translate(&events);
    assert!(out[0].comment_only);
    let (_, last) = replay(&out[1..]);
    assert_eq!(last["status"], "incomplete");
    assert_eq!(last["output"][0]["content"][0]["text"], "Hi");
    assert_eq!(
        out.last().unwrap().event.as_deref(),
        Some("response.incomplete")
    );
}

#[test]
fn hostile_tool_indexes_and_bad_json_are_errors_not_panics() {
    let mut s = ChatToResponsesStream::new(ResponsesContext::default(), ids());
    let mut out = Vec::new();
    let huge = chunk(
        json!({"tool_calls": [{"index": 1_000_000, "id": "x", "function": {"name": "f"}}]}),
        Value::Null,
    );
    assert!(s.push(&huge, &mut out).is_err());
    assert!(s.push(&SseEvent::new(None, "{not json"), &mut out).is_err());
}

proptest! {
    /// Any text and any tool calls, split anyhow: the stream replays to the same output as the
    /// whole translation of the assembled completion, and its final response equals it.
    #[test]
    fn streams_split_anyhow_replay_to_the_whole_translation(
        text in "\\PC{0,30}",
        cuts in proptest::collection::vec(0usize..64, 0..6),
        args in proptest::collection::vec("[a-z0-9\":{} ]{0,12}", 0..3),
        arg_cuts in proptest::collection::vec(0usize..16, 0..4),
        finish in prop::sample::select(vec!["stop", "length", "tool_calls"]),
    ) {
        let mut events: Vec<SseEvent> = split_at(&text, &cuts)
            .into_iter()
            .filter(|p| !p.is_empty())
            .map(|p| chunk(json!({"content": p}), Value::Null))
            .collect();
        for (k, a) in args.iter().enumerate() {
            events.push(chunk(json!({"tool_calls": [{"index": k, "id": format!("call_{k}"), "type": "function", "function": {"name": "f", "arguments": ""}}]}), Value::Null));
            for piece in split_at(a, &arg_cuts).into_iter().filter(|p| !p.is_empty()) {
                events.push(chunk(json!({"tool_calls": [{"index": k, "function": {"arguments": piece}}]}), Value::Null));
            }
        }
        events.push(chunk(json!({}), json!(finish)));
        events.push(usage_chunk());
        events.push(SseEvent::new(None, "[DONE]"));

        let mut a = Assembler::new();
        for e in &events {
            a.push(Protocol::OpenAi, e).unwrap();
        }
        let whole = chat_completion_to_response(&a.finish(Endpoint::ChatCompletions).to_value(), &ResponsesContext::default(), &ids());
        let out = translate(&events);
        let (output, last) = replay(&out);
        prop_assert_eq!(&last, &whole);
        prop_assert_eq!(&Value::Array(output), &whole["output"]);
    }
}
