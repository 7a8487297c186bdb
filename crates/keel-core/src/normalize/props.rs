//! Property tests: normalization is idempotent, never touches code spans, JSON texts or tool
//! content, keeps the message list's shape, and `Off` changes nothing.

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;

/// Text pieces mixing every character class the normalizer reacts to.
fn piece() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "a", "word", " ", "  ", "\t", "\n", "\r\n", "\r", "\n\n\n", "\u{2019}", "\u{201C}",
        "\u{00A0}", "\u{3000}", "\u{200B}", "\u{FEFF}", "\u{00AD}", "e\u{301}", "\u{301}", "`",
        "```", "{", "}", "\"", "-", "é", "中",
    ])
    .prop_map(str::to_string)
}

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(piece(), 0..40).prop_map(|v| v.concat())
}

fn once(s: &str) -> String {
    normalize_text(s, &mut Fixes::default()).unwrap_or_else(|| s.to_string())
}

fn chat_body(texts: &[String]) -> Value {
    let mut messages: Vec<Value> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let role = ["system", "user", "assistant"][i % 3];
            json!({"role": role, "content": t})
        })
        .collect();
    let raw = texts.concat();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": raw}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": "c", "content": raw}));
    json!({"model": "m", "messages": messages,
           "tools": [{"type": "function", "function": {"name": "f", "description": raw}}]})
}

proptest! {
    #[test]
    fn idempotent(s in text()) {
        let one = once(&s);
        prop_assert_eq!(once(&one), one);
    }

    #[test]
    fn code_spans_kept(prose in text(), code in "[ a-z\t\r\n\u{2019}\u{00A0}\u{200B}]{0,20}") {
        let code = code.replace('`', "");
        for wrapped in [format!("```{code}```"), format!("`{code}`")] {
            let s = format!("{}\n{wrapped}\n{}", prose.replace('`', ""), prose.replace('`', ""));
            prop_assert!(once(&s).contains(&wrapped), "{:?}", s);
        }
    }

    #[test]
    fn json_texts_kept(v in prop::collection::vec("[ a-z\u{2019}\u{00A0}\t\n]{0,10}", 0..5)) {
        let s = format!(" {} ", serde_json::to_string_pretty(&v).unwrap());
        prop_assert_eq!(once(&s), s);
    }

    #[test]
    fn shape_tools_and_off(texts in prop::collection::vec(text(), 1..6)) {
        let before = chat_body(&texts);
        let mut off = before.clone();
        prop_assert!(normalize_request(Endpoint::ChatCompletions, off.as_object_mut().unwrap(), Mode::Off).is_empty());
        prop_assert_eq!(&off, &before);

        let mut after = before.clone();
        normalize_request(Endpoint::ChatCompletions, after.as_object_mut().unwrap(), Mode::Syntax);
        let (old, new) = (before["messages"].as_array().unwrap(), after["messages"].as_array().unwrap());
        prop_assert_eq!(old.len(), new.len());
        for (o, n) in old.iter().zip(new) {
            prop_assert_eq!(&o["role"], &n["role"]);
        }
        let n = texts.len();
        prop_assert_eq!(&old[n..], &new[n..]);
        prop_assert_eq!(&before["tools"], &after["tools"]);
    }
}
