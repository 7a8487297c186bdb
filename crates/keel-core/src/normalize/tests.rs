use super::*;
use serde_json::json;

fn norm(s: &str) -> (String, Vec<String>) {
    let mut fixes = Fixes::default();
    let out = normalize_text(s, &mut fixes).unwrap_or_else(|| s.to_string());
    (out, fixes.into_codes())
}

#[test]
fn fixes_quotes_spaces_and_invisible_characters() {
    let (out, codes) =
        norm("  Don\u{2019}t  use \u{201C}markdown\u{201D}\u{00A0}please\u{200B}.\r\n");
    assert_eq!(out, "Don't use \"markdown\" please.");
    for code in [
        "quotes_ascii",
        "spaces_collapsed",
        "invisible_removed",
        "crlf_to_lf",
        "trimmed",
    ] {
        assert!(
            codes.iter().any(|c| c == code),
            "{code} missing from {codes:?}"
        );
    }
}

#[test]
fn blank_lines_and_trailing_whitespace() {
    let (out, codes) = norm("a  \n\n\n\nb\t\n  - item");
    assert_eq!(out, "a\n\nb\n  - item");
    assert!(codes.iter().any(|c| c == "blank_lines_collapsed"));
    assert!(codes.iter().any(|c| c == "trailing_whitespace"));
}

#[test]
fn nfc_composes() {
    let (out, codes) = norm("cafe\u{301}");
    assert_eq!(out, "caf\u{e9}");
    assert_eq!(codes, ["unicode_nfc"]);
}

#[test]
fn code_and_json_are_untouched() {
    for s in [
        "Run  `a   b\u{2019}`  now",
        "x\n```\nfn  f() {\u{201C}}  \r\n\n\n\n```",
        "{\"a\":  \"b\u{2019}\"}",
        "```unterminated  \u{00A0}",
    ] {
        let (out, _) = norm(s);
        let code_kept = s.split('`').skip(1).step_by(2).all(|c| out.contains(c));
        assert!(code_kept || out == s, "{s:?} -> {out:?}");
    }
    assert_eq!(norm("{\"a\":  \"b\u{2019}\"}").0, "{\"a\":  \"b\u{2019}\"}");
}

#[test]
fn clean_text_allocates_nothing() {
    let mut fixes = Fixes::default();
    assert_eq!(
        normalize_text("Hello there.\n\nSecond line.", &mut fixes),
        None
    );
    assert_eq!(fixes.codes().count(), 0);
}

#[test]
fn request_walk_skips_tools() {
    let mut body = json!({
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "f", "description": "a  \u{2019}"}}],
        "messages": [
            {"role": "system", "content": "Be  brief\u{2019}"},
            {"role": "user", "content": [{"type": "text", "text": " hi "}, {"type": "image_url", "image_url": {"url": "x  y"}}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":  1}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "  raw  \u{2019}"}
        ]
    });
    let before = body.clone();
    let map = body.as_object_mut().unwrap();
    let codes = normalize_request(
        Endpoint::ChatCompletions,
        map,
        Mode::Syntax,
        &FullConfig::default(),
    );
    assert!(!codes.is_empty());
    assert_eq!(body["messages"][0]["content"], "Be brief'");
    assert_eq!(body["messages"][1]["content"][0]["text"], "hi");
    for path in [
        "/tools",
        "/messages/1/content/1",
        "/messages/2",
        "/messages/3",
    ] {
        assert_eq!(body.pointer(path), before.pointer(path), "{path}");
    }
    let mut off = before.clone();
    assert!(normalize_request(
        Endpoint::ChatCompletions,
        off.as_object_mut().unwrap(),
        Mode::Off,
        &FullConfig::default()
    )
    .is_empty());
    assert_eq!(off, before);
}

#[test]
fn messages_system_and_tool_results() {
    let mut body = json!({
        "system": [{"type": "text", "text": "You\u{00A0}are  kind"}],
        "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "  x  "},
            {"type": "text", "text": "ok\u{200D}"}
        ]}]
    });
    normalize_request(
        Endpoint::Messages,
        body.as_object_mut().unwrap(),
        Mode::Syntax,
        &FullConfig::default(),
    );
    assert_eq!(body["system"][0]["text"], "You are kind");
    assert_eq!(body["messages"][0]["content"][0]["content"], "  x  ");
    assert_eq!(body["messages"][0]["content"][1]["text"], "ok");
}

#[test]
fn mode_parses() {
    assert_eq!(Mode::parse("Syntax"), Some(Mode::Syntax));
    assert_eq!(Mode::parse("off"), Some(Mode::Off));
    assert_eq!(Mode::parse("full"), Some(Mode::Full));
    assert_eq!(Mode::parse("on"), None);
}

#[test]
fn opt_out_line_is_taken_out() {
    let mut chat = json!({"messages": [
        {"role": "system", "content": "#keel-no-normalize\r\nBe  \u{2019}kind"},
        {"role": "user", "content": "#keel-no-normalize\nhi"}
    ]});
    assert!(take_opt_out(
        Endpoint::ChatCompletions,
        chat.as_object_mut().unwrap()
    ));
    assert_eq!(chat["messages"][0]["content"], "Be  \u{2019}kind");
    // Only the first system/user text carries the marker.
    assert_eq!(chat["messages"][1]["content"], "#keel-no-normalize\nhi");

    let mut msgs = json!({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}, {"type": "text", "text": "#keel-no-normalize"}]}]});
    assert!(take_opt_out(
        Endpoint::Messages,
        msgs.as_object_mut().unwrap()
    ));
    assert_eq!(msgs["messages"][0]["content"][1]["text"], "");

    for text in ["#keel-no-normalizer\nx", "x\n#keel-no-normalize", "hello"] {
        let mut body = json!({"messages": [{"role": "user", "content": text}]});
        assert!(!take_opt_out(
            Endpoint::ChatCompletions,
            body.as_object_mut().unwrap()
        ));
        assert_eq!(body["messages"][0]["content"], text);
    }
}

/// One repair budget spans the whole request: four messages, each with a 16 KB example whose
/// search alone would parse some 68 MB, together examine at most the budget.
#[test]
fn json_repair_work_is_bounded_per_request() {
    let value = "x".repeat(500);
    let members: Vec<String> = (0..31).map(|i| format!("\"k{i}\": \"{value}\"")).collect();
    let example = format!("Reply like [{{{}", members.join(", "));
    let mut body = json!({
        "model": "m",
        "messages": (0..4).map(|_| json!({"role": "user", "content": example})).collect::<Vec<_>>(),
    });
    let mut budget = RepairBudget::default();
    let codes = normalize_request_within(
        Endpoint::ChatCompletions,
        body.as_object_mut().unwrap(),
        Mode::Full,
        &FullConfig::new(Some(&[]), &[]).unwrap(),
        &mut Edits::default(),
        &mut budget,
    );
    assert!(budget.exhausted());
    assert!(budget.used_bytes() <= RepairBudget::DEFAULT_BYTES);
    assert!(
        !codes.iter().any(|c| c == "schema_brace_recovered"),
        "{codes:?}"
    );
    for m in body["messages"].as_array().unwrap() {
        assert_eq!(m["content"], example, "each example is left as it was");
    }
}
