//! Requests: round trips, refusals and fix codes.

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;
use crate::protocol::ErrorKind;
use crate::synthesize::stream_from_whole;

fn rich_chat_request() -> Value {
    json!({
        "model": "pub",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Oslo and Bergen?"},
            {"role": "assistant", "content": "Checking both.", "tool_calls": [
                {"id": "toolu_01", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
                {"id": "call_02", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Bergen\"}"}}]},
            {"role": "tool", "tool_call_id": "toolu_01", "content": "4°C"},
            {"role": "tool", "tool_call_id": "call_02", "content": [{"type": "text", "text": "7°C"}]},
            {"role": "user", "content": [
                {"type": "text", "text": "And these?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
                {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0x", "filename": "a.pdf"}}]},
            {"role": "assistant", "content": "A chart and a report."},
            {"role": "user", "content": "Thanks."}
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": false,
        "stop": ["END", "STOP"],
        "temperature": 0.5,
        "top_p": 0.9,
        "max_tokens": 300,
        "stream": true,
        "stream_options": {"include_usage": true},
        "user": "u-42"
    })
}

#[test]
fn chat_to_messages_to_chat_preserves_every_supported_field() {
    let chat = rich_chat_request();
    let there = chat_to_messages(&obj(chat.clone()), 1024).unwrap();
    assert_eq!(there.fixes, Vec::<String>::new());
    assert!(there.context.include_usage);
    let m = &there.body;
    assert_eq!(m["system"], "You are terse.");
    assert_eq!(m["metadata"], json!({"user_id": "u-42"}));
    assert_eq!(m["stop_sequences"], json!(["END", "STOP"]));
    assert_eq!(
        m["tool_choice"],
        json!({"type": "tool", "name": "weather", "disable_parallel_tool_use": true})
    );
    assert_eq!(m["tools"][0]["input_schema"]["required"], json!(["city"]));
    // The two tool results are one user turn; the ids pass through as they came.
    let turns = m["messages"].as_array().unwrap();
    assert_eq!(turns.len(), 6);
    assert_eq!(turns[2]["content"][0]["tool_use_id"], "toolu_01");
    assert_eq!(turns[2]["content"][1]["tool_use_id"], "call_02");
    assert_eq!(turns[1]["content"][2]["input"], json!({"city": "Bergen"}));
    assert_eq!(
        turns[3]["content"][2]["source"],
        json!({"type": "base64", "media_type": "image/png", "data": "iVBORw0K"})
    );
    assert_eq!(turns[3]["content"][1]["source"]["type"], "url");
    assert_eq!(turns[3]["content"][3]["type"], "document");

    let back = messages_to_chat(&there.body).unwrap();
    assert_eq!(back.fixes, Vec::<String>::new());
    assert_eq!(Value::Object(back.body), chat);
}

#[test]
fn messages_to_chat_to_messages_preserves_every_supported_field() {
    let msgs = json!({
        "model": "pub",
        "system": [{"type": "text", "text": "Rule one."}, {"type": "text", "text": "Rule two."}],
        "messages": [
            {"role": "user", "content": "Look this up."},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Sure."},
                {"type": "tool_use", "id": "toolu_9", "name": "search", "input": {"q": "keel", "n": 3}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": "found"},
                {"type": "text", "text": "Summarise."}]}
        ],
        "tools": [{"name": "search", "description": "Search", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
        "thinking": {"type": "enabled", "budget_tokens": 4096},
        "max_tokens": 8000,
        "top_p": 0.97,
        "stop_sequences": ["###"],
        "stream": true,
        "metadata": {"user_id": "u-1"}
    });
    let chat = messages_to_chat(&obj(msgs.clone())).unwrap();
    assert_eq!(chat.fixes, vec!["thinking_to_reasoning_effort"]);
    assert_eq!(chat.body["reasoning_effort"], "medium");
    assert_eq!(chat.body["max_completion_tokens"], 8000);
    assert_eq!(chat.body["stream_options"], json!({"include_usage": true}));
    assert_eq!(chat.body["parallel_tool_calls"], false);
    let roles: Vec<&str> = chat.body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        roles,
        ["system", "system", "user", "assistant", "tool", "user"]
    );

    let back = chat_to_messages(&chat.body, 1024).unwrap();
    assert_eq!(back.fixes, Vec::<String>::new());
    let mut expected = msgs;
    // A tool turn's remaining content comes back as its own user turn (Anthropic joins
    // consecutive user turns itself).
    expected["messages"][2] = json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "found"}]});
    expected["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": [{"type": "text", "text": "Summarise."}]}));
    assert_eq!(Value::Object(back.body), expected);
}

#[test]
fn unsupported_parts_are_errors_that_name_the_field() {
    let mut chat = json!({"model": "m", "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "listen"},
            {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}}]}]});
    let e = chat_to_messages(&obj(chat.clone()), 100).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
    assert_eq!(
        e.message,
        "messages[2].content[1]: input_audio is not supported by Anthropic-protocol variants"
    );
    for (field, value) in [
        ("n", json!(3)),
        ("logprobs", json!(true)),
        ("modalities", json!(["text", "audio"])),
        ("functions", json!([{"name": "f"}])),
    ] {
        let mut c = chat.clone();
        c["messages"][2]["content"] = json!("fine");
        c[field] = value;
        let e = chat_to_messages(&obj(c), 100).unwrap_err();
        assert!(
            e.message.starts_with(&format!("{field}: ")),
            "{}",
            e.message
        );
    }
    chat["messages"][2]["content"] = json!([{"type": "file", "file": {"file_id": "file-1"}}]);
    let e = chat_to_messages(&obj(chat.clone()), 100).unwrap_err();
    assert!(
        e.message
            .starts_with("messages[2].content[0].file.file_id: "),
        "{}",
        e.message
    );
    chat["messages"][2]["content"] = json!("fine");
    chat["tools"] = json!([{"type": "custom", "custom": {"name": "x"}}]);
    let e = chat_to_messages(&obj(chat), 100).unwrap_err();
    assert!(e.message.starts_with("tools[0].type: "), "{}", e.message);

    let msgs = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "q"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}]});
    let e = messages_to_chat(&obj(msgs)).unwrap_err();
    assert_eq!(
        e.message,
        "tools[0]: the `web_search_20250305` tool is not supported by OpenAI-protocol variants"
    );
    let msgs = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]}]});
    let e = messages_to_chat(&obj(msgs)).unwrap_err();
    assert!(
        e.message.starts_with("messages[0].content[0].content[0]: "),
        "{}",
        e.message
    );
}

#[test]
fn dropped_and_changed_fields_are_reported() {
    let chat = json!({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "late rule"},
        {"role": "assistant", "content": "ok", "reasoning_content": "thought"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "high"}}]}],
        "temperature": 1.6, "frequency_penalty": 0.3, "seed": 7, "vendor_extension": {"a": 1}});
    let t = chat_to_messages(&obj(chat), 2048).unwrap();
    assert_eq!(
        t.fixes,
        [
            "system_moved",
            "thinking_dropped",
            "image_detail_dropped",
            "max_tokens_defaulted",
            "temperature_clamped",
            "frequency_penalty_dropped",
            "seed_dropped",
            "vendor_extension_dropped"
        ]
    );
    assert_eq!(t.body["max_tokens"], 2048);
    assert_eq!(t.body["temperature"], 1.0);
    assert_eq!(t.body["system"], "late rule");

    let msgs = json!({"model": "m", "max_tokens": 50, "top_k": 5,
        "system": [{"type": "text", "text": "big prompt", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "sig"},
                {"type": "text", "text": "a"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": true}]}]});
    let t = messages_to_chat(&obj(msgs)).unwrap();
    assert_eq!(
        t.fixes,
        [
            "cache_control_dropped",
            "thinking_dropped",
            "tool_result_is_error_dropped",
            "top_k_dropped"
        ]
    );
}

#[test]
fn reasoning_effort_becomes_a_thinking_budget_only_where_anthropic_allows_it() {
    let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "reasoning_effort": "high", "max_completion_tokens": 10000, "temperature": 0.2});
    let t = chat_to_messages(&obj(base.clone()), 1024).unwrap();
    assert_eq!(
        t.body["thinking"],
        json!({"type": "enabled", "budget_tokens": 9999})
    );
    assert_eq!(t.fixes, ["temperature_dropped"]);
    assert!(t.body.get("temperature").is_none());

    let mut small = base.clone();
    small["max_completion_tokens"] = json!(1000);
    let t = chat_to_messages(&obj(small), 1024).unwrap();
    assert!(t.body.get("thinking").is_none());
    assert_eq!(t.fixes, ["reasoning_effort_dropped"]);
    assert_eq!(t.body["temperature"], 0.2);

    let mut forced = base;
    forced["response_format"] = json!({"type": "json_object"});
    let t = chat_to_messages(&obj(forced), 1024).unwrap();
    assert!(t.body.get("thinking").is_none());
    assert!(t.fixes.contains(&"reasoning_effort_dropped".to_owned()));
}

#[test]
fn json_schema_response_format_is_a_forced_tool_and_maps_back_to_text() {
    let chat = json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "a person"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "strict": true,
            "schema": {"type": "object", "properties": {"name": {"type": "string"}}}}}});
    let t = chat_to_messages(&obj(chat.clone()), 100).unwrap();
    assert_eq!(t.fixes, ["response_format_as_tool"]);
    assert_eq!(t.context.json_tool.as_deref(), Some("person"));
    assert_eq!(
        t.body["tool_choice"],
        json!({"type": "tool", "name": "person"})
    );
    assert_eq!(
        t.body["tools"][0]["input_schema"]["properties"]["name"]["type"],
        "string"
    );

    let answer = json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "person", "input": {"name": "Ada"}}],
        "stop_reason": "tool_use", "stop_sequence": null, "usage": {"input_tokens": 5, "output_tokens": 9}});
    let c = message_to_chat_completion(&answer, &t.context, "pub", 1).unwrap();
    assert_eq!(c["choices"][0]["message"]["content"], "{\"name\":\"Ada\"}");
    assert_eq!(c["choices"][0]["finish_reason"], "stop");
    assert!(c["choices"][0]["message"].get("tool_calls").is_none());

    // Streamed, the input's fragments are the content.
    let events = stream_from_whole(Protocol::Anthropic, Endpoint::Messages, &answer).unwrap();
    let mut s = AnthropicToChatStream::new(t.context.clone(), "pub", 1);
    let body = assemble_openai(&mut s, &events);
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "{\"name\":\"Ada\"}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");

    let mut with_tools = chat;
    with_tools["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
    let e = chat_to_messages(&obj(with_tools), 100).unwrap_err();
    assert!(e.message.starts_with("response_format: "), "{}", e.message);
}

#[test]
fn roles_outside_each_protocol_are_refused() {
    let msgs =
        json!({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]});
    let e = messages_to_chat(&obj(msgs)).unwrap_err();
    assert_eq!(e.message, "`messages[0].role`: unknown role `system`");
    let chat =
        json!({"model": "m", "messages": [{"role": "function", "name": "f", "content": "x"}]});
    let e = chat_to_messages(&obj(chat), 5).unwrap_err();
    assert!(e.message.starts_with("messages[0].role: "), "{}", e.message);
}

/// One Chat message of a generated conversation.
fn chat_message() -> impl Strategy<Value = Value> {
    let text = "\\PC{0,12}";
    let call = (
        "[a-z]{1,6}",
        "[a-z_]{1,8}",
        proptest::collection::btree_map("[a-z]{1,4}", 0u32..100, 0..3),
    )
        .prop_map(|(id, name, args)| {
            json!({"id": format!("toolu_{id}"), "type": "function",
                "function": {"name": name, "arguments": json!(args).to_string()}})
        });
    prop_oneof![
        text.prop_map(|t| json!({"role": "user", "content": t})),
        ("\\PC{1,12}", proptest::collection::vec(call.clone(), 0..3)).prop_map(|(t, calls)| {
            let mut m = json!({"role": "assistant", "content": t});
            if !calls.is_empty() {
                m["tool_calls"] = json!(calls);
            }
            m
        }),
        proptest::collection::vec(call, 1..3)
            .prop_map(|calls| json!({"role": "assistant", "content": null, "tool_calls": calls})),
        ("[a-z]{1,6}", text).prop_map(|(id, t)| {
            json!({"role": "tool", "tool_call_id": format!("toolu_{id}"), "content": t})
        }),
    ]
}

proptest! {
    #[test]
    fn any_conversation_survives_chat_to_messages_to_chat(
        system in proptest::option::of("\\PC{1,12}"),
        turns in proptest::collection::vec(chat_message(), 1..8),
    ) {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(json!({"role": "system", "content": s}));
        }
        messages.extend(turns);
        let chat = json!({"model": "m", "max_tokens": 64, "messages": messages});
        let there = chat_to_messages(&obj(chat.clone()), 1).unwrap();
        prop_assert!(there.fixes.is_empty(), "{:?}", there.fixes);
        let back = messages_to_chat(&there.body).unwrap();
        prop_assert!(back.fixes.is_empty(), "{:?}", back.fixes);
        prop_assert_eq!(Value::Object(back.body), chat);
    }
}
