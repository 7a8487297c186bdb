//! `full` mode: rules, JSON-example repair, intent completion and their configuration.

use serde_json::json;

use super::*;

/// One user message through `full` with `cfg`: the resulting text and codes.
fn full_with(cfg: &FullConfig, text: &str) -> (String, Vec<String>) {
    let mut body = json!({"messages": [{"role": "user", "content": text}]});
    let codes = normalize_request(
        Endpoint::ChatCompletions,
        body.as_object_mut().unwrap(),
        Mode::Full,
        cfg,
    );
    let out = body["messages"][0]["content"].as_str().unwrap().to_owned();
    // Every result here is also a fixed point.
    let mut again = body.clone();
    let second = normalize_request(
        Endpoint::ChatCompletions,
        again.as_object_mut().unwrap(),
        Mode::Full,
        cfg,
    );
    assert_eq!(again, body, "second pass changed {text:?}");
    assert!(second.is_empty(), "second pass reported {second:?}");
    (out, codes)
}

fn full(text: &str) -> (String, Vec<String>) {
    full_with(&FullConfig::default(), text)
}

#[test]
fn the_defaults_are_a_valid_config() {
    assert!(FullConfig::new(None, &[]).is_ok());
    assert_eq!(FullConfig::default_rules().len(), 5);
}

#[test]
fn vague_format_instructions_become_precise() {
    let plain = "Summarize the report. Output plain text only, with no formatting characters.";
    for variant in [
        "Summarize the report. Don't use markdown.",
        "Summarize the report. Do not use Markdown formatting.",
        "Summarize the report. Please don\u{2019}t use any markdown!",
        "Summarize the report. NO MARKDOWN.",
        "Summarize the report.  Never use markdown please.",
    ] {
        let (out, codes) = full(variant);
        assert_eq!(out.replace('!', "."), plain, "{variant:?}");
        assert!(codes.contains(&"rule_rewritten:no_markdown".to_owned()));
    }
    let cases = [
        (
            "Answer the question, be brief.",
            "Answer the question, answer in at most three sentences.",
        ),
        (
            "- Keep it short\n- Use bullet points",
            "- Answer in at most three sentences\n- Format the answer as a list, one item per line, each starting with a hyphen",
        ),
        (
            "Read the ticket; reply in JSON.",
            "Read the ticket; respond with a single valid JSON value and nothing else.",
        ),
        ("No explanation needed.", "Give only the answer, with no explanation."),
    ];
    for (input, want) in cases {
        assert_eq!(full(input).0, want, "{input:?}");
    }
}

#[test]
fn rules_leave_everything_but_whole_instruction_clauses_alone() {
    for text in [
        "Don't use markdown tables.",
        "Do use markdown.",
        "Can you not use markdown? Be brief?",
        "Say \"don't use markdown\" to them.",
        "Don't use markdown `here` now.",
        "Intro\n```\nDon't use markdown.\n```",
        "> Be brief.",
        "# Be brief",
        "Be brief about the history of Rome.",
        "The schema is [be brief, no markdown].",
    ] {
        let (out, codes) = full(text);
        assert_eq!(out, text, "{text:?}");
        assert!(codes.is_empty(), "{text:?}: {codes:?}");
    }
}

#[test]
fn assistant_turns_and_tools_get_no_rewrites() {
    let mut body = json!({
        "tools": [{"type": "function", "function": {"name": "f", "description": "Be brief."}}],
        "messages": [
            {"role": "assistant", "content": "Be brief.  Don\u{2019}t use markdown."},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function",
                "function": {"name": "f", "arguments": "{\"x\": \"be brief\"}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "Be brief."}
        ]
    });
    let before = body.clone();
    normalize_request(
        Endpoint::ChatCompletions,
        body.as_object_mut().unwrap(),
        Mode::Full,
        &FullConfig::default(),
    );
    // The assistant's text gets `syntax` fixes only.
    assert_eq!(
        body["messages"][0]["content"],
        "Be brief. Don't use markdown."
    );
    for path in ["/tools", "/messages/1", "/messages/2"] {
        assert_eq!(body.pointer(path), before.pointer(path), "{path}");
    }
}

#[test]
fn a_broken_json_example_in_prose_is_completed() {
    let (out, codes) = full("Reply with an object like {\"name\": \"Ada\", \"age\": 36");
    assert_eq!(
        out,
        "Reply with an object like {\"name\": \"Ada\", \"age\": 36}"
    );
    assert_eq!(codes, ["schema_brace_recovered"]);
    // Fenced examples (labelled json or not) are code, and code is never touched.
    for text in [
        "Reply like:\n```json\n{\"name\": \"Ada\"\n```",
        "Reply like `{\"a\": 1`.",
        "Like {\"a\": {\"b\": 1, \"c\": 2}",
    ] {
        assert_eq!(full(text).0, text);
    }
    // Text after an unrepaired example may be part of it: no rule fires there.
    let broken = "Like {\"a\": {\"b\": 1, \"c\": 2}\nBe brief.";
    assert_eq!(full(broken).0, broken);
}

const NOTES: &str = "Summarize the following meeting notes for the team lead who missed the meeting yesterday: we agreed to ship the release on Friday after the last review.";

#[test]
fn a_long_prompt_without_an_output_constraint_gets_its_intents_constraint() {
    let (out, codes) = full(NOTES);
    assert_eq!(
        out,
        format!("{NOTES}\n\nAnswer with the summary only, in at most five sentences.")
    );
    assert_eq!(codes, ["intent_constraint_added:summarize"]);
    let cases = [
        ("Please translate this note into German for our customers in Vienna and Zurich: the shop opens at nine and closes at six every day except Sunday.", "translate"),
        ("Extract the invoice number, the due date and the total amount from this invoice text: Invoice 4471, due on March 3rd, total 1200 euros including tax.", "extract_json"),
        ("Classify the sentiment of this customer review as positive, negative or neutral please: the delivery was late but the support team was very helpful.", "classify"),
        ("List the main risks of moving our billing service to a new cloud provider during the busiest quarter of the year, given the team is small.", "list"),
    ];
    for (text, intent) in cases {
        let (out, codes) = full(text);
        assert_eq!(
            codes,
            [format!("intent_constraint_added:{intent}")],
            "{text}"
        );
        let want = Intent::parse(intent).unwrap().default_constraint();
        assert!(out.ends_with(&format!("\n\n{want}")), "{out}");
    }
}

#[test]
fn intent_completion_needs_a_long_unconstrained_user_prompt_with_one_intent() {
    for text in [
        "Summarize the notes below.",
        &format!("{NOTES} Use three bullet points."),
        &format!("{NOTES} Then translate it into French."),
        "Tell me about the meeting we had yesterday with the whole team and what everyone said about the release plan for Friday.",
    ] {
        let (out, codes) = full(text);
        assert!(
            !codes.iter().any(|c| c.starts_with("intent_")),
            "{text}: {codes:?}"
        );
        assert!(!out.ends_with("sentences."), "{out}");
    }
    // A constraint in the system prompt counts; an assistant's last turn means no new request.
    for messages in [
        json!([{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": NOTES}]),
        json!([{"role": "user", "content": NOTES}, {"role": "assistant", "content": "Sure."}]),
    ] {
        let mut body = json!({ "messages": messages });
        let codes = normalize_request(
            Endpoint::ChatCompletions,
            body.as_object_mut().unwrap(),
            Mode::Full,
            &FullConfig::default(),
        );
        assert!(codes.is_empty(), "{codes:?}");
    }
    // Messages API: the constraint goes after the last text part of the last user message.
    let mut body = json!({"system": "You help a team.", "messages": [{"role": "user", "content": [
        {"type": "text", "text": NOTES}, {"type": "image", "source": {"type": "base64", "data": "x"}}]}]});
    let codes = normalize_request(
        Endpoint::Messages,
        body.as_object_mut().unwrap(),
        Mode::Full,
        &FullConfig::default(),
    );
    assert_eq!(codes, ["intent_constraint_added:summarize"]);
    assert!(body["messages"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .ends_with("at most five sentences."));
    assert_eq!(body["messages"][0]["content"][1]["source"]["data"], "x");
}

#[test]
fn configured_rules_and_constraints() {
    let cfg = FullConfig::new(
        Some(&[RuleSpec::new(
            "friendly",
            r"be\s+(?:nice|friendly)",
            "Use a warm, friendly tone",
        )]),
        &[
            (Intent::Summarize, "Answer in one paragraph.".to_owned()),
            (Intent::List, String::new()),
        ],
    )
    .unwrap();
    let (out, codes) = full_with(&cfg, "Be nice. Be brief.");
    assert_eq!(out, "Use a warm, friendly tone. Be brief.");
    assert_eq!(codes, ["rule_rewritten:friendly"]);
    let (out, _) = full_with(&cfg, NOTES);
    assert!(out.ends_with("\n\nAnswer in one paragraph."), "{out}");
    let list = "List the main risks of moving our billing service to a new cloud provider during the busiest quarter of the year, given the team is small.";
    assert_eq!(full_with(&cfg, list).0, list, "list intent turned off");
    // No rules at all.
    let none = FullConfig::new(Some(&[]), &[]).unwrap();
    assert_eq!(full_with(&none, "Be brief.").0, "Be brief.");
}

#[test]
fn bad_rules_and_constraints_are_refused_by_name() {
    let rule = |name: &str, pattern: &str, replacement: &str| {
        FullConfig::new(Some(&[RuleSpec::new(name, pattern, replacement)]), &[])
            .unwrap_err()
            .message
    };
    assert!(rule("broken", "be (brief", "Short").contains("rule `broken`: bad pattern"));
    assert!(
        rule("q", "be brief", "Say \"hi\"").contains("rule `q`: replacement must not contain '\"'")
    );
    assert!(rule("dot", "be brief", "One. Two").contains("must not contain '.'"));
    assert!(rule("sp", "be brief", "Two  spaces").contains("already be normalized"));
    assert!(rule("bad name", "x", "y").contains("rule name `bad name`"));
    assert!(rule("loop", "be brief|stay brief", "Stay brief").contains("rewritten again"));
    let twice = FullConfig::new(
        Some(&[RuleSpec::new("a", "x", "y"), RuleSpec::new("a", "z", "w")]),
        &[],
    );
    assert!(twice.unwrap_err().message.contains("defined twice"));
    let constraint = FullConfig::new(None, &[(Intent::List, "One\nper line.".to_owned())]);
    let err = constraint.unwrap_err();
    assert_eq!(err.at, ErrorAt::Constraint(Intent::List));
    assert!(err
        .message
        .contains("constraint for `list`: must not contain '\\n'"));
}

#[test]
fn constraints_are_stored_already_rewritten() {
    let cfg = FullConfig::new(None, &[(Intent::Classify, "Be brief.".to_owned())]).unwrap();
    assert_eq!(
        cfg.constraint(Intent::Classify),
        Some("Answer in at most three sentences.")
    );
}

#[test]
fn syntax_mode_ignores_the_full_config() {
    let mut body = json!({"messages": [{"role": "user", "content": NOTES}]});
    let before = body.clone();
    let codes = normalize_request(
        Endpoint::ChatCompletions,
        body.as_object_mut().unwrap(),
        Mode::Syntax,
        &FullConfig::default(),
    );
    assert!(codes.is_empty());
    assert_eq!(body, before);
}
