//! Property tests: normalization (`syntax` and `full`) is idempotent, never touches code spans,
//! JSON texts or tool content, keeps the message list's shape, and `Off` changes nothing.

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;

/// Text pieces mixing every character class the normalizer reacts to.
fn piece() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "a",
        "word",
        " ",
        "  ",
        "\t",
        "\n",
        "\r\n",
        "\r",
        "\n\n\n",
        "\u{2019}",
        "\u{201C}",
        "\u{00A0}",
        "\u{3000}",
        "\u{200B}",
        "\u{FEFF}",
        "\u{00AD}",
        "e\u{301}",
        "\u{301}",
        "`",
        "```",
        "{",
        "}",
        "\"",
        "-",
        "é",
        "中",
        // What `full` mode reacts to: rule phrases, sentence and clause punctuation, list and
        // heading markers, JSON example pieces, intent verbs.
        "Don't use markdown",
        "be brief",
        "No explanation",
        "please",
        ".",
        ". ",
        ",",
        ";",
        "?",
        "[",
        "]",
        "\"a\": 1",
        "{\"k\": [1",
        "\n- ",
        "# ",
        "Summarize",
        "translate",
        "the report",
    ])
    .prop_map(str::to_string)
}

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(piece(), 0..40).prop_map(|v| v.concat())
}

fn once(s: &str) -> String {
    normalize_text(s, &mut Fixes::default()).unwrap_or_else(|| s.to_string())
}

fn once_full(s: &str) -> String {
    full::normalize_prompt_text(s, &FullConfig::default(), &mut Fixes::default())
        .unwrap_or_else(|| s.to_string())
}

fn run(body: &Value, mode: Mode) -> Value {
    let mut out = body.clone();
    normalize_request(
        Endpoint::ChatCompletions,
        out.as_object_mut().unwrap(),
        mode,
        &FullConfig::default(),
    );
    out
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
    fn full_idempotent(s in text()) {
        let one = once_full(&s);
        prop_assert_eq!(once_full(&one), one);
    }

    /// Request level, with intent completion: system and user texts, the last one the user's.
    #[test]
    fn full_request_idempotent(texts in prop::collection::vec(text(), 1..4), tail in text()) {
        let mut messages: Vec<Value> = texts.iter().map(|t| json!({"role": "system", "content": t})).collect();
        messages.push(json!({"role": "user", "content": format!("Summarize the report for the team {tail} and the board of the company in detail today")}));
        let body = json!({"messages": messages});
        let one = run(&body, Mode::Full);
        prop_assert_eq!(run(&one, Mode::Full), one);
    }

    #[test]
    fn code_spans_kept(prose in text(), code in "[ a-z\t\r\n\u{2019}\u{00A0}\u{200B}]{0,20}") {
        let code = code.replace('`', "");
        for wrapped in [format!("```{code}```"), format!("`{code}`")] {
            let s = format!("{}\n{wrapped}\n{}", prose.replace('`', ""), prose.replace('`', ""));
            prop_assert!(once(&s).contains(&wrapped), "{:?}", s);
            prop_assert!(once_full(&s).contains(&wrapped), "full: {:?}", s);
        }
    }

    #[test]
    fn json_texts_kept(v in prop::collection::vec("[ a-z\u{2019}\u{00A0}\t\n{\\[]{0,10}", 0..5)) {
        let s = format!(" {} ", serde_json::to_string_pretty(&v).unwrap());
        prop_assert_eq!(once(&s), s.clone());
        prop_assert_eq!(once_full(&s), s);
    }

    /// In prose, `full` changes a JSON example only by inserting closers: deleting every `}` and
    /// `]` from both sides gives the same text as `syntax` mode does.
    #[test]
    fn json_repair_only_inserts_closers(s in text()) {
        let strip = |t: &str| t.replace(['}', ']'], "");
        let no_rules = FullConfig::new(Some(&[]), &[]).unwrap();
        let full = full::normalize_prompt_text(&s, &no_rules, &mut Fixes::default()).unwrap_or_else(|| s.clone());
        prop_assert_eq!(strip(&full), strip(&once(&s)));
    }

    #[test]
    fn shape_tools_and_off(texts in prop::collection::vec(text(), 1..6)) {
        let before = chat_body(&texts);
        let mut off = before.clone();
        prop_assert!(normalize_request(Endpoint::ChatCompletions, off.as_object_mut().unwrap(), Mode::Off, &FullConfig::default()).is_empty());
        prop_assert_eq!(&off, &before);

        for mode in [Mode::Syntax, Mode::Full] {
            let after = run(&before, mode);
            let (old, new) = (before["messages"].as_array().unwrap(), after["messages"].as_array().unwrap());
            prop_assert_eq!(old.len(), new.len());
            for (o, n) in old.iter().zip(new) {
                prop_assert_eq!(&o["role"], &n["role"]);
            }
            let n = texts.len();
            prop_assert_eq!(&old[n..], &new[n..]);
            prop_assert_eq!(&before["tools"], &after["tools"]);
            // Assistant turns get `syntax` fixes only.
            let syntax = run(&before, Mode::Syntax);
            for i in (2..n).step_by(3) {
                prop_assert_eq!(&after["messages"][i], &syntax["messages"][i]);
            }
        }
    }
}
