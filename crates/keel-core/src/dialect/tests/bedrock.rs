//! Bedrock Converse: requests, whole answers, event streams and errors, with fixtures written
//! from the Converse API reference.

use serde_json::{json, Map, Value};

use super::*;
use crate::protocol::{event_role, EventRole};
use crate::sse::{SseDecoder, SseEvent};
use crate::translate::{
    chat_to_messages, message_to_chat_completion, AnthropicToChatStream, ResponseContext,
};

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().cloned().expect("an object")
}

fn converse(hub: Value) -> (Value, Vec<String>) {
    let r = request(&obj(hub)).expect("maps");
    (serde_json::from_slice(&r.body).expect("JSON"), r.fixes)
}

// ---------------------------------------------------------------------------------------------
// Requests.

#[test]
fn a_full_request_maps_every_part() {
    let png = "iVBORw0KGgo=";
    let (body, fixes) = converse(json!({
        "model": "anthropic.claude-sonnet-4-20250514-v1:0",
        "stream": true,
        "max_tokens": 2048,
        "temperature": 0.4,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["\n\nHuman:"],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "u-1"},
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture, and the weather in Oslo?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need the weather.", "signature": "EqQBCkYIBxgC"},
                {"type": "text", "text": "A cat. Checking the weather."},
                {"type": "tool_use", "id": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q", "name": "get_weather", "input": {"city": "Oslo"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q", "content": "4°C, rain"}
            ]},
            {"role": "assistant", "content": "It is"}
        ],
        "tools": [{"name": "get_weather", "description": "Weather for a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
        "tool_choice": {"type": "auto"}
    }));
    assert_eq!(
        body,
        json!({
            "system": [{"text": "You are terse."}, {"cachePoint": {"type": "default"}}],
            "messages": [
                {"role": "user", "content": [
                    {"text": "What is in this picture, and the weather in Oslo?"},
                    {"image": {"format": "png", "source": {"bytes": png}}}
                ]},
                {"role": "assistant", "content": [
                    {"reasoningContent": {"reasoningText": {"text": "Need the weather.", "signature": "EqQBCkYIBxgC"}}},
                    {"text": "A cat. Checking the weather."},
                    {"toolUse": {"toolUseId": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q", "name": "get_weather", "input": {"city": "Oslo"}}}
                ]},
                {"role": "user", "content": [
                    {"toolResult": {"toolUseId": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q", "content": [{"text": "4°C, rain"}], "status": "success"}}
                ]},
                {"role": "assistant", "content": [{"text": "It is"}]}
            ],
            "inferenceConfig": {"maxTokens": 2048, "temperature": 0.4, "topP": 0.9, "stopSequences": ["\n\nHuman:"]},
            "toolConfig": {"tools": [{"toolSpec": {"name": "get_weather", "description": "Weather for a city.",
                "inputSchema": {"json": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}}]},
            "additionalModelRequestFields": {"top_k": 40, "thinking": {"type": "enabled", "budget_tokens": 1024}}
        })
    );
    assert_eq!(fixes, vec!["metadata_dropped"]);
}

#[test]
fn tool_choices_map_to_converse_choices() {
    let tools = json!([{"name": "answer", "input_schema": {"type": "object"}}]);
    for (choice, expected) in [
        (json!({"type": "any"}), Some(json!({"any": {}}))),
        (
            json!({"type": "tool", "name": "answer"}),
            Some(json!({"tool": {"name": "answer"}})),
        ),
        (json!({"type": "auto"}), None),
    ] {
        let (body, _) = converse(
            json!({"model": "anthropic.claude-3-5-haiku", "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice}),
        );
        assert_eq!(body.pointer("/toolConfig/toolChoice"), expected.as_ref());
    }
    let (_, fixes) = converse(
        json!({"model": "anthropic.claude-3-5-haiku", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}], "tools": tools,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true}}),
    );
    assert_eq!(fixes, vec!["disable_parallel_tool_use_dropped"]);
}

#[test]
fn cached_tools_get_a_cache_point_after_them() {
    let (body, fixes) = converse(json!({"model": "anthropic.claude", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "a", "input_schema": {"type": "object"}, "strict": true},
            {"name": "b", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]}));
    assert_eq!(
        body["toolConfig"]["tools"],
        json!([
            {"toolSpec": {"name": "a", "inputSchema": {"json": {"type": "object"}}}},
            {"toolSpec": {"name": "b", "inputSchema": {"json": {"type": "object"}}}},
            {"cachePoint": {"type": "default"}}
        ])
    );
    assert_eq!(fixes, vec!["strict_dropped"]);
}

#[test]
fn tool_choice_none_drops_tools_unless_the_history_needs_them() {
    let tools = json!([{"name": "get_weather", "input_schema": {"type": "object"}}]);
    let (body, fixes) = converse(json!({"model": "anthropic.claude", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": {"type": "none"}}));
    assert!(body.get("toolConfig").is_none());
    assert_eq!(fixes, vec!["tool_choice_none_without_tools"]);

    let history = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}
    ]);
    let (body, fixes) = converse(json!({"model": "anthropic.claude", "max_tokens": 10,
        "messages": history, "tools": tools, "tool_choice": {"type": "none"}}));
    assert_eq!(
        body["toolConfig"],
        json!({"tools": [{"toolSpec": {"name": "get_weather", "inputSchema": {"json": {"type": "object"}}}}]})
    );
    assert_eq!(fixes, vec!["tool_choice_none_as_auto"]);

    // No tools at all, but tool blocks in the history: specs from the names used.
    let (body, fixes) =
        converse(json!({"model": "anthropic.claude", "max_tokens": 10, "messages": history}));
    assert_eq!(
        body["toolConfig"],
        json!({"tools": [{"toolSpec": {"name": "get_weather", "inputSchema": {"json": {"type": "object"}}}}]})
    );
    assert_eq!(fixes, vec!["tool_config_from_history"]);
}

#[test]
fn tool_results_carry_blocks_and_error_status() {
    let (body, _) = converse(
        json!({"model": "anthropic.claude", "max_tokens": 10, "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": true,
                "content": [{"type": "text", "text": "boom"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/"}}]},
                {"type": "document", "title": "Q3 report: final!", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}}]}
        ]}),
    );
    assert_eq!(
        body["messages"][1]["content"],
        json!([
            {"toolResult": {"toolUseId": "t1", "status": "error", "content": [
                {"text": "boom"}, {"image": {"format": "jpeg", "source": {"bytes": "/9j/"}}}]}},
            {"document": {"format": "pdf", "name": "Q3 report final", "source": {"bytes": "JVBERi0="}}},
            {"document": {"format": "txt", "name": "document messages[1] content[2]", "source": {"bytes": "aGk="}}}
        ])
    );
}

#[test]
fn consecutive_turns_are_merged_and_a_prefill_is_kept_last() {
    let (body, fixes) = converse(
        json!({"model": "anthropic.claude", "max_tokens": 10, "messages": [
            {"role": "user", "content": "one"},
            {"role": "user", "content": [{"type": "text", "text": "two", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
            {"role": "assistant", "content": "The answer is"}
        ]}),
    );
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": [{"text": "one"}, {"text": "two"}, {"cachePoint": {"type": "default", "ttl": "1h"}}]},
            {"role": "assistant", "content": [{"text": "The answer is"}]}
        ])
    );
    assert_eq!(fixes, vec!["turns_merged"]);
}

#[test]
fn model_fields_follow_the_model_family() {
    let hub = |model: &str| {
        json!({"model": model, "max_tokens": 10, "top_k": 5,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "hi"}]})
    };
    let (body, fixes) = converse(hub("us.amazon.nova-pro-v1:0"));
    assert_eq!(
        body["additionalModelRequestFields"],
        json!({"inferenceConfig": {"topK": 5}})
    );
    assert_eq!(fixes, vec!["thinking_dropped"]);
    let (body, fixes) = converse(hub("meta.llama3-70b-instruct-v1:0"));
    assert!(body.get("additionalModelRequestFields").is_none());
    assert_eq!(fixes, vec!["top_k_dropped", "thinking_dropped"]);
    // The model and the stream choice go in the URL.
    assert!(body.get("model").is_none() && body.get("stream").is_none());
}

#[test]
fn unsigned_thinking_is_dropped() {
    let (body, fixes) = converse(
        json!({"model": "anthropic.claude", "max_tokens": 10, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "Hello"},
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy3"}]},
            {"role": "user", "content": "again"}
        ]}),
    );
    assert_eq!(
        body["messages"][1]["content"],
        json!([{"text": "Hello"}, {"reasoningContent": {"redactedContent": "EmwKAhgBEgy3"}}])
    );
    assert_eq!(fixes, vec!["thinking_dropped"]);
}

#[test]
fn what_converse_cannot_express_is_refused_by_name() {
    let cases = [
        (
            json!({"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}]}),
            "messages[0].content[0].source: a `url` image source (only base64) is not supported by Bedrock variants",
        ),
        (
            json!({"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": "Qk0="}}]}),
            "messages[0].content[0].source.media_type: image type `image/bmp` is not supported by Bedrock variants",
        ),
        (
            json!({"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]}),
            "messages[0].content[0].type: a `server_tool_use` block is not supported by Bedrock variants",
        ),
    ];
    for (message, expected) in cases {
        let err = request(&obj(
            json!({"model": "anthropic.claude", "max_tokens": 10, "messages": [message]}),
        ))
        .expect_err("refused");
        assert_eq!(err.message, expected);
    }
    let err = request(&obj(json!({"model": "anthropic.claude", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}]})))
    .expect_err("refused");
    assert_eq!(
        err.message,
        "tools[0].type: the server tool `web_search_20250305` is not supported by Bedrock variants"
    );
}

#[test]
fn an_openai_client_request_reaches_converse() {
    let chat = obj(json!({
        "model": "anthropic.claude-3-5-sonnet-20240620-v1:0",
        "messages": [
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4°C"},
            {"role": "user", "content": "Summarize."}
        ],
        "response_format": {"type": "json_schema", "json_schema": {"name": "summary",
            "schema": {"type": "object", "properties": {"text": {"type": "string"}}}}},
        "max_tokens": 300, "stop": "END"
    }));
    let hub = chat_to_messages(&chat, 4096).expect("translates");
    let json_tool = hub.context.json_tool.clone().expect("a json tool");
    let r = request(&hub.body).expect("maps");
    let body: Value = serde_json::from_slice(&r.body).expect("JSON");
    assert_eq!(body["system"], json!([{"text": "Answer in JSON."}]));
    assert_eq!(
        body.pointer("/toolConfig/toolChoice"),
        Some(&json!({"tool": {"name": json_tool}}))
    );
    let names: Vec<&str> = body["toolConfig"]["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t.pointer("/toolSpec/name").and_then(Value::as_str))
        .collect();
    assert_eq!(names, vec![json_tool.as_str()]);
    assert_eq!(
        body["messages"][1]["content"][0]["toolUse"],
        json!({"toolUseId": "call_1", "name": "get_weather", "input": {"city": "Oslo"}})
    );
    assert_eq!(
        body["messages"][2]["content"][0]["toolResult"]["toolUseId"],
        "call_1"
    );
    assert_eq!(
        body["inferenceConfig"],
        json!({"maxTokens": 300, "stopSequences": ["END"]})
    );
}

// ---------------------------------------------------------------------------------------------
// Whole answers.

fn whole_value(body: Value) -> Value {
    let out = whole(body.to_string().as_bytes(), "claude-public").expect("maps");
    serde_json::from_slice(&out).expect("JSON")
}

#[test]
fn a_whole_answer_becomes_a_message() {
    let answer = json!({
        "output": {"message": {"role": "assistant", "content": [
            {"reasoningContent": {"reasoningText": {"text": "User wants weather.", "signature": "EqQB"}}},
            {"text": "Let me check."},
            {"toolUse": {"toolUseId": "tooluse_abc", "name": "get_weather", "input": {"city": "Oslo"}}}
        ]}},
        "stopReason": "tool_use",
        "usage": {"inputTokens": 30, "outputTokens": 12, "totalTokens": 142, "cacheReadInputTokens": 100, "cacheWriteInputTokens": 0},
        "metrics": {"latencyMs": 812}
    });
    let msg = whole_value(answer.clone());
    let id = msg["id"].as_str().expect("an id").to_owned();
    assert!(id.starts_with("msg_bdrk_"));
    assert_eq!(
        msg,
        json!({
            "id": id, "type": "message", "role": "assistant", "model": "claude-public",
            "content": [
                {"type": "thinking", "thinking": "User wants weather.", "signature": "EqQB"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "tooluse_abc", "name": "get_weather", "input": {"city": "Oslo"}}
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 30, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100, "output_tokens": 12}
        })
    );
    // Pure: the same answer, the same id; another answer, another id.
    assert_eq!(whole_value(answer.clone())["id"], json!(id));
    let mut other = answer;
    other["metrics"]["latencyMs"] = json!(813);
    assert_ne!(whole_value(other)["id"], json!(id));

    let chat = message_to_chat_completion(&msg, &ResponseContext::default(), "m", 1).expect("chat");
    assert_eq!(chat["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(chat["usage"]["prompt_tokens"], 130);
    assert_eq!(chat["usage"]["prompt_tokens_details"]["cached_tokens"], 100);
}

#[test]
fn safety_stops_are_refusals_and_stop_sequences_are_kept() {
    for reason in ["guardrail_intervened", "content_filtered"] {
        let msg = whole_value(
            json!({"output": {"message": {"role": "assistant", "content": [{"text": "I can't"}]}},
            "stopReason": reason, "usage": {"inputTokens": 5, "outputTokens": 2, "totalTokens": 7}}),
        );
        assert_eq!(msg["stop_reason"], "refusal");
        let chat =
            message_to_chat_completion(&msg, &ResponseContext::default(), "m", 1).expect("chat");
        assert_eq!(chat["choices"][0]["finish_reason"], "content_filter");
    }
    let msg = whole_value(
        json!({"output": {"message": {"role": "assistant", "content": [{"text": "1 2 3"}]}},
        "stopReason": "stop_sequence", "additionalModelResponseFields": {"stop_sequence": "4"},
        "usage": {"inputTokens": 5, "outputTokens": 2, "totalTokens": 7}}),
    );
    assert_eq!(
        (&msg["stop_reason"], &msg["stop_sequence"]),
        (&json!("stop_sequence"), &json!("4"))
    );
    assert!(whole(b"{\"message\": \"no\"}", "m").is_err());
}

// ---------------------------------------------------------------------------------------------
// Streams.

/// A Converse stream as Bedrock writes it: reasoning, text (no contentBlockStart), a tool use,
/// messageStop, then metadata.
fn converse_frames() -> Vec<Vec<u8>> {
    vec![
        encode_frame(
            "messageStart",
            &json!({"role": "assistant", "p": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQR"}),
        ),
        encode_frame(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": "Weather "}}, "p": "abcd"}),
        ),
        encode_frame(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": "needed."}}, "p": "ab"}),
        ),
        encode_frame(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0, "delta": {"reasoningContent": {"signature": "EqQB"}}, "p": "abc"}),
        ),
        encode_frame(
            "contentBlockStop",
            &json!({"contentBlockIndex": 0, "p": "abcdefg"}),
        ),
        encode_frame(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 1, "delta": {"text": "Let me"}, "p": "a"}),
        ),
        encode_frame(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 1, "delta": {"text": " check."}, "p": "ab"}),
        ),
        encode_frame(
            "contentBlockStop",
            &json!({"contentBlockIndex": 1, "p": "abcdefgh"}),
        ),
        encode_frame(
            "contentBlockStart",
            &json!({"contentBlockIndex": 2,
            "start": {"toolUse": {"toolUseId": "tooluse_abc", "name": "get_weather"}}, "p": "abcdef"}),
        ),
        encode_frame(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 2, "delta": {"toolUse": {"input": "{\"city\": "}}, "p": "abc"}),
        ),
        encode_frame(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 2, "delta": {"toolUse": {"input": "\"Oslo\"}"}}, "p": "abcd"}),
        ),
        encode_frame(
            "contentBlockStop",
            &json!({"contentBlockIndex": 2, "p": "abcdefghij"}),
        ),
        encode_frame(
            "messageStop",
            &json!({"stopReason": "tool_use", "p": "abcdefghijklm"}),
        ),
        encode_frame(
            "metadata",
            &json!({"usage": {"inputTokens": 30, "outputTokens": 12, "totalTokens": 142,
            "cacheReadInputTokens": 100, "cacheWriteInputTokens": 0}, "metrics": {"latencyMs": 812}, "p": "abc"}),
        ),
    ]
}

fn hub_text(chunks: &[&[u8]], end: bool) -> Result<String, String> {
    let mut s = Stream::new("claude-public");
    let mut out = Vec::new();
    for c in chunks {
        s.feed(c, &mut out)?;
    }
    if end {
        s.end(&mut out)?;
    }
    Ok(String::from_utf8(out).expect("UTF-8"))
}

fn events(text: &str) -> Vec<SseEvent> {
    let mut d = SseDecoder::new();
    let mut evs = Vec::new();
    d.feed(text.as_bytes(), &mut evs).expect("SSE");
    d.finish().expect("whole events");
    evs
}

fn names(evs: &[SseEvent]) -> Vec<String> {
    evs.iter()
        .map(|e| e.event.clone().unwrap_or_default())
        .collect()
}

#[test]
fn a_stream_becomes_anthropic_events() {
    let bytes = converse_frames().concat();
    let text = hub_text(&[&bytes], true).expect("decodes");
    let evs = events(&text);
    assert_eq!(
        names(&evs),
        vec![
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let data = |i: usize| -> Value { serde_json::from_str(&evs[i].data).expect("JSON") };
    assert_eq!(data(0)["message"]["model"], "claude-public");
    assert!(data(0)["message"]["id"]
        .as_str()
        .expect("id")
        .starts_with("msg_bdrk_"));
    assert_eq!(
        data(1),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
    );
    assert_eq!(
        data(4),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "EqQB"}})
    );
    assert_eq!(
        data(6),
        json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}})
    );
    assert_eq!(
        data(7),
        json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Let me"}})
    );
    assert_eq!(
        data(10),
        json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "tooluse_abc", "name": "get_weather", "input": {}}})
    );
    assert_eq!(
        data(11),
        json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"city\": "}})
    );
    assert_eq!(
        data(14),
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
            "usage": {"input_tokens": 30, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100, "output_tokens": 12}})
    );
    // The gateway's reader sees a proper Anthropic stream.
    let roles: Vec<EventRole> = evs
        .iter()
        .map(|e| event_role(Protocol::Anthropic, e))
        .collect();
    assert!(roles
        .iter()
        .all(|r| !matches!(r, EventRole::Malformed(_) | EventRole::Error(_))));
    assert_eq!(roles.last(), Some(&EventRole::Terminal));
}

#[test]
fn every_split_of_the_bytes_gives_the_same_events() {
    let bytes = converse_frames().concat();
    let whole_text = hub_text(&[&bytes], true).expect("decodes");
    for cut in 0..=bytes.len() {
        let (a, b) = bytes.split_at(cut);
        assert_eq!(
            hub_text(&[a, b], true).expect("decodes"),
            whole_text,
            "cut at {cut}"
        );
    }
    let bytewise: Vec<&[u8]> = bytes.chunks(1).collect();
    assert_eq!(hub_text(&bytewise, true).expect("decodes"), whole_text);
}

#[test]
fn the_hub_events_translate_to_openai_chunks() {
    let bytes = converse_frames().concat();
    let evs = events(&hub_text(&[&bytes], true).expect("decodes"));
    let ctx = ResponseContext {
        json_tool: None,
        include_usage: true,
    };
    let mut t = AnthropicToChatStream::new(ctx, "m", 7);
    let mut out = Vec::new();
    for e in &evs {
        t.push(e, &mut out).expect("translates");
    }
    assert!(t.is_done());
    let chunks: Vec<Value> = out
        .iter()
        .filter(|e| e.data != "[DONE]")
        .map(|e| serde_json::from_str(&e.data).expect("JSON"))
        .collect();
    let content: String = chunks
        .iter()
        .filter_map(|c| {
            c.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(content, "Let me check.");
    let reasoning: String = chunks
        .iter()
        .filter_map(|c| {
            c.pointer("/choices/0/delta/reasoning_content")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(reasoning, "Weather needed.");
    let args: String = chunks
        .iter()
        .filter_map(|c| {
            c.pointer("/choices/0/delta/tool_calls/0/function/arguments")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(args, "{\"city\": \"Oslo\"}");
    let finish: Vec<&str> = chunks
        .iter()
        .filter_map(|c| {
            c.pointer("/choices/0/finish_reason")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(finish, vec!["tool_calls"]);
    let usage = chunks.last().and_then(|c| c.get("usage")).expect("usage");
    assert_eq!(usage["prompt_tokens"], 130);
    assert_eq!(out.last().map(|e| e.data.as_str()), Some("[DONE]"));
}

#[test]
fn a_stream_assembles_into_the_same_message_as_the_whole_answer() {
    let bytes = converse_frames().concat();
    let mut a = crate::assemble::Assembler::new();
    for e in events(&hub_text(&[&bytes], true).expect("decodes")) {
        a.push(Protocol::Anthropic, &e).expect("assembles");
    }
    let mut streamed = a.finish(crate::protocol::Endpoint::Messages).to_value();
    let mut whole = whole_value(json!({
        "output": {"message": {"role": "assistant", "content": [
            {"reasoningContent": {"reasoningText": {"text": "Weather needed.", "signature": "EqQB"}}},
            {"text": "Let me check."},
            {"toolUse": {"toolUseId": "tooluse_abc", "name": "get_weather", "input": {"city": "Oslo"}}}
        ]}},
        "stopReason": "tool_use",
        "usage": {"inputTokens": 30, "outputTokens": 12, "totalTokens": 142, "cacheReadInputTokens": 100, "cacheWriteInputTokens": 0},
        "metrics": {"latencyMs": 812}
    }));
    for m in [&mut streamed, &mut whole] {
        m.as_object_mut().expect("a message").remove("id");
        m["model"] = json!("claude-public");
        // The assembler keeps a thinking block's start, not its deltas (as for any Anthropic
        // upstream): compare the rest.
        m["content"][0] = json!({"type": "thinking"});
    }
    assert_eq!(streamed, whole);
}

#[test]
fn a_stream_cut_before_message_stop_has_no_message_stop() {
    let frames = converse_frames();
    let cut = frames[..7].concat();
    let text = hub_text(&[&cut], true).expect("decodes");
    let evs = events(&text);
    assert!(!names(&evs)
        .iter()
        .any(|n| n == "message_stop" || n == "message_delta"));
    // Cut inside a frame: the same, the partial frame is left unread.
    let mut partial = cut.clone();
    partial.extend_from_slice(&frames[7][..5]);
    assert_eq!(hub_text(&[&partial], true).expect("decodes"), text);
}

#[test]
fn message_stop_without_metadata_ends_at_the_end_of_the_body() {
    let frames = converse_frames();
    let body = frames[..13].concat();
    let before_end = events(&hub_text(&[&body], false).expect("decodes"));
    assert!(!names(&before_end).iter().any(|n| n == "message_stop"));
    let evs = events(&hub_text(&[&body], true).expect("decodes"));
    let n = names(&evs);
    assert_eq!(&n[n.len() - 2..], ["message_delta", "message_stop"]);
    let delta: Value = serde_json::from_str(&evs[evs.len() - 2].data).expect("JSON");
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert_eq!(delta["usage"]["output_tokens"], 0);
}

#[test]
fn a_guardrail_stop_in_a_stream_is_a_refusal() {
    let body = [
        encode_frame("messageStart", &json!({"role": "assistant"})),
        encode_frame("contentBlockDelta", &json!({"contentBlockIndex": 0, "delta": {"text": "Sorry."}})),
        encode_frame("contentBlockStop", &json!({"contentBlockIndex": 0})),
        encode_frame("messageStop", &json!({"stopReason": "guardrail_intervened"})),
        encode_frame("metadata", &json!({"usage": {"inputTokens": 3, "outputTokens": 1, "totalTokens": 4}, "metrics": {"latencyMs": 5}})),
    ]
    .concat();
    let evs = events(&hub_text(&[&body], true).expect("decodes"));
    let delta: Value = serde_json::from_str(&evs[evs.len() - 2].data).expect("JSON");
    assert_eq!(delta["delta"]["stop_reason"], "refusal");
}

#[test]
fn exceptions_in_a_stream_become_error_events() {
    for (exception, kind) in [
        ("throttlingException", "rate_limit_error"),
        ("serviceUnavailableException", "overloaded_error"),
        ("modelStreamErrorException", "api_error"),
        ("validationException", "invalid_request_error"),
        ("internalServerException", "api_error"),
    ] {
        let body = [
            encode_frame("messageStart", &json!({"role": "assistant"})),
            encode_frame(
                "contentBlockDelta",
                &json!({"contentBlockIndex": 0, "delta": {"text": "Hi"}}),
            ),
            encode_exception(exception, "Too many tokens, please wait."),
            encode_frame(
                "contentBlockDelta",
                &json!({"contentBlockIndex": 0, "delta": {"text": " there"}}),
            ),
        ]
        .concat();
        let evs = events(&hub_text(&[&body], true).expect("decodes"));
        let last = evs.last().expect("events");
        assert_eq!(last.event.as_deref(), Some("error"));
        assert_eq!(
            serde_json::from_str::<Value>(&last.data).expect("JSON"),
            json!({"type": "error", "error": {"type": kind,
                "message": format!("{exception}: Too many tokens, please wait.")}})
        );
        assert!(matches!(
            event_role(Protocol::Anthropic, last),
            EventRole::Error(_)
        ));
        assert_eq!(evs.len(), 4, "nothing after the error");
    }
}

#[test]
fn a_frame_with_a_bad_checksum_is_an_error() {
    let mut frame = encode_frame(
        "contentBlockDelta",
        &json!({"contentBlockIndex": 0, "delta": {"text": "Hi"}}),
    );
    // A payload byte: the message CRC no longer matches.
    let at = frame.len() - 8;
    frame[at] ^= 0x01;
    let mut s = Stream::new("m");
    let mut out = Vec::new();
    assert!(s.feed(&frame, &mut out).is_err());
    assert!(out.is_empty());
    // A prelude byte: the prelude CRC no longer matches.
    let mut frame = encode_frame("messageStart", &json!({"role": "assistant"}));
    frame[9] ^= 0x01;
    assert!(Stream::new("m").feed(&frame, &mut Vec::new()).is_err());
}

// ---------------------------------------------------------------------------------------------
// Errors.

#[test]
fn error_bodies_map_by_exception() {
    let cases = [
        (
            429,
            Some("ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/"),
            "rate_limit_error",
            429,
        ),
        (
            503,
            Some("ServiceUnavailableException"),
            "overloaded_error",
            503,
        ),
        (429, Some("ModelNotReadyException"), "overloaded_error", 503),
        (408, Some("ModelTimeoutException"), "timeout_error", 504),
        (
            400,
            Some("ValidationException"),
            "invalid_request_error",
            400,
        ),
        (403, Some("AccessDeniedException"), "permission_error", 403),
        (
            403,
            Some("UnrecognizedClientException"),
            "authentication_error",
            401,
        ),
        (
            403,
            Some("ExpiredTokenException"),
            "authentication_error",
            401,
        ),
        (
            404,
            Some("ResourceNotFoundException"),
            "not_found_error",
            404,
        ),
        (500, Some("InternalServerException"), "api_error", 500),
        (424, Some("ModelErrorException"), "api_error", 500),
    ];
    for (status, header, kind, _) in cases {
        let out = error(
            status,
            header,
            br#"{"message":"Too many requests, please wait before trying again."}"#,
        );
        let v: Value = serde_json::from_slice(&out).expect("JSON");
        let name = exception_name(header.expect("a header"));
        assert_eq!(
            v,
            json!({"type": "error", "error": {"type": kind,
                "message": format!("{name}: Too many requests, please wait before trying again.")}}),
            "{name}"
        );
    }
    // No header: the body's `__type`, then the status.
    let v: Value = serde_json::from_slice(&error(
        400,
        None,
        br#"{"__type":"com.amazon.coral.validate#ValidationException","message":"Malformed input request"}"#,
    ))
    .expect("JSON");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(
        v["error"]["message"],
        "ValidationException: Malformed input request"
    );
    let v: Value =
        serde_json::from_slice(&error(429, None, br#"{"Message":"slow down"}"#)).expect("JSON");
    assert_eq!(
        v["error"],
        json!({"type": "rate_limit_error", "message": "slow down"})
    );
    let v: Value = serde_json::from_slice(&error(502, None, b"Bad Gateway")).expect("JSON");
    assert_eq!(
        v["error"],
        json!({"type": "api_error", "message": "Bad Gateway"})
    );
}

#[test]
fn a_model_stream_error_is_classed_by_the_status_it_carries() {
    let payload = json!({"message": "Model is overloaded", "originalStatusCode": 529,
        "originalMessage": "{\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\"}}"});
    let frame = frame_bytes(
        &Message::new(serde_json::to_vec(&payload).expect("JSON"))
            .add_header(string_header(
                ":exception-type",
                "modelStreamErrorException",
            ))
            .add_header(string_header(":content-type", "application/json"))
            .add_header(string_header(":message-type", "exception")),
    );
    let evs = events(&hub_text(&[&frame], true).expect("decodes"));
    let v: Value = serde_json::from_str(&evs[0].data).expect("JSON");
    assert_eq!(
        v["error"],
        json!({"type": "overloaded_error", "message": "modelStreamErrorException: Model is overloaded"})
    );
}

#[test]
fn a_frame_claiming_a_huge_length_is_refused_before_it_arrives() {
    let mut prelude = (200u32 * 1024 * 1024).to_be_bytes().to_vec();
    prelude.extend_from_slice(&[0, 0, 0, 0]);
    let mut s = Stream::new("m");
    let mut out = Vec::new();
    // After a whole frame, and split inside the length.
    let start = encode_frame("messageStart", &json!({"role": "assistant"}));
    s.feed(&start, &mut out).expect("a good frame");
    s.feed(&prelude[..2], &mut out).expect("not yet a length");
    assert!(s.feed(&prelude[2..], &mut out).is_err());
}

#[test]
fn a_forced_json_tool_streams_to_an_openai_client_as_content() {
    let body = [
        encode_frame("messageStart", &json!({"role": "assistant"})),
        encode_frame("contentBlockStart", &json!({"contentBlockIndex": 0,
            "start": {"toolUse": {"toolUseId": "tooluse_1", "name": "summary"}}})),
        encode_frame("contentBlockDelta", &json!({"contentBlockIndex": 0, "delta": {"toolUse": {"input": "{\"text\":"}}})),
        encode_frame("contentBlockDelta", &json!({"contentBlockIndex": 0, "delta": {"toolUse": {"input": " \"ok\"}"}}})),
        encode_frame("contentBlockStop", &json!({"contentBlockIndex": 0})),
        encode_frame("messageStop", &json!({"stopReason": "tool_use"})),
        encode_frame("metadata", &json!({"usage": {"inputTokens": 9, "outputTokens": 4, "totalTokens": 13}, "metrics": {"latencyMs": 40}})),
    ]
    .concat();
    let ctx = ResponseContext {
        json_tool: Some("summary".into()),
        include_usage: false,
    };
    let mut t = AnthropicToChatStream::new(ctx, "m", 7);
    let mut out = Vec::new();
    for e in events(&hub_text(&[&body], true).expect("decodes")) {
        t.push(&e, &mut out).expect("translates");
    }
    let chunks: Vec<Value> = out
        .iter()
        .filter(|e| e.data != "[DONE]")
        .map(|e| serde_json::from_str(&e.data).expect("JSON"))
        .collect();
    let content: String = chunks
        .iter()
        .filter_map(|c| {
            c.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(content, "{\"text\": \"ok\"}");
    assert!(chunks
        .iter()
        .all(|c| c.pointer("/choices/0/delta/tool_calls").is_none()));
    let finish: Vec<&str> = chunks
        .iter()
        .filter_map(|c| {
            c.pointer("/choices/0/finish_reason")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(finish, vec!["stop"]);
}
