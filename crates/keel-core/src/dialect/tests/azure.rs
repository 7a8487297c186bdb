//! Azure OpenAI: its annotations removed from streams (split at every byte) and whole answers.

use serde_json::{json, Value};

use super::*;
use crate::protocol::{event_role, EventRole, Protocol};
use crate::sse::decode_all;

const FILTERS: &str = r#"{"hate":{"filtered":false,"severity":"safe"},"self_harm":{"filtered":false,"severity":"safe"},"sexual":{"filtered":false,"severity":"safe"},"violence":{"filtered":false,"severity":"safe"}}"#;

fn filters() -> Value {
    serde_json::from_str(FILTERS).unwrap()
}

fn azure_chunk(delta: Value, finish: Value) -> Value {
    json!({"choices": [{"content_filter_results": filters(), "delta": delta, "finish_reason": finish, "index": 0, "logprobs": null}],
        "created": 1727000000, "id": "chatcmpl-AAm7r", "model": "gpt-4o-2024-08-06",
        "object": "chat.completion.chunk", "system_fingerprint": "fp_b2ffeb16ee"})
}

fn openai_chunk(delta: Value, finish: Value) -> Value {
    json!({"choices": [{"delta": delta, "finish_reason": finish, "index": 0, "logprobs": null}],
        "created": 1727000000, "id": "chatcmpl-AAm7r", "model": "gpt-4o-2024-08-06",
        "object": "chat.completion.chunk", "system_fingerprint": "fp_b2ffeb16ee"})
}

fn usage() -> Value {
    json!({"completion_tokens": 3, "prompt_tokens": 12, "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0}})
}

/// What Azure sends for a streamed chat completion with `include_usage`, as it writes it.
fn azure_stream(finish: &str) -> String {
    let first = json!({"choices": [], "created": 0, "id": "", "model": "", "object": "",
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": filters()}]});
    let mut role = azure_chunk(
        json!({"content": "", "refusal": null, "role": "assistant"}),
        Value::Null,
    );
    role["choices"][0]["content_filter_results"] = json!({});
    let mut last = azure_chunk(json!({}), json!(finish));
    last["choices"][0]["content_filter_results"] = json!({});
    let usage_chunk = json!({"choices": [], "created": 1727000000, "id": "chatcmpl-AAm7r", "model": "gpt-4o-2024-08-06",
        "object": "chat.completion.chunk", "system_fingerprint": "fp_b2ffeb16ee", "usage": usage()});
    let events = [
        first,
        role,
        azure_chunk(json!({"content": "Hello"}), Value::Null),
        azure_chunk(json!({"content": " there."}), Value::Null),
        last,
        usage_chunk,
    ];
    let mut s: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    s.push_str("data: [DONE]\n\n");
    s
}

fn run(pieces: &[&[u8]]) -> Vec<u8> {
    let mut s = Stream::new();
    let mut out = Vec::new();
    for p in pieces {
        s.feed(p, &mut out).unwrap();
    }
    s.end(&mut out).unwrap();
    out
}

fn values(out: &[u8]) -> Vec<Value> {
    decode_all(out)
        .unwrap()
        .iter()
        .map(|e| serde_json::from_str(&e.data).unwrap_or_else(|_| json!(e.data)))
        .collect()
}

#[test]
fn an_azure_stream_reads_as_openai_s() {
    let out = run(&[azure_stream("stop").as_bytes()]);
    let usage_chunk = json!({"choices": [], "created": 1727000000, "id": "chatcmpl-AAm7r", "model": "gpt-4o-2024-08-06",
        "object": "chat.completion.chunk", "system_fingerprint": "fp_b2ffeb16ee", "usage": usage()});
    assert_eq!(
        values(&out),
        vec![
            openai_chunk(
                json!({"content": "", "refusal": null, "role": "assistant"}),
                Value::Null
            ),
            openai_chunk(json!({"content": "Hello"}), Value::Null),
            openai_chunk(json!({"content": " there."}), Value::Null),
            openai_chunk(json!({}), json!("stop")),
            usage_chunk,
            json!("[DONE]"),
        ]
    );
    let events = decode_all(&out).unwrap();
    assert_eq!(
        event_role(Protocol::OpenAi, &events[0]),
        EventRole::Preamble
    );
    assert_eq!(
        event_role(Protocol::OpenAi, events.last().unwrap()),
        EventRole::Terminal
    );
    // The usage chunk and [DONE] carried no annotation: passed byte for byte.
    let input = azure_stream("stop");
    let tail = &input[input
        .rfind("data: {\"choices\":[],\"created\":1727000000")
        .unwrap()..];
    assert!(out.ends_with(tail.as_bytes()));
}

#[test]
fn an_azure_stream_split_at_every_byte_gives_the_same_events() {
    let input = azure_stream("stop");
    let bytes = input.as_bytes();
    let whole = run(&[bytes]);
    for cut in 0..=bytes.len() {
        assert_eq!(run(&[&bytes[..cut], &bytes[cut..]]), whole, "cut at {cut}");
    }
}

#[test]
fn a_content_filter_finish_stays_a_finished_answer() {
    let out = values(&run(&[azure_stream("content_filter").as_bytes()]));
    assert_eq!(out[3], openai_chunk(json!({}), json!("content_filter")));
    assert_eq!(out.last().unwrap(), &json!("[DONE]"));
}

#[test]
fn the_asynchronous_filter_s_annotation_chunks_are_dropped() {
    let annotation = json!({"choices": [{"content_filter_offsets": {"check_offset": 44, "start_offset": 44, "end_offset": 198},
        "content_filter_results": filters(), "finish_reason": null, "index": 0}],
        "created": 0, "id": "", "model": "", "object": ""});
    let mut text = azure_chunk(json!({"content": "Hi"}), Value::Null);
    text["choices"][0]["content_filter_offsets"] =
        json!({"check_offset": 0, "start_offset": 0, "end_offset": 2});
    let input = format!("data: {text}\n\ndata: {annotation}\n\n: keep-alive\n\ndata: [DONE]\n\n");
    let out = run(&[input.as_bytes()]);
    assert_eq!(
        values(&out),
        vec![
            openai_chunk(json!({"content": "Hi"}), Value::Null),
            json!(""),
            json!("[DONE]")
        ]
    );
}

#[test]
fn a_cut_azure_stream_stays_cut() {
    let input = azure_stream("stop");
    let cut = input.find("data: [DONE]").unwrap();
    let out = run(&[&input.as_bytes()[..cut + 7]]);
    assert!(values(&out).iter().all(|v| v != &json!("[DONE]")));
    let out = run(&[&input.as_bytes()[..cut]]);
    assert_eq!(values(&out).len(), 5);
}

#[test]
fn an_error_chunk_passes_unchanged() {
    let input = "data: {\"error\":{\"message\":\"The response was filtered\",\"type\":null,\"param\":\"prompt\",\"code\":\"content_filter\"}}\n\n";
    assert_eq!(run(&[input.as_bytes()]), input.as_bytes());
}

#[test]
fn a_whole_azure_answer_reads_as_openai_s() {
    let azure = json!({
        "choices": [{"content_filter_results": filters(), "finish_reason": "stop", "index": 0, "logprobs": null,
            "message": {"content": "Hello there.", "refusal": null, "role": "assistant"}}],
        "created": 1727000000, "id": "chatcmpl-AAm7r", "model": "gpt-4o-2024-08-06", "object": "chat.completion",
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": filters()}],
        "system_fingerprint": "fp_b2ffeb16ee", "usage": usage()});
    let got: Value = serde_json::from_slice(&whole(azure.to_string().as_bytes()).unwrap()).unwrap();
    assert_eq!(
        got,
        json!({
            "choices": [{"finish_reason": "stop", "index": 0, "logprobs": null,
                "message": {"content": "Hello there.", "refusal": null, "role": "assistant"}}],
            "created": 1727000000, "id": "chatcmpl-AAm7r", "model": "gpt-4o-2024-08-06", "object": "chat.completion",
            "system_fingerprint": "fp_b2ffeb16ee", "usage": usage()})
    );
    // An answer without annotations is passed byte for byte; one that is not JSON is an error.
    let plain = got.to_string();
    assert_eq!(whole(plain.as_bytes()).unwrap(), plain.as_bytes());
    assert!(whole(b"<html>").is_err());
}
