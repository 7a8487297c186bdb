//! Dialect reading and writing without a server: routes, requests as hub bodies, rendered
//! answers, credentials.

use base64::Engine;
use serde_json::{json, Value};

use super::*;
use crate::text::Finish;
use crate::wire::{Piece, Reply, ToolCall};

fn route_of(path: &str) -> Route {
    route(path).unwrap_or_else(|| panic!("{path} is a dialect route"))
}

#[test]
fn routes_name_the_dialect_model_and_stream() {
    let r = route_of("/openai/deployments/gpt-4o-mini/chat/completions");
    assert_eq!(
        (r.dialect, r.model.as_deref(), r.stream),
        (Dialect::Azure, Some("gpt-4o-mini"), false)
    );
    assert_eq!(
        route_of("/openai/v1/chat/completions").model,
        None,
        "Azure's v1 path: the model is in the body"
    );
    let r = route_of("/v1beta/models/gemini-2.0-flash:streamGenerateContent");
    assert_eq!(
        (r.dialect, r.model.as_deref(), r.stream),
        (
            Dialect::Gemini { vertex: false },
            Some("gemini-2.0-flash"),
            true
        )
    );
    let r = route_of(
        "/v1beta1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-pro:generateContent",
    );
    assert_eq!(
        (r.dialect, r.model.as_deref(), r.stream),
        (
            Dialect::Gemini { vertex: true },
            Some("gemini-2.5-pro"),
            false
        )
    );
    let r = route_of(
        "/v1/projects/p/locations/us-east5/publishers/anthropic/models/claude-sonnet-4@20250514:streamRawPredict",
    );
    assert_eq!(
        (r.dialect, r.model.as_deref(), r.stream),
        (
            Dialect::VertexClaude,
            Some("claude-sonnet-4@20250514"),
            true
        )
    );
    let r = route_of("/model/anthropic.claude-3-5-sonnet-20240620-v1%3A0/converse-stream");
    assert_eq!(
        (r.dialect, r.model.as_deref(), r.stream),
        (
            Dialect::Bedrock,
            Some("anthropic.claude-3-5-sonnet-20240620-v1:0"),
            true
        ),
        "the model id is percent-decoded"
    );
    assert_eq!(route_of("/v1/responses").dialect, Dialect::Responses);
    for not_a_dialect in [
        "/v1/chat/completions",
        "/v1/messages",
        "/model/x/invoke",
        "/v1beta/models/x:countTokens",
        "/v1/projects/p/locations/l/publishers/meta/models/x:rawPredict",
        "/openai/deployments//chat/completions",
    ] {
        assert_eq!(route(not_a_dialect), None, "{not_a_dialect}");
    }
}

#[test]
fn gemini_request_reads_as_anthropic_messages() {
    let body = json!({
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "contents": [
            {"role": "user", "parts": [{"text": "Weather in Oslo?"},
                {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}}]},
            {"role": "model", "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "get_weather", "response": {"sky": "clear"}}}]},
            {"role": "model", "parts": [{"text": "It is"}]}
        ],
        "tools": [{"functionDeclarations": [{"name": "get_weather", "description": "Weather",
            "parameters": {"type": "OBJECT", "properties": {"city": {"type": "STRING"}}}}]}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}},
        "generation_config": {"max_output_tokens": 50, "temperature": 0.2, "topK": 3, "stopSequences": ["END"]}
    });
    let hub = to_hub(
        &route_of("/v1beta/models/gemini-2.0-flash:generateContent"),
        &body,
    )
    .unwrap()
    .body;
    assert_eq!(hub["model"], "gemini-2.0-flash");
    assert_eq!(hub["stream"], false);
    assert_eq!(
        hub["system"],
        json!([{"type": "text", "text": "Be brief."}])
    );
    assert_eq!(hub["max_tokens"], 50, "snake_case names are read too");
    assert_eq!(hub["temperature"], 0.2);
    assert_eq!(hub["top_k"], 3);
    assert_eq!(hub["stop_sequences"], json!(["END"]));
    let m = &hub["messages"];
    assert_eq!(m[0]["content"][1]["source"]["media_type"], "image/png");
    assert_eq!(m[1]["role"], "assistant");
    assert_eq!(m[1]["content"][0]["type"], "tool_use");
    assert_eq!(m[1]["content"][0]["input"], json!({"city": "Oslo"}));
    assert_eq!(m[2]["content"][0]["type"], "tool_result");
    assert_eq!(m[2]["content"][0]["tool_use_id"], m[1]["content"][0]["id"]);
    assert_eq!(
        m[3],
        json!({"role": "assistant", "content": [{"type": "text", "text": "It is"}]}),
        "a trailing model turn is the hub's prefill"
    );
    assert_eq!(
        hub["tools"][0]["input_schema"]["properties"]["city"]["type"],
        "string"
    );
    assert_eq!(
        hub["tool_choice"],
        json!({"type": "tool", "name": "get_weather"})
    );
    let sreq = crate::wire::parse_request(
        keel_core::protocol::Endpoint::Messages,
        &hub,
        Default::default(),
    )
    .unwrap();
    assert_eq!(sreq.prefill, "It is");

    let err = to_hub(
        &route_of("/v1beta/models/g:generateContent"),
        &json!({"contents": []}),
    )
    .unwrap_err();
    assert!(err.starts_with("contents"), "{err}");
}

#[test]
fn gemini_request_errors_name_the_field_and_thoughts_are_left_out() {
    let route = route_of("/v1beta/models/gemini-2.0-flash:streamGenerateContent");
    let err = |body: Value| to_hub(&route, &body).err().unwrap_or_default();
    assert_eq!(err(json!({})), "contents: required");
    assert_eq!(err(json!({"contents": []})), "contents: must not be empty");
    assert!(err(json!({"contents": [{"role": "system", "parts": []}]}))
        .starts_with("contents[0].role: Please use a valid role"));
    assert_eq!(
        err(json!({"contents": [{"role": "user"}]})),
        "contents[0].parts: required"
    );
    assert_eq!(
        err(json!({"contents": [{"parts": [{"text": "a"}, "b"]}]})),
        "contents[0].parts[1]: must be an object"
    );
    assert_eq!(
        err(
            json!({"contents": [{"parts": [{"text": "a"}]}], "generationConfig": {"candidateCount": 2}})
        ),
        "generationConfig.candidateCount: only 1 is supported"
    );
    let body = json!({"contents": [{"role": "model", "parts": [
            {"text": "plan", "thought": true}, {"text": "answer"}, {"fileData": {}}, {}]}],
        "generationConfig": {"responseMimeType": "application/json"},
        "toolConfig": {"function_calling_config": {"mode": "NONE"}}});
    let hub = to_hub(&route, &body).unwrap();
    assert_eq!(
        hub.body["messages"][0]["content"],
        json!([{"type": "text", "text": "answer"}, {"type": "fileData"}])
    );
    assert_eq!(hub.body["max_tokens"], 8192);
    assert_eq!(hub.body["stream"], true);
    assert_eq!(hub.body["tool_choice"], json!({"type": "none"}));
    assert!(hub.body.get("tools").is_none());
    assert_eq!(
        hub.schema,
        Some(json!({"type": "object"})),
        "a JSON MIME type alone: any object"
    );
    let schema = json!({"type": "OBJECT", "properties": {"n": {"type": "INTEGER"}}});
    let body = json!({"contents": [{"parts": [{"text": "a"}]}],
        "generationConfig": {"responseSchema": schema}});
    assert_eq!(
        to_hub(&route, &body).unwrap().schema,
        Some(json!({"type": "object", "properties": {"n": {"type": "integer"}}}))
    );
}

#[test]
fn bedrock_request_reads_as_anthropic_messages() {
    let body = json!({
        "system": [{"text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"text": "Weather?"},
                {"image": {"format": "jpeg", "source": {"bytes": "/9j/"}}}]},
            {"role": "assistant", "content": [{"toolUse": {"toolUseId": "t1", "name": "get_weather", "input": {"city": "Oslo"}}}]},
            {"role": "user", "content": [{"toolResult": {"toolUseId": "t1", "content": [{"json": {"sky": "clear"}}], "status": "error"}}]}
        ],
        "inferenceConfig": {"maxTokens": 20, "topP": 0.5, "stopSequences": ["X"]},
        "additionalModelRequestFields": {"top_k": 5},
        "toolConfig": {"tools": [{"toolSpec": {"name": "get_weather", "inputSchema": {"json": {"type": "object"}}}}],
            "toolChoice": {"tool": {"name": "get_weather"}}}
    });
    let hub = to_hub(&route_of("/model/m/converse-stream"), &body)
        .unwrap()
        .body;
    assert_eq!(hub["stream"], true);
    assert_eq!(hub["max_tokens"], 20);
    assert_eq!(hub["top_p"], 0.5);
    assert_eq!(hub["top_k"], 5);
    assert_eq!(hub["stop_sequences"], json!(["X"]));
    let m = &hub["messages"];
    assert_eq!(m[0]["content"][1]["source"]["media_type"], "image/jpeg");
    assert_eq!(
        m[1]["content"][0],
        json!({"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}})
    );
    assert_eq!(m[2]["content"][0]["content"], "{\"sky\":\"clear\"}");
    assert_eq!(m[2]["content"][0]["is_error"], true);
    assert_eq!(
        hub["tools"][0],
        json!({"name": "get_weather", "input_schema": {"type": "object"}})
    );
    assert_eq!(
        hub["tool_choice"],
        json!({"type": "tool", "name": "get_weather"})
    );
}

#[test]
fn responses_request_reads_as_chat_with_a_prefill() {
    let body = json!({"model": "gpt-4o", "instructions": "Be brief.", "store": false,
        "max_output_tokens": 30, "stream": true,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is"}]}
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}});
    let hub = to_hub(&route_of("/v1/responses"), &body).unwrap().body;
    assert_eq!(
        hub["messages"][0],
        json!({"role": "system", "content": "Be brief."})
    );
    assert_eq!(
        hub["messages"][2]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    assert_eq!(hub["messages"][3]["role"], "tool");
    assert_eq!(hub["messages"][4]["role"], "assistant");
    assert_eq!(hub["continue_final_message"], true);
    assert_eq!(hub["max_completion_tokens"], 30);
    assert_eq!(
        hub["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
    assert_eq!(hub["response_format"]["type"], "json_schema");
    let sreq = crate::wire::parse_request(
        keel_core::protocol::Endpoint::ChatCompletions,
        &hub,
        Default::default(),
    )
    .unwrap();
    assert_eq!(sreq.prefill, "It is");

    let err = to_hub(
        &route_of("/v1/responses"),
        &json!({"model": "m", "input": "x", "previous_response_id": "resp_1"}),
    )
    .unwrap_err();
    assert!(err.contains("resp_1"), "{err}");
}

#[test]
fn vertex_claude_wants_anthropic_version_and_no_model() {
    let r = route_of("/v1/projects/p/locations/l/publishers/anthropic/models/claude-x:rawPredict");
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let err = to_hub(&r, &json!({"max_tokens": 5, "messages": msgs})).unwrap_err();
    assert!(err.contains("anthropic_version"), "{err}");
    let err = to_hub(
        &r,
        &json!({"anthropic_version": "vertex-2023-10-16", "model": "m", "max_tokens": 5, "messages": msgs}),
    )
    .unwrap_err();
    assert!(err.starts_with("model"), "{err}");
    let hub = to_hub(
        &r,
        &json!({"anthropic_version": "vertex-2023-10-16", "max_tokens": 5, "messages": msgs}),
    )
    .unwrap()
    .body;
    assert_eq!(hub["model"], "claude-x");
    assert!(hub.get("anthropic_version").is_none());
}

fn reply(endpoint: keel_core::protocol::Endpoint, tool: bool) -> Reply {
    let tool_call = tool.then(|| ToolCall {
        id: "toolu_00000000000000ab".into(),
        name: "get_weather".into(),
        arguments: "{\"city\":\"Oslo and Bergen\"}".into(),
    });
    let pieces = match &tool_call {
        Some(tc) => tc
            .arguments
            .as_bytes()
            .chunks(12)
            .map(|c| Piece::ToolArgs(String::from_utf8_lossy(c).into_owned()))
            .collect(),
        None => vec![
            Piece::Text("The".into()),
            Piece::Text(" harbour".into()),
            Piece::Text(" wakes".into()),
        ],
    };
    Reply {
        endpoint,
        id: if endpoint == keel_core::protocol::Endpoint::Messages {
            "msg_00000000000000ab".into()
        } else {
            "chatcmpl-00000000000000ab".into()
        },
        model: "m".into(),
        created: 1,
        include_usage: true,
        pieces,
        tool_call,
        finish: Finish::Natural,
        prompt_tokens: 10,
        cached_tokens: 4,
        completion_tokens: 3,
    }
}

/// The whole stream of a reply as a renderer writes it.
fn render_stream(shape: Shape, reply: &Reply) -> Vec<u8> {
    let mut r = Renderer::new(shape);
    let mut out = r.head(reply);
    for (i, p) in reply.pieces.iter().enumerate() {
        out.extend(r.piece(reply, i, p));
    }
    out.extend(r.tail(reply));
    out
}

/// Gemini's stream events: `data:` JSON separated by CRLF blank lines.
fn gemini_events(bytes: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(bytes).unwrap();
    assert!(text.ends_with("\r\n\r\n"));
    text.split("\r\n\r\n")
        .filter(|e| !e.is_empty())
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect()
}

#[test]
fn gemini_answers_whole_and_streamed() {
    let shape = Shape::Dialect(Dialect::Gemini { vertex: false });
    let r = reply(keel_core::protocol::Endpoint::Messages, false);
    let whole: Value = serde_json::from_slice(&Renderer::new(shape).whole(&r)).unwrap();
    assert_eq!(
        whole["candidates"][0]["content"],
        json!({"role": "model", "parts": [{"text": "The harbour wakes"}]})
    );
    assert_eq!(whole["candidates"][0]["finishReason"], "STOP");
    assert_eq!(whole["usageMetadata"]["promptTokenCount"], 10);
    assert_eq!(whole["usageMetadata"]["candidatesTokenCount"], 3);
    assert_eq!(whole["usageMetadata"]["cachedContentTokenCount"], 4);

    let events = gemini_events(&render_stream(shape, &r));
    let text: String = events
        .iter()
        .filter_map(|e| e["candidates"][0]["content"]["parts"][0]["text"].as_str())
        .collect();
    assert_eq!(text, "The harbour wakes");
    let (last, before) = events.split_last().unwrap();
    assert_eq!(last["candidates"][0]["finishReason"], "STOP");
    assert_eq!(last["usageMetadata"]["candidatesTokenCount"], 3);
    assert!(before
        .iter()
        .all(|e| e["candidates"][0].get("finishReason").is_none()));

    let mut long = r.clone();
    long.finish = Finish::Length;
    let whole: Value = serde_json::from_slice(&Renderer::new(shape).whole(&long)).unwrap();
    assert_eq!(whole["candidates"][0]["finishReason"], "MAX_TOKENS");

    // A function call arrives whole in one chunk.
    let t = reply(keel_core::protocol::Endpoint::Messages, true);
    let events = gemini_events(&render_stream(shape, &t));
    assert_eq!(events.len(), 2);
    assert_eq!(
        events[0]["candidates"][0]["content"]["parts"][0]["functionCall"],
        json!({"name": "get_weather", "args": {"city": "Oslo and Bergen"}})
    );
}

/// Bedrock's event-stream frames: (message type, event or exception type, payload).
fn bedrock_frames(bytes: &[u8]) -> Result<Vec<(String, String, Value)>, String> {
    use aws_smithy_eventstream::frame::{DecodedFrame, MessageFrameDecoder};
    let mut buf = bytes::Bytes::copy_from_slice(bytes);
    let mut decoder = MessageFrameDecoder::new();
    let mut out = Vec::new();
    loop {
        match decoder.decode_frame(&mut buf).map_err(|e| e.to_string())? {
            DecodedFrame::Complete(m) => {
                let header = |n: &str| {
                    m.headers()
                        .iter()
                        .find(|h| h.name().as_str() == n)
                        .and_then(|h| h.value().as_string().ok())
                        .map(|s| s.as_str().to_owned())
                        .unwrap_or_default()
                };
                let kind = header(":message-type");
                let name = if kind == "event" {
                    header(":event-type")
                } else {
                    header(":exception-type")
                };
                out.push((
                    kind,
                    name,
                    serde_json::from_slice(m.payload()).map_err(|e| e.to_string())?,
                ));
            }
            DecodedFrame::Incomplete => return Ok(out),
        }
    }
}

#[test]
fn bedrock_answers_whole_and_as_event_stream_frames() {
    let shape = Shape::Dialect(Dialect::Bedrock);
    let r = reply(keel_core::protocol::Endpoint::Messages, false);
    let whole: Value = serde_json::from_slice(&Renderer::new(shape).whole(&r)).unwrap();
    assert_eq!(
        whole["output"]["message"],
        json!({"role": "assistant", "content": [{"text": "The harbour wakes"}]})
    );
    assert_eq!(whole["stopReason"], "end_turn");
    assert_eq!(
        whole["usage"],
        json!({"inputTokens": 10, "outputTokens": 3, "totalTokens": 13,
            "cacheReadInputTokens": 4, "cacheWriteInputTokens": 0})
    );
    let frames = bedrock_frames(&render_stream(shape, &r)).unwrap();
    let names: Vec<&str> = frames.iter().map(|f| f.1.as_str()).collect();
    assert_eq!(
        names,
        [
            "messageStart",
            "contentBlockDelta",
            "contentBlockDelta",
            "contentBlockDelta",
            "contentBlockStop",
            "messageStop",
            "metadata"
        ]
    );
    assert_eq!(frames[1].2["delta"]["text"], "The");
    assert_eq!(frames[5].2["stopReason"], "end_turn");
    assert_eq!(frames[6].2["usage"]["outputTokens"], 3);

    let t = reply(keel_core::protocol::Endpoint::Messages, true);
    let frames = bedrock_frames(&render_stream(shape, &t)).unwrap();
    assert_eq!(frames[1].1, "contentBlockStart");
    assert_eq!(frames[1].2["start"]["toolUse"]["name"], "get_weather");
    let args: String = frames
        .iter()
        .filter(|f| f.1 == "contentBlockDelta")
        .map(|f| {
            f.2["delta"]["toolUse"]["input"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(args, "{\"city\":\"Oslo and Bergen\"}");
    assert_eq!(frames.last().unwrap().0, "event");
    assert_eq!(frames[frames.len() - 2].2["stopReason"], "tool_use");

    let mut renderer = Renderer::new(shape);
    let frames = bedrock_frames(&renderer.stream_error(429)).unwrap();
    assert_eq!(
        (frames[0].0.as_str(), frames[0].1.as_str()),
        ("exception", "throttlingException")
    );
    let frames = bedrock_frames(&renderer.stream_error(500)).unwrap();
    assert_eq!(frames[0].1, "internalServerException");
    assert!(
        bedrock_frames(&renderer.malformed()).is_err(),
        "a malformed frame fails its checksum"
    );
}

/// SSE events (name, data) of a renderer's output.
fn sse(bytes: &[u8]) -> Vec<(Option<String>, String)> {
    keel_core::sse::decode_all(bytes)
        .unwrap()
        .into_iter()
        .map(|e| (e.event, e.data))
        .collect()
}

#[test]
fn responses_answer_whole_and_streamed() {
    let shape = Shape::Dialect(Dialect::Responses);
    let r = reply(keel_core::protocol::Endpoint::ChatCompletions, false);
    let whole: Value = serde_json::from_slice(&Renderer::new(shape).whole(&r)).unwrap();
    assert_eq!(whole["object"], "response");
    assert_eq!(whole["id"], "resp_00000000000000ab");
    assert_eq!(whole["status"], "completed");
    assert_eq!(
        whole["output"][0]["content"][0]["text"],
        "The harbour wakes"
    );
    assert_eq!(whole["usage"]["input_tokens_details"]["cached_tokens"], 4);

    let events = sse(&render_stream(shape, &r));
    let names: Vec<&str> = events.iter().map(|e| e.0.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (name, data)) in events.iter().enumerate() {
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"], name.as_deref().unwrap());
        assert_eq!(v["sequence_number"], i);
    }

    let mut long = r.clone();
    long.finish = Finish::Length;
    let events = sse(&render_stream(shape, &long));
    let last: Value = serde_json::from_str(&events.last().unwrap().1).unwrap();
    assert_eq!(last["type"], "response.incomplete");
    assert_eq!(
        last["response"]["incomplete_details"]["reason"],
        "max_output_tokens"
    );

    let t = reply(keel_core::protocol::Endpoint::ChatCompletions, true);
    let whole: Value = serde_json::from_slice(&Renderer::new(shape).whole(&t)).unwrap();
    assert_eq!(whole["output"][0]["type"], "function_call");
    assert_eq!(whole["output"][0]["call_id"], "toolu_00000000000000ab");
    assert_eq!(
        whole["output"][0]["arguments"],
        "{\"city\":\"Oslo and Bergen\"}"
    );
    let events = sse(&render_stream(shape, &t));
    assert!(events
        .iter()
        .any(|e| e.0.as_deref() == Some("response.function_call_arguments.done")));
}

#[test]
fn azure_adds_its_filter_results() {
    let shape = Shape::Dialect(Dialect::Azure);
    let r = reply(keel_core::protocol::Endpoint::ChatCompletions, false);
    let whole: Value = serde_json::from_slice(&Renderer::new(shape).whole(&r)).unwrap();
    assert_eq!(whole["prompt_filter_results"][0]["prompt_index"], 0);
    assert_eq!(
        whole["choices"][0]["content_filter_results"]["hate"]["filtered"],
        false
    );
    let events = sse(&render_stream(shape, &r));
    let first: Value = serde_json::from_str(&events[0].1).unwrap();
    assert_eq!(first["choices"], json!([]));
    assert!(first["prompt_filter_results"].is_array());
    let second: Value = serde_json::from_str(&events[1].1).unwrap();
    assert_eq!(second["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(second["choices"][0]["content_filter_results"], json!({}));
    let third: Value = serde_json::from_str(&events[2].1).unwrap();
    assert_eq!(third["choices"][0]["delta"]["content"], "The");
    assert_eq!(
        third["choices"][0]["content_filter_results"]["violence"]["severity"],
        "safe"
    );
    assert_eq!(events.last().unwrap().1, "[DONE]");
}

#[test]
fn errors_are_in_each_dialects_shape() {
    let (status, _, body) = error_response(Dialect::Gemini { vertex: false }, 429, "quota");
    assert_eq!(status, 429);
    assert_eq!(
        body,
        json!({"error": {"code": 429, "message": "quota", "status": "RESOURCE_EXHAUSTED"}})
    );
    let (_, _, body) = error_response(Dialect::Gemini { vertex: true }, 503, "m");
    assert_eq!(body["error"]["status"], "UNAVAILABLE");
    let (_, headers, body) = error_response(Dialect::Bedrock, 429, "slow down");
    assert_eq!(body, json!({"message": "slow down"}));
    assert_eq!(headers[0].0, "x-amzn-errortype");
    assert!(headers[0].1.starts_with("ThrottlingException:"));
    let (_, headers, _) = error_response(Dialect::Bedrock, 503, "m");
    assert!(headers[0].1.starts_with("ServiceUnavailableException:"));
    let (_, _, body) = error_response(Dialect::Azure, 429, "m");
    assert_eq!(body, json!({"error": {"code": "429", "message": "m"}}));
    let (_, _, body) = error_response(Dialect::VertexClaude, 429, "m");
    assert_eq!(body["error"]["status"], "RESOURCE_EXHAUSTED");
    let (_, _, body) = error_response(Dialect::VertexClaude, 529, "m");
    assert_eq!(body["error"]["type"], "overloaded_error");
    let (_, _, body) = error_response(Dialect::Responses, 429, "m");
    assert_eq!(body["error"]["type"], "rate_limit_error");
}

#[test]
fn sigv4_shape_and_service_are_checked() {
    let good = "AWS4-HMAC-SHA256 Credential=AKID/20250101/us-east-1/bedrock/aws4_request, SignedHeaders=content-type;host;x-amz-date, Signature=".to_owned()
        + &"a1".repeat(32);
    assert_eq!(
        bedrock::check_sigv4(&good, Some("20250101T000000Z")),
        Ok(())
    );
    assert!(bedrock::check_sigv4(&good, None).is_err(), "no date");
    let s3 = good.replace("/bedrock/", "/s3/");
    assert!(bedrock::check_sigv4(&s3, Some("x"))
        .unwrap_err()
        .contains("bedrock"));
    let short = good.replace(&"a1".repeat(32), "abc");
    assert!(bedrock::check_sigv4(&short, Some("x")).is_err());
    assert!(bedrock::check_sigv4("Basic abc", Some("x")).is_err());
}

fn jwt(header: Value, claims: Value) -> String {
    let e = |v: &Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
    format!("{}.{}.c2ln", e(&header), e(&claims))
}

#[test]
fn jwt_grant_claims_are_checked() {
    let url = "http://127.0.0.1:9/token";
    let claims = json!({"iss": "sa@p.iam.gserviceaccount.com",
        "scope": "https://www.googleapis.com/auth/cloud-platform",
        "aud": url, "iat": 1000, "exp": 4600});
    let form = |claims: &Value| {
        format!(
            "grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer&assertion={}",
            jwt(json!({"alg": "RS256", "typ": "JWT"}), claims.clone())
        )
    };
    assert_eq!(vertex::check_grant(&form(&claims), url, 1100), Ok(()));
    let mut google_aud = claims.clone();
    google_aud["aud"] = json!("https://oauth2.googleapis.com/token");
    assert_eq!(
        vertex::check_grant(&form(&google_aud), url, 1100),
        Ok(()),
        "google-auth's audience"
    );
    let mut wrong_aud = claims.clone();
    wrong_aud["aud"] = json!("https://elsewhere.example/token");
    assert_eq!(
        vertex::check_grant(&form(&wrong_aud), url, 1100)
            .unwrap_err()
            .0,
        "invalid_grant"
    );
    let mut no_scope = claims.clone();
    no_scope.as_object_mut().unwrap().remove("scope");
    assert_eq!(
        vertex::check_grant(&form(&no_scope), url, 1100)
            .unwrap_err()
            .0,
        "invalid_scope"
    );
    let mut too_long = claims.clone();
    too_long["exp"] = json!(9000);
    assert!(vertex::check_grant(&form(&too_long), url, 1100).is_err());
    assert!(
        vertex::check_grant(&form(&claims), url, 99_999).is_err(),
        "expired"
    );
    assert_eq!(
        vertex::check_grant("grant_type=password", url, 1100)
            .unwrap_err()
            .0,
        "unsupported_grant_type"
    );
}

#[test]
fn a_refusal_is_each_dialects_safety_stop() {
    use keel_core::protocol::Endpoint;
    let mut m = reply(Endpoint::Messages, false);
    m.refuse(1);
    assert_eq!(m.pieces.len(), 1);
    assert_eq!(m.completion_tokens, 1);
    let render = |shape: Shape, r: &Reply| -> Value {
        serde_json::from_slice(&Renderer::new(shape).whole(r)).unwrap()
    };
    assert_eq!(
        render(Shape::Hub(keel_core::protocol::Protocol::Anthropic), &m)["stop_reason"],
        "refusal"
    );
    assert_eq!(
        render(Shape::Dialect(Dialect::Gemini { vertex: true }), &m)["candidates"][0]
            ["finishReason"],
        "SAFETY"
    );
    assert_eq!(
        render(Shape::Dialect(Dialect::Bedrock), &m)["stopReason"],
        "content_filtered"
    );
    let frames = bedrock_frames(&render_stream(Shape::Dialect(Dialect::Bedrock), &m)).unwrap();
    assert_eq!(frames[frames.len() - 2].2["stopReason"], "content_filtered");

    let mut c = reply(Endpoint::ChatCompletions, false);
    c.refuse(1);
    assert_eq!(
        render(Shape::Dialect(Dialect::Azure), &c)["choices"][0]["finish_reason"],
        "content_filter"
    );
    let r = render(Shape::Dialect(Dialect::Responses), &c);
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"]["reason"], "content_filter");

    let mut t = reply(Endpoint::Messages, true);
    t.refuse(1);
    assert_eq!(t.finish, Finish::Natural, "a tool call is left alone");
}
