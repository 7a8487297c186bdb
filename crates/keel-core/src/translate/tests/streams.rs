//! Streams, event by event, both ways.

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;
use crate::synthesize::stream_from_whole;

/// An Anthropic stream of the message in [`anthropic_message`], its tool inputs cut in
/// fragments that are not JSON on their own.
fn anthropic_tool_stream() -> Vec<SseEvent> {
    let mut evs = vec![
        ev(
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_01", "type": "message",
            "role": "assistant", "model": "claude-x", "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 90, "output_tokens": 1}}}),
        ),
        ev("ping", json!({"type": "ping"})),
        ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}}),
        ),
        ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Two "}}),
        ),
        ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "cities."}}),
        ),
        ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}}),
        ),
        ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        ),
        ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Check"}}),
        ),
        ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "ing."}}),
        ),
        ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ),
    ];
    for (i, id, frags) in [
        (2, "toolu_A", vec!["", "{\"ci", "ty\": \"Os", "lo\"}"]),
        (
            3,
            "toolu_B",
            vec!["{\"city\":", " \"Bergen\", \"units\"", ": [\"c\"]}"],
        ),
    ] {
        evs.push(ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": i,
            "content_block": {"type": "tool_use", "id": id, "name": "weather", "input": {}}}),
        ));
        for f in frags {
            evs.push(ev(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i,
                "delta": {"type": "input_json_delta", "partial_json": f}}),
            ));
        }
        evs.push(ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        ));
    }
    evs.push(ev(
        "message_delta",
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
        "usage": {"output_tokens": 25}}),
    ));
    evs.push(ev("message_stop", json!({"type": "message_stop"})));
    evs
}

#[test]
fn a_streamed_anthropic_tool_call_becomes_openai_tool_call_deltas() {
    let ctx = ResponseContext {
        json_tool: None,
        include_usage: true,
    };
    let mut s = AnthropicToChatStream::new(ctx.clone(), "pub", 1700);
    let out = translate_to_openai(&mut s, &anthropic_tool_stream());
    // The role chunk first; the ping as a comment; the tool call's first delta names it.
    let first: Value = serde_json::from_str(&out[0].data).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert!(out[1].comment_only);
    let starts: Vec<Value> = out
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter_map(|c| c.pointer("/choices/0/delta/tool_calls/0").cloned())
        .filter(|c| c.get("id").is_some())
        .collect();
    assert_eq!(starts.len(), 2);
    assert_eq!(
        starts[1],
        json!({"index": 1, "id": "toolu_B", "type": "function",
        "function": {"name": "weather", "arguments": ""}})
    );
    // No usage inside content chunks; one usage chunk before [DONE].
    let usage: Value = serde_json::from_str(&out[out.len() - 2].data).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["prompt_tokens"], 100);

    let assembled = assemble(Protocol::OpenAi, Endpoint::ChatCompletions, &out);
    let whole = message_to_chat_completion(&anthropic_message(), &ctx, "pub", 1700).unwrap();
    let calls = &assembled["choices"][0]["message"]["tool_calls"];
    for (j, input) in [
        json!({"city": "Oslo"}),
        json!({"city": "Bergen", "units": ["c"]}),
    ]
    .iter()
    .enumerate()
    {
        let args = calls[j]["function"]["arguments"].as_str().unwrap();
        assert_eq!(&serde_json::from_str::<Value>(args).unwrap(), input);
        assert_eq!(
            calls[j]["id"],
            whole["choices"][0]["message"]["tool_calls"][j]["id"]
        );
    }
    assert_eq!(assembled["choices"][0]["message"]["content"], "Checking.");
    assert_eq!(assembled["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(assembled["usage"], whole["usage"]);
    assert_eq!(assembled["model"], "pub");
}

#[test]
fn a_streamed_openai_tool_call_becomes_anthropic_blocks() {
    let call = |i: u64, id: Option<&str>, name: Option<&str>, args: &str| {
        let mut c = json!({"index": i, "function": {"arguments": args}});
        if let Some(id) = id {
            c["id"] = json!(id);
            c["type"] = json!("function");
        }
        if let Some(n) = name {
            c["function"]["name"] = json!(n);
        }
        chunk(json!({"tool_calls": [c]}), Value::Null)
    };
    let events = vec![
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(json!({"reasoning_content": "Hm."}), Value::Null),
        chunk(json!({"content": "Let me "}), Value::Null),
        chunk(json!({"content": "see."}), Value::Null),
        call(0, Some("call_1"), Some("weather"), ""),
        call(0, None, None, "{\"city\""),
        call(0, None, None, ":\"Oslo\"}"),
        call(1, Some("call_2"), Some("time"), "{\"tz\":"),
        call(1, None, None, "\"CET\"}"),
        chunk(json!({}), json!("tool_calls")),
        SseEvent::new(
            None,
            &json!({"id": "chatcmpl-1", "choices": [], "usage":
            {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70,
             "prompt_tokens_details": {"cached_tokens": 30}}})
            .to_string(),
        ),
        SseEvent::new(None, "[DONE]"),
    ];
    let mut s = ChatToAnthropicStream::new("pub");
    let out = translate_to_anthropic(&mut s, &events);
    assert!(s.is_done());
    let names: Vec<&str> = out.iter().map(|e| e.event.as_deref().unwrap()).collect();
    assert_eq!(names[0], "message_start");
    assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"]);
    // Blocks never interleave: each start is followed by its own deltas and stop.
    let mut open: Option<u64> = None;
    let mut next = 0;
    for e in &out {
        let v: Value = serde_json::from_str(&e.data).unwrap();
        match e.event.as_deref().unwrap() {
            "content_block_start" => {
                assert_eq!(open, None);
                assert_eq!(v["index"], next);
                open = Some(next);
                next += 1;
            }
            "content_block_delta" => assert_eq!(Some(v["index"].as_u64().unwrap()), open),
            "content_block_stop" => {
                assert_eq!(Some(v["index"].as_u64().unwrap()), open);
                open = None;
            }
            _ => {}
        }
    }
    assert_eq!(next, 4);
    // The assembler keeps no thinking text (only `text_delta`s): check its delta here.
    let thinking: Value = serde_json::from_str(&out[2].data).unwrap();
    assert_eq!(
        thinking["delta"],
        json!({"type": "thinking_delta", "thinking": "Hm."})
    );
    let body = assemble(Protocol::Anthropic, Endpoint::Messages, &out);
    assert_eq!(
        body["content"],
        json!([
            {"type": "thinking", "thinking": "", "signature": ""},
            {"type": "text", "text": "Let me see."},
            {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "call_2", "name": "time", "input": {"tz": "CET"}}
        ])
    );
    assert_eq!(body["stop_reason"], "tool_use");
    assert_eq!(body["model"], "pub");
    assert_eq!(body["id"], "chatcmpl-1");
    let delta: Value = serde_json::from_str(&out[out.len() - 2].data).unwrap();
    assert_eq!(
        delta["usage"],
        json!({"input_tokens": 20, "cache_read_input_tokens": 30, "output_tokens": 20})
    );
}

#[test]
fn whole_and_streamed_translations_agree() {
    // Chat completion → stream → Anthropic stream → assembled == the whole translation.
    let completion = json!({"id": "chatcmpl-9", "object": "chat.completion", "created": 5, "model": "up",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{\"a\":[1,2]}"}}]},
            "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}});
    let events =
        stream_from_whole(Protocol::OpenAi, Endpoint::ChatCompletions, &completion).unwrap();
    let out = translate_to_anthropic(&mut ChatToAnthropicStream::new("pub"), &events);
    let streamed = assemble(Protocol::Anthropic, Endpoint::Messages, &out);
    let whole = chat_completion_to_message(&completion, "pub").unwrap();
    // The prompt's size is known only at the end of an OpenAI stream: it travels in the final
    // `message_delta` (cumulative usage), whose counts the assembler takes.
    let delta: Value = serde_json::from_str(&out[out.len() - 2].data).unwrap();
    assert_eq!(delta["usage"], whole["usage"]);
    assert_eq!(streamed, whole);

    let events = stream_from_whole(
        Protocol::Anthropic,
        Endpoint::Messages,
        &anthropic_message(),
    )
    .unwrap();
    let ctx = ResponseContext {
        json_tool: None,
        include_usage: true,
    };
    let mut s = AnthropicToChatStream::new(ctx.clone(), "pub", 9);
    let streamed = assemble_openai(&mut s, &events);
    let whole = message_to_chat_completion(&anthropic_message(), &ctx, "pub", 9).unwrap();
    for key in ["id", "model", "created", "usage"] {
        assert_eq!(streamed[key], whole[key], "{key}");
    }
    let (s, w) = (&streamed["choices"][0], &whole["choices"][0]);
    assert_eq!(s["finish_reason"], w["finish_reason"]);
    assert_eq!(s["message"]["content"], w["message"]["content"]);
    assert_eq!(s["message"]["tool_calls"], w["message"]["tool_calls"]);
}

#[test]
fn finish_reasons_and_usage_map_in_streams() {
    for (stop, finish) in [
        ("end_turn", "stop"),
        ("max_tokens", "length"),
        ("stop_sequence", "stop"),
    ] {
        let events = [
            ev(
                "message_start",
                json!({"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 3, "output_tokens": 0}}}),
            ),
            ev(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": stop}, "usage": {"output_tokens": 4}}),
            ),
            ev("message_stop", json!({"type": "message_stop"})),
        ];
        let mut s = AnthropicToChatStream::new(ResponseContext::default(), "pub", 1);
        let out = translate_to_openai(&mut s, &events);
        // Without include_usage: role, finish, [DONE]; no usage chunk.
        assert_eq!(out.len(), 3);
        let f: Value = serde_json::from_str(&out[1].data).unwrap();
        assert_eq!(f["choices"][0]["finish_reason"], finish);
        assert!(f.get("usage").is_none());
    }
    for (finish, stop) in [
        ("stop", "end_turn"),
        ("length", "max_tokens"),
        ("content_filter", "refusal"),
    ] {
        let events = [
            chunk(json!({"content": "x"}), json!(finish)),
            SseEvent::new(None, "[DONE]"),
        ];
        let out = translate_to_anthropic(&mut ChatToAnthropicStream::new("pub"), &events);
        let body = assemble(Protocol::Anthropic, Endpoint::Messages, &out);
        assert_eq!(body["stop_reason"], stop);
        assert_eq!(body["usage"]["output_tokens"], 0);
    }
}

#[test]
fn upstream_error_events_become_the_clients_error_event() {
    let mut s = AnthropicToChatStream::new(ResponseContext::default(), "pub", 1);
    let out = translate_to_openai(
        &mut s,
        &[
            ev(
                "message_start",
                json!({"type": "message_start", "message": {"id": "m"}}),
            ),
            ev(
                "error",
                json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
            ),
            ev("message_stop", json!({"type": "message_stop"})),
        ],
    );
    assert!(s.is_done());
    assert_eq!(out.len(), 2, "no [DONE] after an error");
    let e: Value = serde_json::from_str(&out[1].data).unwrap();
    assert_eq!(e["error"]["type"], "overloaded_error");
    assert_eq!(e["error"]["message"], "Overloaded");

    let mut s = ChatToAnthropicStream::new("pub");
    let out = translate_to_anthropic(
        &mut s,
        &[
            chunk(json!({"content": "par"}), Value::Null),
            SseEvent::new(
                None,
                &json!({"error": {"message": "upstream died", "type": "server_error"}}).to_string(),
            ),
            SseEvent::new(None, "[DONE]"),
        ],
    );
    let last = out.last().unwrap();
    assert_eq!(last.event.as_deref(), Some("error"));
    assert!(!out
        .iter()
        .any(|e| e.event.as_deref() == Some("message_stop")));
    let e: Value = serde_json::from_str(&last.data).unwrap();
    assert_eq!(
        e["error"],
        json!({"type": "api_error", "message": "upstream died"})
    );
}

/// Every stream translator copies a keep-alive comment as it came, and writes nothing more once
/// its stream has ended.
#[test]
fn keep_alives_pass_through_and_nothing_follows_the_end() {
    use crate::translate::responses::{ChatToResponsesStream, ResponseIds, ResponsesContext};
    let comment = crate::sse::decode_all(b": keep-alive\n\n")
        .unwrap()
        .remove(0);
    assert!(comment.comment_only);
    let done = SseEvent::new(None, "[DONE]");
    let error = ev(
        "error",
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
    );
    type Push<'a> = dyn FnMut(&SseEvent, &mut Vec<SseEvent>) -> Result<(), String> + 'a;
    let check = |push: &mut Push<'_>, end: &SseEvent| {
        let mut out = Vec::new();
        push(&comment, &mut out).unwrap();
        assert_eq!(out, std::slice::from_ref(&comment));
        push(end, &mut out).unwrap();
        let ended = out.len();
        assert!(ended > 1, "the end writes its events");
        for ev in [
            &comment,
            end,
            &chunk(json!({"content": "late"}), Value::Null),
        ] {
            push(ev, &mut out).unwrap();
        }
        assert_eq!(out.len(), ended, "nothing after the end: {out:?}");
    };
    let mut to_chat = AnthropicToChatStream::new(ResponseContext::default(), "m", 1);
    check(&mut |e, o| to_chat.push(e, o), &error);
    assert!(to_chat.is_done());
    let mut to_messages = ChatToAnthropicStream::new("m");
    check(&mut |e, o| to_messages.push(e, o), &done);
    assert!(to_messages.is_done());
    let ids = ResponseIds {
        id: "resp_1".into(),
        model: "m".into(),
        created_at: 1,
    };
    let mut to_responses = ChatToResponsesStream::new(ResponsesContext::default(), ids);
    check(&mut |e, o| to_responses.push(e, o), &done);
    assert!(to_responses.is_done());
}

#[test]
fn hostile_indexes_and_bad_json_are_errors_not_panics() {
    let mut s = AnthropicToChatStream::new(ResponseContext::default(), "pub", 1);
    let mut out = Vec::new();
    let huge = ev(
        "content_block_start",
        json!({"index": 4_000_000_000u64, "content_block": {"type": "text"}}),
    );
    assert!(s.push(&huge, &mut out).is_err());
    let orphan = ev(
        "content_block_delta",
        json!({"index": 3, "delta": {"type": "text_delta", "text": "x"}}),
    );
    assert!(s.push(&orphan, &mut out).is_err());
    assert!(s
        .push(&SseEvent::new(Some("message_delta"), "{oops"), &mut out)
        .is_err());

    let mut s = ChatToAnthropicStream::new("pub");
    let huge = chunk(
        json!({"tool_calls": [{"index": 1u64 << 40, "id": "c", "function": {"name": "f"}}]}),
        Value::Null,
    );
    assert!(s.push(&huge, &mut out).is_err());
    assert!(s.push(&SseEvent::new(None, "{oops"), &mut out).is_err());
    // A tool call that resumes after the next one began cannot be a valid Anthropic stream.
    let mut s = ChatToAnthropicStream::new("pub");
    let c = |i: u64, args: &str| {
        chunk(
            json!({"tool_calls": [{"index": i, "id": format!("c{i}"), "function": {"name": "f", "arguments": args}}]}),
            Value::Null,
        )
    };
    s.push(&c(0, "{"), &mut out).unwrap();
    s.push(&c(1, "{"), &mut out).unwrap();
    assert!(s.push(&c(0, "}"), &mut out).is_err());
}

proptest! {
    #[test]
    fn text_split_anyhow_concatenates_to_the_same_text_both_ways(
        text in "\\PC{0,40}",
        cuts in proptest::collection::vec(0usize..64, 0..8),
    ) {
        let pieces = split_at(&text, &cuts);

        let mut events = vec![
            ev("message_start", json!({"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 1}}})),
            ev("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
        ];
        for p in &pieces {
            events.push(ev("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}})));
        }
        events.push(ev("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
        events.push(ev("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}})));
        events.push(ev("message_stop", json!({"type": "message_stop"})));
        let mut s = AnthropicToChatStream::new(ResponseContext::default(), "pub", 1);
        let body = assemble_openai(&mut s, &events);
        prop_assert_eq!(body["choices"][0]["message"]["content"].as_str().unwrap(), text.as_str());

        let mut events: Vec<SseEvent> =
            pieces.iter().map(|p| chunk(json!({"content": p}), Value::Null)).collect();
        events.push(chunk(json!({}), json!("stop")));
        events.push(SseEvent::new(None, "[DONE]"));
        let out = translate_to_anthropic(&mut ChatToAnthropicStream::new("pub"), &events);
        let body = assemble(Protocol::Anthropic, Endpoint::Messages, &out);
        let got = body["content"].get(0).and_then(|b| b["text"].as_str()).unwrap_or("");
        prop_assert_eq!(got, text.as_str());
    }

    #[test]
    fn tool_arguments_split_anyhow_arrive_whole_both_ways(
        city in "[a-zA-Z \"\\\\é]{0,20}",
        n in 0u32..1000,
        cuts in proptest::collection::vec(0usize..64, 0..6),
    ) {
        let input = json!({"city": city, "n": n, "tags": ["a", "b"]});
        let pieces = split_at(&input.to_string(), &cuts);

        let mut events = vec![
            ev("message_start", json!({"type": "message_start", "message": {"id": "m"}})),
            ev("content_block_start", json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}})),
        ];
        for p in &pieces {
            events.push(ev("content_block_delta", json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": p}})));
        }
        events.push(ev("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}})));
        events.push(ev("message_stop", json!({"type": "message_stop"})));
        let mut s = AnthropicToChatStream::new(ResponseContext::default(), "pub", 1);
        let body = assemble_openai(&mut s, &events);
        let args = body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap();
        prop_assert_eq!(serde_json::from_str::<Value>(args).unwrap(), input.clone());

        let mut events = vec![chunk(json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": ""}}]}), Value::Null)];
        for p in &pieces {
            events.push(chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}), Value::Null));
        }
        events.push(chunk(json!({}), json!("tool_calls")));
        events.push(SseEvent::new(None, "[DONE]"));
        let out = translate_to_anthropic(&mut ChatToAnthropicStream::new("pub"), &events);
        let body = assemble(Protocol::Anthropic, Endpoint::Messages, &out);
        prop_assert_eq!(&body["content"][0]["input"], &input);
        prop_assert_eq!(&body["content"][0]["id"], "call_1");
    }
}

#[test]
fn a_stream_without_a_stop_reason_still_finishes() {
    let events = [
        ev(
            "message_start",
            json!({"type": "message_start", "message": {"id": "m"}}),
        ),
        ev("message_stop", json!({"type": "message_stop"})),
    ];
    let mut s = AnthropicToChatStream::new(ResponseContext::default(), "pub", 1);
    let body = assemble_openai(&mut s, &events);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["choices"][0]["message"]["content"], "");

    let out = translate_to_anthropic(
        &mut ChatToAnthropicStream::new("pub"),
        &[SseEvent::new(None, "[DONE]")],
    );
    let names: Vec<&str> = out.iter().map(|e| e.event.as_deref().unwrap()).collect();
    assert_eq!(names, ["message_start", "message_delta", "message_stop"]);
}

#[test]
fn a_streamed_anthropic_thinking_block_becomes_reasoning_content() {
    let mut s = AnthropicToChatStream::new(ResponseContext::default(), "pub", 1);
    let evs = vec![
        ev(
            "message_start",
            json!({"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 1}}}),
        ),
        ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        ),
        ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "thinking_delta", "thinking": "Hm \"so\"."}}),
        ),
        ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        ev(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 2}}),
        ),
        ev("message_stop", json!({"type": "message_stop"})),
    ];
    let out = translate_to_openai(&mut s, &evs);
    let reasoning: Vec<Value> = out
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter_map(|c| c.pointer("/choices/0/delta/reasoning_content").cloned())
        .collect();
    assert_eq!(reasoning, vec![json!("Hm \"so\".")]);
}
