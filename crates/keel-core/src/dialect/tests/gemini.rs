//! Gemini: requests, whole answers, streams and errors, against bodies shaped as in Google's
//! `generateContent` / `streamGenerateContent` reference.

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::*;
use crate::assemble::Assembler;
use crate::protocol::{event_role, Endpoint, EventRole};
use crate::sse::decode_all;
use crate::translate::{chat_to_messages, AnthropicToChatStream, ResponseContext};

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => panic!("not an object"),
    }
}

fn gemini(hub: Value) -> (Value, Vec<String>) {
    let r = request(&obj(hub)).expect("request maps");
    (serde_json::from_slice(&r.body).unwrap(), r.fixes)
}

fn refused(hub: Value) -> String {
    request(&obj(hub)).expect_err("request is refused").message
}

// ---------------------------------------------------------------------------------------------
// Requests

#[test]
fn request_maps_a_conversation_with_tools_images_sampling_and_a_prefill() {
    let (body, fixes) = gemini(json!({
        "model": "gemini-2.5-flash",
        "stream": true,
        "max_tokens": 1024,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["END"],
        "system": "You are terse.",
        "tools": [{
            "name": "get_weather",
            "description": "Weather for a city",
            "input_schema": {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": false
            }
        }],
        "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture, and the weather in Oslo?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
            ]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "A cat. Checking."},
                {"type": "tool_use", "id": "toolu_01A", "name": "get_weather", "input": {"city": "Oslo"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "4°C, rain"}
            ]},
            {"role": "assistant", "content": "In Oslo it is"}
        ]
    }));
    assert_eq!(
        body,
        json!({
            "contents": [
                {"role": "user", "parts": [
                    {"text": "What is in this picture, and the weather in Oslo?"},
                    {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}}
                ]},
                {"role": "model", "parts": [
                    {"text": "A cat. Checking."},
                    {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}},
                     "thoughtSignature": PLACEHOLDER_SIGNATURE}
                ]},
                {"role": "user", "parts": [
                    {"functionResponse": {"name": "get_weather", "response": {"output": "4°C, rain"}}}
                ]},
                {"role": "model", "parts": [{"text": "In Oslo it is"}]}
            ],
            "systemInstruction": {"parts": [{"text": "You are terse."}]},
            "tools": [{"functionDeclarations": [{
                "name": "get_weather",
                "description": "Weather for a city",
                "parametersJsonSchema": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "additionalProperties": false
                }
            }]}],
            "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
            "generationConfig": {
                "maxOutputTokens": 1024,
                "temperature": 0.7,
                "topP": 0.9,
                "topK": 40,
                "stopSequences": ["END"]
            }
        })
    );
    // The history's call came from elsewhere: it carries Gemini's documented placeholder.
    assert_eq!(fixes, vec!["thought_signature_placeholder"]);
}

#[test]
fn request_maps_thinking_forced_tools_errors_documents_and_reports_what_it_drops() {
    let (body, fixes) = gemini(json!({
        "model": "m",
        "max_tokens": 8000,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "metadata": {"user_id": "u1"},
        "system": [{"type": "text", "text": "Be exact.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "answer", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "answer", "disable_parallel_tool_use": true},
        "messages": [
            {"role": "user", "content": [
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}}
            ]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "answer", "input": {}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "is_error": true,
                 "content": [{"type": "text", "text": "boom"}, {"type": "text", "text": "again"}]}
            ]}
        ]
    }));
    assert_eq!(
        body["generationConfig"],
        json!({"maxOutputTokens": 8000, "thinkingConfig": {"thinkingBudget": 2048, "includeThoughts": true}})
    );
    assert_eq!(
        body["toolConfig"],
        json!({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["answer"]}})
    );
    assert_eq!(
        body["contents"][0]["parts"],
        json!([{"inlineData": {"mimeType": "application/pdf", "data": "JVBERi0x"}}, {"text": "notes"}])
    );
    assert_eq!(
        body["contents"][2]["parts"][0],
        json!({"functionResponse": {"name": "answer", "response": {"error": "boom\nagain"}}})
    );
    assert_eq!(
        body["systemInstruction"],
        json!({"parts": [{"text": "Be exact."}]})
    );
    assert!(body.get("model").is_none() && body.get("stream").is_none());
    assert_eq!(
        fixes,
        vec![
            "thought_signature_placeholder",
            "cache_control_dropped",
            "disable_parallel_tool_use_dropped",
            "metadata_dropped"
        ]
    );
}

#[test]
fn request_maps_adaptive_and_disabled_thinking_and_json_output() {
    let (body, _) = gemini(json!({
        "max_tokens": 100, "thinking": {"type": "adaptive"},
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}},
        "messages": [{"role": "user", "content": "hi"}]
    }));
    assert_eq!(
        body["generationConfig"],
        json!({"maxOutputTokens": 100, "thinkingConfig": {"thinkingBudget": -1, "includeThoughts": true},
               "responseMimeType": "application/json", "responseJsonSchema": {"type": "object"}})
    );
    let (body, fixes) = gemini(json!({
        "max_tokens": 100, "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "hi"}]
    }));
    assert_eq!(body["generationConfig"], json!({"maxOutputTokens": 100}));
    assert!(fixes.is_empty());
}

#[test]
fn request_refuses_what_gemini_cannot_take_naming_the_field() {
    let base = |messages: Value| json!({"max_tokens": 10, "messages": messages});
    let msg = refused(base(json!([{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x/cat.png"}}]}])));
    assert_eq!(
        msg,
        "messages[0].content[0].source: an image `url` source is not supported by Gemini variants"
    );
    let msg = refused(base(json!([{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}])));
    assert!(
        msg.starts_with("messages[0].content[0].tool_use_id:"),
        "{msg}"
    );
    let mut hub = base(json!([{"role": "user", "content": "hi"}]));
    hub["tools"] = json!([{"type": "web_search_20250305", "name": "web_search"}]);
    assert_eq!(
        refused(hub),
        "tools[0]: the server tool `web_search_20250305` is not supported by Gemini variants"
    );
    let mut hub = base(json!([{"role": "user", "content": "hi"}]));
    hub["stop_sequences"] = json!(["a", "b", "c", "d", "e", "f"]);
    assert_eq!(
        refused(hub),
        "stop_sequences: more than 5 stop sequences is not supported by Gemini variants"
    );
    let mut hub = base(json!([{"role": "user", "content": "hi"}]));
    hub["mcp_servers"] = json!([{"type": "url", "url": "https://mcp.example", "name": "x"}]);
    assert_eq!(
        refused(hub),
        "mcp_servers: an MCP server is not supported by Gemini variants"
    );
    let msg = refused(base(json!([{"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]}])));
    assert_eq!(
        msg,
        "messages[0].content[0]: a `server_tool_use` block is not supported by Gemini variants"
    );
}

/// An OpenAI Chat client's request, through the hub, to Gemini: tool calls and results; and a
/// `response_format` (the hub's forced tool) as a forced function.
#[test]
fn chat_client_request_reaches_gemini_through_the_hub() {
    let chat = obj(json!({
        "model": "pub",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\":4}"}
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": "required"
    }));
    let hub = chat_to_messages(&chat, 4096).expect("translates");
    let (body, _) = gemini(Value::Object(hub.body));
    assert_eq!(body["systemInstruction"]["parts"][0]["text"], "Be brief.");
    assert_eq!(
        body["toolConfig"]["functionCallingConfig"],
        json!({"mode": "ANY"})
    );
    assert_eq!(
        body["tools"][0]["functionDeclarations"][0]["name"],
        "get_weather"
    );
    assert_eq!(
        body["contents"][1]["parts"][0]["functionCall"],
        json!({"name": "get_weather", "args": {"city": "Oslo"}})
    );
    assert_eq!(
        body["contents"][2]["parts"][0]["functionResponse"],
        json!({"name": "get_weather", "response": {"output": "{\"temp_c\":4}"}})
    );
    assert_eq!(body["generationConfig"]["maxOutputTokens"], 4096);

    let chat = obj(json!({
        "model": "pub",
        "messages": [{"role": "user", "content": "Summarize: rain in Oslo."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "report",
            "schema": {"type": "object", "properties": {"summary": {"type": "string"}}}}}
    }));
    let hub = chat_to_messages(&chat, 4096).expect("translates");
    let (body, _) = gemini(Value::Object(hub.body));
    let forced = hub
        .context
        .json_tool
        .expect("a forced tool stands for response_format");
    assert_eq!(
        body["toolConfig"]["functionCallingConfig"],
        json!({"mode": "ANY", "allowedFunctionNames": [forced]})
    );
    assert_eq!(
        body["tools"][0]["functionDeclarations"][0]["parametersJsonSchema"],
        json!({"type": "object", "properties": {"summary": {"type": "string"}}})
    );
}

/// A Gemini answer's thought signature goes back to Gemini on its function call when an
/// Anthropic client sends the answer back as history; Claude's signatures do not.
#[test]
fn thought_signatures_round_trip_through_the_hub() {
    let answer = json!({
        "candidates": [{"content": {"role": "model", "parts": [
            {"text": "Need the weather.", "thought": true},
            {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}, "thoughtSignature": "c2lnLTE="},
            {"functionCall": {"name": "get_weather", "args": {"city": "Bergen"}}}
        ]}, "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 50, "candidatesTokenCount": 20, "thoughtsTokenCount": 30, "totalTokenCount": 100},
        "responseId": "abc.123"
    });
    let hub: Value =
        serde_json::from_slice(&whole(answer.to_string().as_bytes(), "pub").unwrap()).unwrap();
    let content = hub["content"].clone();
    assert_eq!(
        content,
        json!([
            {"type": "thinking", "thinking": "Need the weather.", "signature": ""},
            {"type": "thinking", "thinking": "", "signature": "gemini:c2lnLTE="},
            {"type": "tool_use", "id": "toolu_abc_123_0", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_abc_123_1", "name": "get_weather", "input": {"city": "Bergen"}}
        ])
    );
    let (body, fixes) = gemini(json!({
        "max_tokens": 100,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": content},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_abc_123_0", "content": "4"},
                {"type": "tool_result", "tool_use_id": "toolu_abc_123_1", "content": "6"}
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t", "signature": "EqQBCkgIAxABGAIiQL"},
                {"type": "tool_use", "id": "toolu_x", "name": "get_weather", "input": {"city": "Bergen"}}
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "6"}]}
        ]
    }));
    assert_eq!(
        body["contents"][1]["parts"],
        json!([
            {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}, "thoughtSignature": "c2lnLTE="},
            {"functionCall": {"name": "get_weather", "args": {"city": "Bergen"}}}
        ])
    );
    assert_eq!(
        body["contents"][2]["parts"][1]["functionResponse"]["name"],
        "get_weather"
    );
    // Claude's signature is not Gemini's: the placeholder stands in.
    assert_eq!(
        body["contents"][3]["parts"],
        json!([{"functionCall": {"name": "get_weather", "args": {"city": "Bergen"}}, "thoughtSignature": PLACEHOLDER_SIGNATURE}])
    );
    assert_eq!(fixes, vec!["thought_signature_placeholder"]);

    // A signature on a thought part signs that thought, and goes back with it.
    let answer = json!({
        "candidates": [{"content": {"role": "model", "parts": [
            {"text": "Plan.", "thought": true, "thoughtSignature": "VEhP"},
            {"text": "Done."}
        ]}, "finishReason": "STOP"}],
        "responseId": "r"
    });
    let hub = hub_whole(answer);
    assert_eq!(
        hub["content"],
        json!([{"type": "thinking", "thinking": "Plan.", "signature": "gemini:VEhP"},
               {"type": "text", "text": "Done."}])
    );
    let (body, fixes) = gemini(json!({
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "Go"}, {"role": "assistant", "content": hub["content"]},
                     {"role": "user", "content": "Again"}]
    }));
    assert_eq!(
        body["contents"][1]["parts"],
        json!([{"text": "Plan.", "thought": true, "thoughtSignature": "VEhP"}, {"text": "Done."}])
    );
    assert!(fixes.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Whole answers

fn hub_whole(answer: Value) -> Value {
    serde_json::from_slice(&whole(answer.to_string().as_bytes(), "pub").unwrap()).unwrap()
}

#[test]
fn whole_maps_text_usage_with_cache_and_finish_reasons() {
    let answer = json!({
        "candidates": [{
            "content": {"parts": [{"text": "Hello"}, {"text": " there."}], "role": "model"},
            "finishReason": "STOP",
            "index": 0,
            "safetyRatings": [{"category": "HARM_CATEGORY_HARASSMENT", "probability": "NEGLIGIBLE"}]
        }],
        "usageMetadata": {"promptTokenCount": 1200, "candidatesTokenCount": 3, "cachedContentTokenCount": 1000,
                          "thoughtsTokenCount": 7, "totalTokenCount": 1210,
                          "promptTokensDetails": [{"modality": "TEXT", "tokenCount": 1200}]},
        "modelVersion": "gemini-2.5-flash",
        "responseId": "mGo2aP7bLs2"
    });
    assert_eq!(
        hub_whole(answer.clone()),
        json!({
            "id": "msg_mGo2aP7bLs2", "type": "message", "role": "assistant", "model": "pub",
            "content": [{"type": "text", "text": "Hello there."}],
            "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": 200, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 1000, "output_tokens": 10}
        })
    );
    for (finish, stop) in [
        ("MAX_TOKENS", "max_tokens"),
        ("SAFETY", "refusal"),
        ("RECITATION", "refusal"),
        ("BLOCKLIST", "refusal"),
        ("PROHIBITED_CONTENT", "refusal"),
        ("SPII", "refusal"),
        ("OTHER", "end_turn"),
    ] {
        let mut a = answer.clone();
        a["candidates"][0]["finishReason"] = json!(finish);
        assert_eq!(hub_whole(a)["stop_reason"], stop, "{finish}");
    }
    let blocked = json!({
        "promptFeedback": {"blockReason": "SAFETY", "safetyRatings": []},
        "usageMetadata": {"promptTokenCount": 8, "totalTokenCount": 8}
    });
    let hub = hub_whole(blocked);
    assert_eq!(hub["stop_reason"], "refusal");
    assert_eq!(hub["content"], json!([]));
    assert_eq!(hub["usage"]["input_tokens"], 8);
}

#[test]
fn whole_maps_a_function_call_to_a_tool_use_answer() {
    let hub = hub_whole(json!({
        "candidates": [{"content": {"role": "model", "parts": [
            {"text": "Let me check."},
            {"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}
        ]}, "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15}
    }));
    assert_eq!(hub["stop_reason"], "tool_use");
    assert_eq!(hub["id"], "msg_gemini");
    assert_eq!(
        hub["content"],
        json!([{"type": "text", "text": "Let me check."},
               {"type": "tool_use", "id": "toolu_gemini_0", "name": "get_weather", "input": {"city": "Oslo"}}])
    );
    assert!(whole(b"not json", "m").is_err());
}

// ---------------------------------------------------------------------------------------------
// Streams

/// A Gemini `alt=sse` stream: CRLF-framed `data:` events, no terminator, the last one with
/// `finishReason` and the final usage.
fn sse(chunks: &[Value]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(c.to_string().as_bytes());
        out.extend_from_slice(b"\r\n\r\n");
    }
    out
}

fn chunk(parts: Value, finish: Option<&str>, candidates_tokens: u64) -> Value {
    let mut c = json!({"content": {"parts": parts, "role": "model"}, "index": 0});
    if let Some(f) = finish {
        c["finishReason"] = json!(f);
    }
    json!({
        "candidates": [c],
        "usageMetadata": {"promptTokenCount": 120, "candidatesTokenCount": candidates_tokens,
                          "cachedContentTokenCount": 100, "totalTokenCount": 120 + candidates_tokens},
        "modelVersion": "gemini-2.5-flash",
        "responseId": "r1"
    })
}

fn text_and_tool_stream() -> (Vec<Value>, Vec<u8>) {
    let chunks = vec![
        chunk(json!([{"text": "Let me"}]), None, 2),
        chunk(json!([{"text": " check the weather."}]), None, 6),
        chunk(
            json!([{"functionCall": {"name": "get_weather", "args": {"city": "Oslo", "unit": "c"}}}]),
            None,
            14,
        ),
        chunk(json!([{"text": ""}]), Some("STOP"), 14),
    ];
    let bytes = sse(&chunks);
    (chunks, bytes)
}

fn run(bytes: &[u8], splits: &[usize]) -> Result<Vec<u8>, String> {
    let mut s = Stream::new("pub");
    let mut out = Vec::new();
    let mut from = 0;
    for &at in splits.iter().chain(std::iter::once(&bytes.len())) {
        s.feed(&bytes[from..at], &mut out)?;
        from = at;
    }
    s.end(&mut out)?;
    Ok(out)
}

fn events(out: &[u8]) -> Vec<(String, Value)> {
    decode_all(out)
        .unwrap()
        .into_iter()
        .map(|e| (e.event.unwrap(), serde_json::from_str(&e.data).unwrap()))
        .collect()
}

#[test]
fn stream_writes_the_anthropic_event_sequence() {
    let (_, bytes) = text_and_tool_stream();
    let evs = events(&run(&bytes, &[]).unwrap());
    let expected = vec![
        (
            "message_start",
            json!({"type": "message_start", "message": {
            "id": "msg_r1", "type": "message", "role": "assistant", "model": "pub", "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 20, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100, "output_tokens": 0}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me"}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " check the weather."}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_r1_0", "name": "get_weather", "input": {}}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"city\":\"Oslo\",\"unit\":\"c\"}"}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
            "usage": {"input_tokens": 20, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100, "output_tokens": 14}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ];
    let expected: Vec<(String, Value)> = expected
        .into_iter()
        .map(|(n, v)| (n.to_owned(), v))
        .collect();
    assert_eq!(evs, expected);
}

/// The stream, assembled as keel assembles a hub stream, is the whole answer of the same parts.
#[test]
fn stream_assembles_to_the_whole_answer() {
    let (chunks, bytes) = text_and_tool_stream();
    let out = run(&bytes, &[]).unwrap();
    let mut asm = Assembler::new();
    for ev in decode_all(&out).unwrap() {
        asm.push(Protocol::Anthropic, &ev).unwrap();
    }
    let assembled = asm.finish(Endpoint::Messages).to_value();
    let mut parts = Vec::new();
    for c in &chunks {
        parts.extend(
            c["candidates"][0]["content"]["parts"]
                .as_array()
                .unwrap()
                .clone(),
        );
    }
    let mut one = chunks.last().unwrap().clone();
    one["candidates"][0]["content"]["parts"] = Value::Array(parts);
    let whole_answer = hub_whole(one);
    assert_eq!(assembled["content"], whole_answer["content"]);
    assert_eq!(assembled["stop_reason"], whole_answer["stop_reason"]);
    assert_eq!(assembled["usage"], whole_answer["usage"]);
}

#[test]
fn stream_through_the_chat_translation_gives_openai_chunks() {
    let (_, bytes) = text_and_tool_stream();
    let out = run(&bytes, &[]).unwrap();
    let ctx = ResponseContext {
        json_tool: None,
        include_usage: true,
    };
    let mut chat = AnthropicToChatStream::new(ctx, "pub", 1);
    let mut chunks = Vec::new();
    for ev in decode_all(&out).unwrap() {
        chat.push(&ev, &mut chunks).unwrap();
    }
    assert!(chat.is_done());
    assert_eq!(chunks.last().unwrap().data, "[DONE]");
    let values: Vec<Value> = chunks[..chunks.len() - 1]
        .iter()
        .map(|c| serde_json::from_str(&c.data).unwrap())
        .collect();
    let text: String = values
        .iter()
        .filter_map(|v| {
            v.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(text, "Let me check the weather.");
    let call = values
        .iter()
        .find_map(|v| v.pointer("/choices/0/delta/tool_calls/0/id"))
        .unwrap();
    assert_eq!(call, "toolu_r1_0");
    let args: String = values
        .iter()
        .filter_map(|v| {
            v.pointer("/choices/0/delta/tool_calls/0/function/arguments")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(args, "{\"city\":\"Oslo\",\"unit\":\"c\"}");
    let finish: Vec<&Value> = values
        .iter()
        .filter_map(|v| {
            v.pointer("/choices/0/finish_reason")
                .filter(|f| !f.is_null())
        })
        .collect();
    assert_eq!(finish, vec!["tool_calls"]);
    let usage = values.last().unwrap()["usage"].clone();
    assert_eq!(
        usage,
        json!({"prompt_tokens": 120, "completion_tokens": 14, "total_tokens": 134,
               "prompt_tokens_details": {"cached_tokens": 100}})
    );
}

#[test]
fn stream_writes_thinking_blocks_with_their_signatures() {
    let bytes = sse(&[
        chunk(
            json!([{"text": "**Planning** the", "thought": true}]),
            None,
            0,
        ),
        chunk(json!([{"text": " answer.", "thought": true}]), None, 0),
        chunk(json!([{"text": "Four."}]), None, 1),
        chunk(
            json!([{"functionCall": {"name": "log", "args": {}}, "thoughtSignature": "U0lH"}]),
            Some("STOP"),
            3,
        ),
    ]);
    let evs = events(&run(&bytes, &[]).unwrap());
    let kinds: Vec<String> = evs
        .iter()
        .map(|(n, v)| {
            match v
                .pointer("/delta/type")
                .or(v.pointer("/content_block/type"))
            {
                Some(t) => format!("{n}:{}", t.as_str().unwrap()),
                None => n.clone(),
            }
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            "message_start",
            "content_block_start:thinking",
            "content_block_delta:thinking_delta",
            "content_block_delta:thinking_delta",
            "content_block_stop",
            "content_block_start:text",
            "content_block_delta:text_delta",
            "content_block_stop",
            "content_block_start:thinking",
            "content_block_delta:signature_delta",
            "content_block_stop",
            "content_block_start:tool_use",
            "content_block_delta:input_json_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert_eq!(evs[9].1["delta"]["signature"], "gemini:U0lH");
    assert_eq!(evs[9].1["index"], 2);
    assert_eq!(evs[12].1["delta"]["partial_json"], "{}");
    // Through the Chat translation the thinking is reasoning, the signature nothing.
    let mut chat = AnthropicToChatStream::new(ResponseContext::default(), "pub", 1);
    let mut chunks = Vec::new();
    for ev in decode_all(&run(&bytes, &[]).unwrap()).unwrap() {
        chat.push(&ev, &mut chunks).unwrap();
    }
    let reasoning: String = chunks
        .iter()
        .filter(|c| c.data != "[DONE]")
        .filter_map(|c| {
            serde_json::from_str::<Value>(&c.data)
                .unwrap()
                .pointer("/choices/0/delta/reasoning_content")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(reasoning, "**Planning** the answer.");
}

#[test]
fn stream_cut_before_its_finish_reason_has_no_message_stop() {
    let (_, bytes) = text_and_tool_stream();
    let cut_at = bytes.len() - 30; // inside the last event
    let out = run(&bytes[..cut_at], &[]).unwrap();
    let evs = decode_all(&out).unwrap();
    assert!(evs
        .iter()
        .all(|e| event_role(Protocol::Anthropic, e) != EventRole::Terminal));
    assert!(evs
        .iter()
        .all(|e| e.event.as_deref() != Some("message_delta")));
    // Cut between events: the same.
    let first_two = sse(&text_and_tool_stream().0[..2]);
    let evs = decode_all(&run(&first_two, &[]).unwrap()).unwrap();
    assert_eq!(
        evs.last().unwrap().event.as_deref(),
        Some("content_block_delta")
    );
}

#[test]
fn stream_error_event_becomes_the_hub_error_event() {
    let mut bytes = sse(&[chunk(json!([{"text": "Hi"}]), None, 1)]);
    bytes.extend_from_slice(
        &sse(&[json!({"error": {"code": 503, "message": "The model is overloaded. Please try again later.", "status": "UNAVAILABLE"}})]),
    );
    bytes.extend_from_slice(&sse(&[chunk(
        json!([{"text": "ignored"}]),
        Some("STOP"),
        2,
    )]));
    let out = run(&bytes, &[]).unwrap();
    let evs = decode_all(&out).unwrap();
    let last = evs.last().unwrap();
    assert_eq!(last.event.as_deref(), Some("error"));
    let v: Value = serde_json::from_str(&last.data).unwrap();
    assert_eq!(
        v,
        json!({"type": "error", "error": {"type": "overloaded_error",
            "message": "UNAVAILABLE: The model is overloaded. Please try again later."}})
    );
    assert!(matches!(
        event_role(Protocol::Anthropic, last),
        EventRole::Error(_)
    ));
    assert!(!out.windows(7).any(|w| w == b"ignored"));
}

#[test]
fn stream_of_a_blocked_prompt_is_a_refusal() {
    let bytes = sse(&[json!({
        "promptFeedback": {"blockReason": "PROHIBITED_CONTENT"},
        "usageMetadata": {"promptTokenCount": 9, "totalTokenCount": 9},
        "responseId": "b"
    })]);
    let evs = events(&run(&bytes, &[]).unwrap());
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        vec!["message_start", "message_delta", "message_stop"]
    );
    assert_eq!(evs[1].1["delta"]["stop_reason"], "refusal");
}

#[test]
fn malformed_stream_is_an_error() {
    assert!(run(b"data: {not json\r\n\r\n", &[]).is_err());
    assert!(run(b"bogus: x\r\n\r\n", &[]).is_err());
}

proptest! {
    /// Any split of the upstream bytes gives the same hub bytes.
    #[test]
    fn stream_output_does_not_depend_on_how_bytes_arrive(
        mut splits in proptest::collection::vec(0usize..2000, 0..12)
    ) {
        let (_, bytes) = text_and_tool_stream();
        for s in &mut splits {
            *s %= bytes.len() + 1;
        }
        splits.sort_unstable();
        prop_assert_eq!(run(&bytes, &splits).unwrap(), run(&bytes, &[]).unwrap());
    }
}

#[test]
fn stream_output_is_the_same_for_every_single_split_position() {
    let (_, bytes) = text_and_tool_stream();
    let one_piece = run(&bytes, &[]).unwrap();
    for at in 0..=bytes.len() {
        assert_eq!(run(&bytes, &[at]).unwrap(), one_piece, "split at {at}");
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

fn hub_error(status: u16, body: &str) -> Value {
    serde_json::from_slice(&error(status, body.as_bytes())).unwrap()
}

#[test]
fn errors_map_by_google_status_word() {
    let body = r#"{"error": {"code": 429, "message": "You exceeded your current quota.", "status": "RESOURCE_EXHAUSTED",
        "details": [{"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": []}]}}"#;
    assert_eq!(
        hub_error(429, body),
        json!({"type": "error", "error": {"type": "rate_limit_error",
            "message": "RESOURCE_EXHAUSTED: You exceeded your current quota."}})
    );
    for (status, word, kind) in [
        (503, "UNAVAILABLE", "overloaded_error"),
        (400, "INVALID_ARGUMENT", "invalid_request_error"),
        (400, "FAILED_PRECONDITION", "invalid_request_error"),
        (403, "PERMISSION_DENIED", "permission_error"),
        (401, "UNAUTHENTICATED", "authentication_error"),
        (404, "NOT_FOUND", "not_found_error"),
        (504, "DEADLINE_EXCEEDED", "timeout_error"),
        (500, "INTERNAL", "api_error"),
    ] {
        let body = json!({"error": {"code": status, "message": "m", "status": word}}).to_string();
        let v = hub_error(status, &body);
        assert_eq!(v["error"]["type"], kind, "{word}");
        assert_eq!(v["error"]["message"], format!("{word}: m"));
    }
    // AI Studio's bad API key is a 400 INVALID_ARGUMENT whose detail says what it is.
    let bad_key = r#"{"error": {"code": 400, "message": "API key not valid. Please pass a valid API key.",
        "status": "INVALID_ARGUMENT", "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": "API_KEY_INVALID", "domain": "googleapis.com"}]}}"#;
    assert_eq!(
        hub_error(400, bad_key)["error"]["type"],
        "authentication_error"
    );
    // The array form of the streaming method, and bodies that are not Google's.
    let array = r#"[{"error": {"code": 503, "message": "busy", "status": "UNAVAILABLE"}}]"#;
    assert_eq!(hub_error(503, array)["error"]["type"], "overloaded_error");
    let html = hub_error(502, "<html>Bad Gateway</html>");
    assert_eq!(html["error"]["type"], "api_error");
    assert_eq!(
        html["error"]["message"],
        "Gemini answered HTTP 502: <html>Bad Gateway</html>"
    );
    assert_eq!(hub_error(429, "")["error"]["type"], "rate_limit_error");
}

/// Plain text chunks are read and written without a JSON tree: the same bytes as the tree's.
#[test]
fn text_chunks_without_a_tree_write_what_the_tree_writes() {
    for text in [
        "plain",
        "a \"quote\", a \\ and\nnew line",
        "é ✓ \u{1F600}",
        "\u{0001}",
    ] {
        let mut fast = Vec::new();
        write_text_delta(&mut fast, 3, text);
        let mut tree = Vec::new();
        push_event(
            &mut tree,
            Some("content_block_delta"),
            &json!({"type": "content_block_delta", "index": 3, "delta": {"type": "text_delta", "text": text}}),
        );
        assert_eq!(
            String::from_utf8(fast).unwrap(),
            String::from_utf8(tree).unwrap()
        );
    }
    // Escaped text in the upstream chunk (not borrowable) reads the same.
    let bytes = sse(&[
        chunk(json!([{"text": "A"}]), None, 1),
        chunk(json!([{"text": "\"q\"\n\u{e9}"}, {"text": "!"}]), None, 2),
        chunk(json!([{"text": "B", "thought": true}]), None, 3),
        chunk(json!([{"text": "C"}]), Some("MAX_TOKENS"), 4),
    ]);
    let texts: Vec<Value> = events(&run(&bytes, &[]).unwrap())
        .into_iter()
        .filter_map(|(_, v)| {
            v.pointer("/delta/text")
                .or(v.pointer("/delta/thinking"))
                .cloned()
        })
        .collect();
    assert_eq!(
        texts,
        vec![
            json!("A"),
            json!("\"q\"\n\u{e9}"),
            json!("!"),
            json!("B"),
            json!("C")
        ]
    );
}

/// One generated part of a stream chunk.
fn arb_part() -> impl Strategy<Value = Value> {
    let text = "[a-z \"\\\\é]{0,6}";
    prop_oneof![
        4 => text.prop_map(|t| json!({"text": t})),
        2 => text.prop_map(|t| json!({"text": t, "thought": true})),
        1 => text.prop_map(|t| json!({"text": t, "thought": true, "thoughtSignature": "U0lH"})),
        1 => "[a-z]{1,4}".prop_map(|n| json!({"functionCall": {"name": n, "args": {"k": n}}})),
        1 => "[a-z]{1,4}".prop_map(|n| json!({"functionCall": {"name": n}, "thoughtSignature": "Q0FMTA=="})),
        1 => Just(json!({"thoughtSignature": "T05MWQ=="})),
    ]
}

proptest! {
    /// Whatever parts a stream holds, the hub events are a well-formed Anthropic stream: one
    /// `message_start`, blocks started, written and stopped in order, one end; the Chat
    /// translation reads it to `[DONE]`; and its text and tool calls are the whole answer's.
    #[test]
    fn any_stream_is_a_well_formed_hub_stream(
        chunks in proptest::collection::vec(proptest::collection::vec(arb_part(), 0..3), 1..8),
        finish in prop_oneof![Just("STOP"), Just("MAX_TOKENS"), Just("SAFETY")],
        split in 0usize..4000,
    ) {
        let n = chunks.len();
        let chunks: Vec<Value> = chunks
            .into_iter()
            .enumerate()
            .map(|(i, parts)| chunk(Value::Array(parts), (i + 1 == n).then_some(finish), i as u64))
            .collect();
        let bytes = sse(&chunks);
        let out = run(&bytes, &[]).unwrap();
        prop_assert_eq!(&run(&bytes, &[split % (bytes.len() + 1)]).unwrap(), &out);

        let evs = decode_all(&out).unwrap();
        prop_assert_eq!(evs[0].event.as_deref(), Some("message_start"));
        let mut open: Option<u64> = None;
        let mut next = 0u64;
        let mut ends = 0;
        for ev in &evs[1..] {
            let v: Value = serde_json::from_str(&ev.data).unwrap();
            match ev.event.as_deref().unwrap() {
                "content_block_start" => {
                    prop_assert!(open.is_none());
                    prop_assert_eq!(v["index"].as_u64(), Some(next));
                    open = Some(next);
                    next += 1;
                }
                "content_block_delta" => prop_assert_eq!(v["index"].as_u64(), open),
                "content_block_stop" => {
                    prop_assert_eq!(v["index"].as_u64(), open);
                    open = None;
                }
                "message_delta" => {
                    prop_assert!(open.is_none());
                    prop_assert_eq!(ends, 0);
                    ends += 1;
                }
                "message_stop" => {
                    prop_assert_eq!(ends, 1);
                    ends += 1;
                }
                other => prop_assert!(false, "unexpected event {}", other),
            }
        }
        prop_assert_eq!(ends, 2);

        let mut chat = AnthropicToChatStream::new(ResponseContext::default(), "pub", 1);
        let mut chat_out = Vec::new();
        let mut asm = Assembler::new();
        for ev in &evs {
            chat.push(ev, &mut chat_out).unwrap();
            asm.push(Protocol::Anthropic, ev).unwrap();
        }
        prop_assert!(chat.is_done());

        let mut parts = Vec::new();
        for c in &chunks {
            parts.extend(c["candidates"][0]["content"]["parts"].as_array().unwrap().clone());
        }
        let mut one = chunks.last().unwrap().clone();
        one["candidates"][0]["content"]["parts"] = Value::Array(parts);
        let whole_answer = hub_whole(one);
        let visible = |content: &Value| -> Vec<Value> {
            content
                .as_array()
                .unwrap()
                .iter()
                .filter(|b| b["type"] != "thinking")
                .cloned()
                .collect()
        };
        let assembled = asm.finish(Endpoint::Messages).to_value();
        prop_assert_eq!(visible(&assembled["content"]), visible(&whole_answer["content"]));
        prop_assert_eq!(&assembled["stop_reason"], &whole_answer["stop_reason"]);
    }
}

// ---------------------------------------------------------------------------------------------
// Streams as Gemini writes them (CRLF-framed `alt=sse` bodies, the fields of the real service)

const TEXT_STREAM: &[u8] = include_bytes!("fixtures/gemini_stream_text.sse");
const CALL_STREAM: &[u8] = include_bytes!("fixtures/gemini_stream_function_call.sse");

#[test]
fn fixture_text_stream_reaches_a_chat_client_whole() {
    let out = run(TEXT_STREAM, &[]).unwrap();
    let evs = decode_all(&out).unwrap();
    assert_eq!(
        event_role(Protocol::Anthropic, evs.last().unwrap()),
        EventRole::Terminal
    );
    let ctx = ResponseContext {
        json_tool: None,
        include_usage: true,
    };
    let mut chat = AnthropicToChatStream::new(ctx, "pub", 1);
    let mut chunks = Vec::new();
    for ev in &evs {
        chat.push(ev, &mut chunks).unwrap();
    }
    let values: Vec<Value> = chunks
        .iter()
        .filter(|c| c.data != "[DONE]")
        .map(|c| serde_json::from_str(&c.data).unwrap())
        .collect();
    let field = |name: &str| -> String {
        values
            .iter()
            .filter_map(|v| {
                v.pointer(&format!("/choices/0/delta/{name}"))
                    .and_then(Value::as_str)
            })
            .collect()
    };
    assert_eq!(
        field("reasoning_content"),
        "**Weighing the question**\n\nThe user wants a one-line answer."
    );
    assert_eq!(
        field("content"),
        "Keel routes each request to the replica most likely to answer first — \"p2c\" on measured latency."
    );
    assert_eq!(
        values.last().unwrap()["usage"],
        json!({"prompt_tokens": 31, "completion_tokens": 233, "total_tokens": 264,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    assert_eq!(chunks.last().unwrap().data, "[DONE]");
}

#[test]
fn fixture_function_call_stream_is_a_signed_tool_use() {
    let evs = events(&run(CALL_STREAM, &[]).unwrap());
    let blocks: Vec<&Value> = evs
        .iter()
        .filter(|(n, _)| n == "content_block_start")
        .map(|(_, v)| &v["content_block"])
        .collect();
    assert_eq!(
        blocks,
        vec![
            &json!({"type": "thinking", "thinking": "", "signature": ""}),
            &json!({"type": "tool_use", "id": "toolu_qpc2afWVFJK4vr0Pq6WiyAU_0", "name": "get_weather", "input": {}})
        ]
    );
    let deltas: Vec<&Value> = evs
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, v)| &v["delta"])
        .collect();
    assert_eq!(
        deltas,
        vec![
            &json!({"type": "signature_delta", "signature": "gemini:CiQBcsjafP2mT1ghQkZl0nFXc3lnbmF0dXJlLWZvci10ZXN0cw=="}),
            &json!({"type": "input_json_delta", "partial_json": "{\"city\":\"Tokyo\",\"unit\":\"celsius\"}"})
        ]
    );
    let (name, last_delta) = &evs[evs.len() - 2];
    assert_eq!(name, "message_delta");
    assert_eq!(last_delta["delta"]["stop_reason"], "tool_use");
    assert_eq!(
        last_delta["usage"],
        json!({"input_tokens": 83, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 118})
    );
}
