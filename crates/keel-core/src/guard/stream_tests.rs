use serde_json::{json, Value};

use super::mask::{apply, Counts, Masker};
use super::policy::Policy;
use super::stream::{Answering, StreamRestorer};
use super::Guard;
use crate::protocol::Protocol;
use crate::sse::{SseDecoder, SseEvent};

const EMAIL: &str = "jane.doe@corp.example";

fn masker() -> Masker {
    let g = Guard::builtin();
    let p = Policy::parse(&g, [("default", "mask")]).unwrap();
    let mut m = Masker::default();
    let text = format!("write to {EMAIL} with \"quotes\" pem: -----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----");
    let masked = apply(&g, &p, &text, &mut m, &mut Counts::default()).unwrap();
    assert_eq!(masked, "write to <EMAIL_1> with \"quotes\" pem: <SECRET_1>");
    m
}

/// Runs events through a restorer and decodes what the client gets.
fn run(protocol: Protocol, m: &Masker, events: &[SseEvent]) -> (Vec<SseEvent>, usize) {
    run_with(protocol, m, &Policy::default(), events).0
}

/// [`run`] with an answer policy; also returns the answer direction's counts.
fn run_with(
    protocol: Protocol,
    m: &Masker,
    policy: &Policy,
    events: &[SseEvent],
) -> ((Vec<SseEvent>, usize), Counts) {
    let guard = Guard::builtin();
    let mut counts = Counts::default();
    let mut a = Answering {
        masker: m,
        guard: &guard,
        policy,
        counts: &mut counts,
    };
    let mut r = StreamRestorer::new(protocol);
    let mut out = Vec::new();
    let mut max_held = 0;
    for ev in events {
        r.event(&mut a, ev, &mut out);
        max_held = max_held.max(r.held());
    }
    let mut decoded = Vec::new();
    SseDecoder::new().feed(&out, &mut decoded).unwrap();
    ((decoded, max_held), counts)
}

fn openai_chunk(delta: Value, finish: Option<&str>) -> SseEvent {
    let data = json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    SseEvent::new(None, &data.to_string())
}

fn openai_text(events: &[SseEvent]) -> (String, String) {
    let (mut text, mut args) = (String::new(), String::new());
    for ev in events.iter().filter(|e| e.data != "[DONE]") {
        let v: Value = serde_json::from_str(&ev.data).unwrap();
        let d = &v["choices"][0]["delta"];
        if let Some(t) = d["content"].as_str() {
            assert!(!t.contains("<EMAIL") && !t.contains("<SECRET"), "{t:?}");
            text.push_str(t);
        }
        for c in d["tool_calls"].as_array().into_iter().flatten() {
            args.push_str(c["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    (text, args)
}

#[test]
fn openai_text_split_at_every_offset_is_restored_whole() {
    let m = masker();
    let answer = "Sent to <EMAIL_1>, key <SECRET_1> ok <b>";
    let want = m.restore(answer).into_owned();
    for cut in 0..=answer.len() {
        let events = [
            openai_chunk(json!({"role": "assistant", "content": ""}), None),
            openai_chunk(json!({"content": &answer[..cut]}), None),
            openai_chunk(json!({"content": &answer[cut..]}), None),
            openai_chunk(json!({}), Some("stop")),
            SseEvent::new(None, "[DONE]"),
        ];
        let (out, held) = run(Protocol::OpenAi, &m, &events);
        assert!(held < m.longest(), "held {held}");
        assert_eq!(openai_text(&out).0, want, "cut at {cut}");
        assert_eq!(out.last().unwrap().data, "[DONE]");
    }
}

#[test]
fn openai_tool_call_arguments_are_restored_json_escaped() {
    let m = masker();
    let args = r#"{"to":"<EMAIL_1>","key":"<SECRET_1>"}"#;
    for cut in 0..=args.len() {
        let events = [
            openai_chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "send", "arguments": &args[..cut]}}]}),
                None,
            ),
            openai_chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": &args[cut..]}}]}),
                None,
            ),
            openai_chunk(json!({}), Some("tool_calls")),
            SseEvent::new(None, "[DONE]"),
        ];
        let (out, _) = run(Protocol::OpenAi, &m, &events);
        let got: Value = serde_json::from_str(&openai_text(&out).1).unwrap();
        assert_eq!(got["to"], EMAIL, "cut at {cut}");
        assert!(got["key"]
            .as_str()
            .unwrap()
            .starts_with("-----BEGIN PRIVATE KEY-----\n"));
    }
}

#[test]
fn held_text_is_flushed_when_the_stream_ends_without_a_finish_chunk() {
    let m = masker();
    let events = [
        openai_chunk(json!({"content": "to <EMA"}), None),
        SseEvent::new(None, "[DONE]"),
    ];
    let (out, _) = run(Protocol::OpenAi, &m, &events);
    assert_eq!(openai_text(&out).0, "to <EMA");
}

fn anthropic(event: &str, data: Value) -> SseEvent {
    SseEvent::new(Some(event), &data.to_string())
}

#[test]
fn anthropic_text_and_tool_input_split_at_every_offset_are_restored() {
    let m = masker();
    let text = "Mailed <EMAIL_1>.";
    let input = r#"{"to":"<EMAIL_1>"}"#;
    for cut in 0..=text.len().max(input.len()) {
        let (c1, c2) = (cut.min(text.len()), cut.min(input.len()));
        let events = [
            anthropic(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            anthropic(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": &text[..c1]}}),
            ),
            anthropic(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": &text[c1..]}}),
            ),
            anthropic(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            ),
            anthropic(
                "content_block_start",
                json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t", "name": "send", "input": {}}}),
            ),
            anthropic(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": &input[..c2]}}),
            ),
            anthropic(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": &input[c2..]}}),
            ),
            anthropic(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 1}),
            ),
            anthropic("message_stop", json!({"type": "message_stop"})),
        ];
        let (out, _) = run(Protocol::Anthropic, &m, &events);
        let (mut t, mut j) = (String::new(), String::new());
        let mut stopped = Vec::new();
        for ev in &out {
            let v: Value = serde_json::from_str(&ev.data).unwrap();
            match ev.event.as_deref() {
                Some("content_block_delta") => {
                    assert!(
                        !stopped.contains(&v["index"].as_u64().unwrap()),
                        "delta after stop"
                    );
                    if let Some(s) = v["delta"]["text"].as_str() {
                        assert!(!s.contains("<EMAIL"));
                        t.push_str(s);
                    }
                    if let Some(s) = v["delta"]["partial_json"].as_str() {
                        j.push_str(s);
                    }
                }
                Some("content_block_stop") => stopped.push(v["index"].as_u64().unwrap()),
                _ => {}
            }
        }
        assert_eq!(t, format!("Mailed {EMAIL}."), "cut at {cut}");
        let args: Value = serde_json::from_str(&j).unwrap();
        assert_eq!(args["to"], EMAIL);
    }
}

#[test]
fn events_without_placeholders_pass_through_byte_for_byte() {
    let m = masker();
    let events = [
        openai_chunk(json!({"content": "plain text"}), None),
        SseEvent::new(
            None,
            r#"{"error":{"message":"refused","type":"invalid_request_error"}}"#,
        ),
    ];
    let guard = Guard::builtin();
    let mut counts = Counts::default();
    let mut a = Answering {
        masker: &m,
        guard: &guard,
        policy: &Policy::default(),
        counts: &mut counts,
    };
    let mut r = StreamRestorer::new(Protocol::OpenAi);
    let mut out = Vec::new();
    for ev in &events {
        r.event(&mut a, ev, &mut out);
    }
    let raw: Vec<u8> = events.iter().flat_map(|e| e.raw.clone()).collect();
    assert_eq!(out, raw);
}

#[test]
fn answer_secrets_are_redacted_at_any_split_with_a_bounded_hold_back() {
    let m = Masker::default();
    let g = Guard::builtin();
    let policy = Policy::parse(&g, [("default", "redact"), ("email", "detect")]).unwrap();
    let filler = "The deployment finished and everything looks healthy. ".repeat(8);
    let answer = format!("{filler}Use AKIAIOSFODNN7EXAMPLE then mail ops@corp.example. {filler}");
    for cut in (0..=answer.len()).step_by(7) {
        let events = [
            openai_chunk(json!({"content": &answer[..cut]}), None),
            openai_chunk(json!({"content": &answer[cut..]}), None),
            openai_chunk(json!({}), Some("stop")),
            SseEvent::new(None, "[DONE]"),
        ];
        let ((out, held), counts) = run_with(Protocol::OpenAi, &m, &policy, &events);
        assert!(
            held <= answer.len().min(super::answer::HOLD + 20),
            "held {held}"
        );
        let text = openai_text(&out).0;
        assert_eq!(
            text,
            answer.replace("AKIAIOSFODNN7EXAMPLE", "[REDACTED_SECRET]"),
            "cut {cut}"
        );
        assert_eq!(counts.header(), "detected=email:1;redacted=secret:1");
    }
}

#[test]
fn choices_of_an_n_gt_1_stream_are_restored_separately() {
    let m = masker();
    let chunk = |ci: u64, text: &str| {
        let data =
            json!({"choices": [{"index": ci, "delta": {"content": text}, "finish_reason": null}]});
        SseEvent::new(None, &data.to_string())
    };
    let events = [
        chunk(0, "a <EMA"),
        chunk(1, "b <EMAIL_"),
        chunk(0, "IL_1> x"),
        chunk(1, "1> y"),
        SseEvent::new(None, "[DONE]"),
    ];
    let (out, _) = run(Protocol::OpenAi, &m, &events);
    let mut texts = [String::new(), String::new()];
    for ev in out.iter().filter(|e| e.data != "[DONE]") {
        let v: Value = serde_json::from_str(&ev.data).unwrap();
        let c = &v["choices"][0];
        texts[c["index"].as_u64().unwrap() as usize]
            .push_str(c["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!(texts, [format!("a {EMAIL} x"), format!("b {EMAIL} y")]);
}

#[test]
fn answer_values_of_every_kind_are_redacted_at_every_split_and_prose_flows() {
    let m = Masker::default();
    let g = Guard::builtin();
    let policy = Policy::parse(&g, [("default", "redact")]).unwrap();
    let values = [
        "GB82 WEST 1234 5698 7654 32",
        "(415) 555-0132",
        "+44 20 7946 0958",
        "4111 1111 1111 1111",
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEow IBAAKCAQ EA1234\n-----END RSA PRIVATE KEY-----",
        "jane.doe@corp.example",
        "postgres://admin:s3cr3t@db.internal",
    ];
    for value in values {
        let answer = format!("Here it is, as you asked: {value} and nothing more to add here.");
        let want = emit_all(&g, &policy, &answer);
        assert!(!want.contains(value), "{want}");
        for cut in 0..=answer.len() {
            if !answer.is_char_boundary(cut) {
                continue;
            }
            let events = [
                openai_chunk(json!({"content": &answer[..cut]}), None),
                openai_chunk(json!({"content": &answer[cut..]}), None),
                openai_chunk(json!({}), Some("stop")),
            ];
            let ((out, _), _) = run_with(Protocol::OpenAi, &m, &policy, &events);
            assert_eq!(openai_text(&out).0, want, "{value:?} cut at {cut}");
        }
    }
    // Prose with no value in sight is sent up to its last quiet space at once.
    let mut r = super::answer::Redactor::default();
    let sent = r.push(
        &g,
        &policy,
        "The deployment finished and looks healthy now",
        &mut Counts::default(),
    );
    assert_eq!(sent, "The deployment finished and looks healthy ");
}

fn emit_all(g: &Guard, p: &Policy, text: &str) -> String {
    super::answer::emit(g, p, text, &mut Counts::default())
}
