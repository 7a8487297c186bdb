//! Whole responses and error bodies.

use serde_json::json;

use super::*;
use crate::protocol::ErrorKind;

#[test]
fn whole_responses_map_text_tool_calls_reasons_and_usage() {
    let c = message_to_chat_completion(
        &anthropic_message(),
        &ResponseContext::default(),
        "pub",
        1700,
    )
    .unwrap();
    assert_eq!(c["id"], "msg_01");
    assert_eq!(c["model"], "pub");
    assert_eq!(c["created"], 1700);
    let m = &c["choices"][0]["message"];
    assert_eq!(m["content"], "Checking.");
    assert_eq!(m["reasoning_content"], "Two cities.");
    assert_eq!(m["tool_calls"][1]["id"], "toolu_B");
    assert_eq!(
        m["tool_calls"][1]["function"]["arguments"],
        "{\"city\":\"Bergen\",\"units\":[\"c\"]}"
    );
    assert_eq!(c["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(
        c["usage"],
        json!({"prompt_tokens": 100, "completion_tokens": 25, "total_tokens": 125,
            "prompt_tokens_details": {"cached_tokens": 90}})
    );

    let back = chat_completion_to_message(&c, "pub").unwrap();
    assert_eq!(back["id"], "msg_01");
    assert_eq!(back["stop_reason"], "tool_use");
    assert_eq!(
        back["usage"],
        json!({"input_tokens": 10, "cache_read_input_tokens": 90, "output_tokens": 25})
    );
    let mut expected = anthropic_message()["content"].clone();
    expected[0]["signature"] = json!("");
    assert_eq!(back["content"], expected);

    for (stop, finish) in [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("refusal", "content_filter"),
    ] {
        assert_eq!(finish_reason_of(stop), finish);
        if stop != "stop_sequence" {
            assert_eq!(stop_reason_of(finish), stop);
        }
    }
    let bad = json!({"choices": [{"message": {"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}}]});
    assert!(chat_completion_to_message(&bad, "pub").is_err());
}

#[test]
fn error_bodies_change_shape_and_keep_kind_and_message() {
    let anthropic =
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
    let o = error_body_to_protocol(&anthropic, Some(529), Protocol::OpenAi);
    assert_eq!(o["error"]["type"], "overloaded_error");
    assert_eq!(o["error"]["message"], "Overloaded");
    let openai = json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}});
    let a = error_body_to_protocol(&openai, Some(429), Protocol::Anthropic);
    assert_eq!(
        a,
        json!({"type": "error", "error": {"type": "rate_limit_error", "message": "Rate limit reached"}})
    );
    assert_eq!(error_kind_of(&anthropic, None), ErrorKind::Overloaded);
}

#[test]
fn a_chat_completion_survives_the_round_trip_through_a_message() {
    let completion = json!({"id": "chatcmpl-7", "object": "chat.completion", "created": 42, "model": "pub",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Two calls.", "refusal": null,
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}},
                {"id": "toolu_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
            "logprobs": null, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150,
            "prompt_tokens_details": {"cached_tokens": 100}}});
    let message = chat_completion_to_message(&completion, "pub").unwrap();
    assert_eq!(message["usage"]["input_tokens"], 20);
    let back =
        message_to_chat_completion(&message, &ResponseContext::default(), "pub", 42).unwrap();
    assert_eq!(back, completion);

    let refused = json!({"id": "c", "choices": [{"index": 0, "message": {"role": "assistant",
        "content": null, "refusal": "I can't help with that."}, "finish_reason": "stop"}]});
    let m = chat_completion_to_message(&refused, "pub").unwrap();
    assert_eq!(m["stop_reason"], "refusal");
    assert_eq!(m["content"][0]["text"], "I can't help with that.");
    let c = message_to_chat_completion(&m, &ResponseContext::default(), "pub", 1).unwrap();
    assert_eq!(c["choices"][0]["finish_reason"], "content_filter");
}
