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
