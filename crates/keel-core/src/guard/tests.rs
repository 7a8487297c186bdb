use proptest::prelude::*;

use super::mask::{apply, Counts, Masker, Restorer};
use super::policy::{Action, Policy, PolicyError};
use super::*;

fn found(text: &str) -> Vec<(&'static str, &str)> {
    Guard::builtin()
        .scan(text)
        .into_iter()
        .map(|f| (f.entity.builtin_name().unwrap(), &text[f.range]))
        .collect()
}

fn one(text: &str) -> Option<(&'static str, &str)> {
    let f = found(text);
    assert!(f.len() <= 1, "{text:?}: {f:?}");
    f.into_iter().next()
}

#[test]
fn finds_each_builtin_entity() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "write to jane.doe+work@example.co.uk today",
            "email",
            "jane.doe+work@example.co.uk",
        ),
        ("call +1 (415) 555-0132 now", "phone", "+1 (415) 555-0132"),
        ("call (415) 555-0132 now", "phone", "(415) 555-0132"),
        ("tel 415-555-0132.", "phone", "415-555-0132"),
        ("Tel.: 030 12345678", "phone", "030 12345678"),
        ("appelez le 06 12 34 56 78", "phone", "06 12 34 56 78"),
        ("llame al 612 345 678", "phone", "612 345 678"),
        ("+4915112345678", "phone", "+4915112345678"),
        (
            "card 4111 1111 1111 1111 exp",
            "card",
            "4111 1111 1111 1111",
        ),
        ("amex 3782-822463-10005", "card", "3782-822463-10005"),
        ("5555555555554444", "card", "5555555555554444"),
        (
            "IBAN: DE89 3704 0044 0532 0130 00.",
            "iban",
            "DE89 3704 0044 0532 0130 00",
        ),
        ("GB82WEST12345698765432", "iban", "GB82WEST12345698765432"),
        ("ssn 123-45-6789", "ssn", "123-45-6789"),
        ("host 192.168.10.254:8080", "ip", "192.168.10.254"),
        (
            "addr 2001:db8::8a2e:370:7334.",
            "ip",
            "2001:db8::8a2e:370:7334",
        ),
        ("fe80::1 is link-local", "ip", "fe80::1"),
        (
            "postgres://admin:s3cr3t@db.internal:5432/app",
            "url_credentials",
            "postgres://admin:s3cr3t@db.internal",
        ),
        ("AKIAIOSFODNN7EXAMPLE", "secret", "AKIAIOSFODNN7EXAMPLE"),
        (
            "key=sk-proj-abcdefghijklmnopqrstuvwxyz0123456789AB",
            "secret",
            "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789AB",
        ),
        (
            "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
            "secret",
            "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
        ),
        (
            "xoxb-1234567890-abcdefghij",
            "secret",
            "xoxb-1234567890-abcdefghij",
        ),
        (
            "AIzaSyA1234567890abcdefghijklmnopqrstuv",
            "secret",
            "AIzaSyA1234567890abcdefghijklmnopqrstuv",
        ),
        (
            "Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.abcdefghijklmnop",
            "secret",
            "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.abcdefghijklmnop",
        ),
    ];
    for (text, entity, value) in cases {
        assert_eq!(one(text), Some((*entity, *value)), "{text:?}");
    }
}

#[test]
fn pem_block_spans_to_its_footer_or_the_end() {
    let pem = "-----BEGIN RSA PRIVATE KEY-----\nMIIEow12\n-----END RSA PRIVATE KEY-----";
    let text = format!("key:\n{pem}\nthanks");
    assert_eq!(one(&text), Some(("secret", pem)));
    let cut = "x -----BEGIN PRIVATE KEY-----\nMIIEv 1234 5678";
    assert_eq!(one(cut), Some(("secret", &cut[2..])));
    assert_eq!(one("-----BEGIN CERTIFICATE-----\nMIIB\n"), None);
}

#[test]
fn hard_negatives_are_not_found() {
    let negatives = [
        "version 1.2.3 and v10.4.1-rc2 and 2.0",
        "order 4111111111111112 shipped", // Luhn fails
        "order 1234567812345678 shipped", // Luhn fails
        "ref 8888888888888888",           // no issuer
        "sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "commit 4b825dc642cb6eb9a060e54bf8d69288fbee4904",
        "DE89 3704 0044 0532 0130 01", // mod 97 fails
        "ssn 666-12-3456 and 000-12-3456 and 900-12-3456",
        "date 2024-03-15 and 15.03.2024 at 12:30:45",
        "price 1,234.56 and 1 000 000 units",
        "mac 00:1A:2B:3C:4D:5E and std::io::Write and self::de",
        "ip 256.1.1.1 and 1.2.3.4.5",
        "task-manager and sk-learn is a library",
        "user@localhost and @mention",
        "https://example.com/a@b",
        "the AKIA prefix alone AKIA123",
    ];
    for text in negatives {
        assert_eq!(found(text), vec![], "{text:?}");
    }
}

#[test]
fn values_next_to_non_ascii_text_are_found() {
    assert_eq!(
        one("邮箱alice@example.com。"),
        Some(("email", "alice@example.com"))
    );
    assert_eq!(
        one("Straße 5, IBAN:DE89370400440532013000"),
        Some(("iban", "DE89370400440532013000"))
    );
}

#[test]
fn validators() {
    assert!(luhn_valid(b"4111111111111111"));
    assert!(!luhn_valid(b"4111111111111112"));
    assert!(iban_valid(b"DE89370400440532013000"));
    assert!(!iban_valid(b"DE89370400440532013001"));
    assert!(!iban_valid(b"XX89370400440532013000"));
    assert!(ssn_valid(b"123456789"));
    assert!(!ssn_valid(b"666456789"));
    assert!(!ssn_valid(b"123006789"));
    assert!(!ssn_valid(b"123450000"));
}

fn custom_guard() -> Guard {
    Guard::with_custom(&[
        CustomSpec {
            name: "ticket".into(),
            regex: Some(r"\bTCK-\d{6}\b".into()),
            words: vec![],
        },
        CustomSpec {
            name: "codename".into(),
            regex: None,
            words: vec!["Bluebird".into(), "night owl".into()],
        },
    ])
    .unwrap()
}

#[test]
fn operator_patterns_and_words() {
    let g = custom_guard();
    let text = "TCK-123456 is for project bluebird, not bluebirds; Night Owl too";
    let got: Vec<_> = g
        .scan(text)
        .into_iter()
        .map(|f| {
            (
                g.entity_name(f.entity).to_string(),
                text[f.range].to_string(),
            )
        })
        .collect();
    let want = [
        ("ticket", "TCK-123456"),
        ("codename", "bluebird"),
        ("codename", "Night Owl"),
    ];
    let want: Vec<_> = want
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn operator_specs_are_validated_naming_the_spec() {
    let spec = |name: &str, regex: Option<&str>, words: &[&str]| CustomSpec {
        name: name.into(),
        regex: regex.map(Into::into),
        words: words.iter().map(|w| w.to_string()).collect(),
    };
    let cases = [
        (spec("bad", Some("(unclosed"), &[]), "does not compile"),
        (spec("empty", Some("a*"), &[]), "empty string"),
        (spec("email", Some("x"), &[]), "built-in"),
        (spec("Upper", Some("x"), &[]), "lowercase"),
        (spec("both", Some("x"), &["y"]), "not both"),
        (spec("none", None, &[]), "needs"),
    ];
    for (s, why) in cases {
        let name = s.name.clone();
        let e = Guard::with_custom(&[s]).unwrap_err();
        assert_eq!(e.name, name);
        assert!(e.to_string().contains(why), "{e}");
    }
    let dup = [spec("a", Some("x"), &[]), spec("a", Some("y"), &[])];
    assert!(Guard::with_custom(&dup)
        .unwrap_err()
        .reason
        .contains("twice"));
}

#[test]
fn policy_parse_and_overlay() {
    let g = custom_guard();
    let p = Policy::parse(
        &g,
        [
            ("default", "mask"),
            ("secret", "block"),
            ("ticket", "redact"),
        ],
    )
    .unwrap();
    assert_eq!(p.action(Entity::Email), Some(Action::Mask));
    assert_eq!(p.action(Entity::Secret), Some(Action::Block));
    assert_eq!(
        p.action(g.parse_entity("ticket").unwrap()),
        Some(Action::Redact)
    );
    assert_eq!(
        Policy::parse(&g, [("mail", "mask")]),
        Err(PolicyError::UnknownEntity("mail".into()))
    );
    assert!(matches!(
        Policy::parse(&g, [("email", "hide")]),
        Err(PolicyError::UnknownAction { .. })
    ));
    let key = Policy::parse(&g, [("email", "detect")]).unwrap();
    let both = p.overlaid(&key);
    assert_eq!(both.action(Entity::Email), Some(Action::Detect));
    assert_eq!(both.action(Entity::Secret), Some(Action::Block));
    assert!(Policy::default().is_empty());
}

#[test]
fn masking_is_stable_per_value_and_restores() {
    let g = Guard::builtin();
    let p = Policy::parse(
        &g,
        [("default", "mask"), ("ip", "redact"), ("ssn", "detect")],
    )
    .unwrap();
    let mut m = Masker::default();
    let mut c = Counts::default();
    let text = "a@x.com, b@x.com, a@x.com from 10.0.0.1 ssn 123-45-6789";
    let out = apply(&g, &p, text, &mut m, &mut c).unwrap();
    assert_eq!(
        out,
        "<EMAIL_1>, <EMAIL_2>, <EMAIL_1> from [REDACTED_IP] ssn 123-45-6789"
    );
    let again = apply(&g, &p, "to b@x.com", &mut m, &mut c).unwrap();
    assert_eq!(again, "to <EMAIL_2>");
    assert_eq!(c.header(), "detected=ssn:1;masked=email:4;redacted=ip:1");
    assert_eq!(
        m.restore(&out),
        "a@x.com, b@x.com, a@x.com from [REDACTED_IP] ssn 123-45-6789"
    );
    assert_eq!(m.remask("reply to a@x.com"), "reply to <EMAIL_1>");
    assert_eq!(apply(&g, &p, "nothing here", &mut m, &mut c), None);
}

fn masked_example() -> (Masker, String) {
    let g = Guard::builtin();
    let p = Policy::parse(&g, [("default", "mask")]).unwrap();
    let mut m = Masker::default();
    let out = apply(
        &g,
        &p,
        "mail jane@corp.example and 4111 1111 1111 1111",
        &mut m,
        &mut Counts::default(),
    );
    (m, out.unwrap())
}

#[test]
fn restorer_never_emits_half_a_placeholder_at_any_split() {
    let (m, masked) = masked_example();
    let answer = format!("Sure, I wrote to {masked} <b> and a < c.");
    let want = m.restore(&answer).into_owned();
    assert!(!want.contains("<EMAIL_1>") && want.contains("jane@corp.example"));
    for cut1 in 0..=answer.len() {
        for cut2 in cut1..=answer.len() {
            if !answer.is_char_boundary(cut1) || !answer.is_char_boundary(cut2) {
                continue;
            }
            let mut r = Restorer::default();
            let mut out = String::new();
            for part in [&answer[..cut1], &answer[cut1..cut2], &answer[cut2..]] {
                let emitted = r.push(&m, part);
                assert!(
                    !emitted.contains("<EMAIL") && !emitted.contains("<CARD"),
                    "{emitted:?}"
                );
                assert!(r.held() < m.longest());
                out.push_str(&emitted);
            }
            out.push_str(&r.finish(&m));
            assert_eq!(out, want);
        }
    }
}

proptest! {
    #[test]
    fn scan_never_panics_and_ranges_are_ordered_char_boundaries(s in "\\PC{0,200}") {
        let g = custom_guard();
        let f = g.scan(&s);
        let mut end = 0;
        for x in &f {
            prop_assert!(x.range.start >= end && x.range.start < x.range.end);
            prop_assert!(s.is_char_boundary(x.range.start) && s.is_char_boundary(x.range.end));
            end = x.range.end;
        }
    }

    #[test]
    fn noisy_ascii_never_panics(s in "[0-9a-zA-Z@:+()./ _-]{0,120}") {
        let _ = Guard::builtin().scan(&s);
    }

    #[test]
    fn planted_emails_are_found_and_restored(
        pre in "[a-z ,.]{0,40}", user in "[a-z][a-z0-9.]{0,10}[a-z0-9]", host in "[a-z]{2,10}",
        post in "[a-z ,.]{0,40}",
    ) {
        let email = format!("{user}@{host}.com");
        let text = format!("{pre} {email} {post}");
        let g = Guard::builtin();
        let got: Vec<_> = g.scan(&text).into_iter().map(|f| text[f.range].to_string()).collect();
        prop_assert_eq!(&got, &vec![email.clone()]);
        let p = Policy::parse(&g, [("email", "mask")]).unwrap();
        let mut m = Masker::default();
        let masked = apply(&g, &p, &text, &mut m, &mut Counts::default()).unwrap();
        prop_assert!(!masked.contains(&email));
        prop_assert_eq!(m.restore(&masked), text);
    }

    #[test]
    fn luhn_valid_visa_numbers_are_cards(body in proptest::collection::vec(0u8..10, 14)) {
        let mut d: Vec<u8> = std::iter::once(4).chain(body).collect();
        let check = (0..10).find(|c| {
            let mut t: Vec<u8> = d.iter().map(|x| b'0' + x).collect();
            t.push(b'0' + c);
            luhn_valid(&t)
        }).unwrap();
        d.push(check);
        let s: String = d.iter().map(|x| char::from(b'0' + x)).collect();
        let text = format!("pay with {s} please");
        prop_assert_eq!(one(&text), Some(("card", s.as_str())));
    }
}

fn data_set() -> Vec<eval::Item> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../bench/data/guard/texts.jsonl"
    );
    let text = std::fs::read_to_string(path).expect("bench/data/guard/texts.jsonl");
    eval::parse_jsonl(&text).expect("data set parses")
}

#[test]
fn labelled_data_set_meets_the_precision_and_recall_goals() {
    let items = data_set();
    assert!(items.len() >= 2000);
    let report = eval::evaluate(&Guard::builtin(), &items);
    let checked = ["card", "iban", "ssn", "secret"];
    for (entity, t) in &report {
        let goal = if checked.contains(&entity.as_str()) {
            0.99
        } else {
            0.95
        };
        assert!(
            t.precision() >= goal && t.recall() >= goal,
            "{entity}: precision {:.3} recall {:.3} ({t:?})",
            t.precision(),
            t.recall()
        );
    }
    assert_eq!(report.len(), 8, "{report:?}");
}

#[test]
fn data_set_values_survive_masking_and_chunked_restoring() {
    let g = Guard::builtin();
    let p = Policy::parse(&g, [("default", "mask")]).unwrap();
    for item in data_set().iter().take(400) {
        let mut m = Masker::default();
        let Some(masked) = apply(&g, &p, &item.text, &mut m, &mut Counts::default()) else {
            continue;
        };
        let mut r = Restorer::default();
        let mut out = String::new();
        let mut last = 0;
        let cuts: Vec<usize> = masked.char_indices().map(|(i, _)| i).step_by(3).collect();
        for &c in cuts.iter().chain([masked.len()].iter()) {
            out.push_str(&r.push(&m, &masked[last..c]));
            last = c;
        }
        out.push_str(&r.finish(&m));
        assert_eq!(out, item.text, "item {}", item.id);
    }
}

#[test]
fn request_bodies_are_masked_where_models_read_them() {
    let g = Guard::builtin();
    let p = Policy::parse(&g, [("default", "mask"), ("secret", "block")]).unwrap();
    let mut body = serde_json::json!({
        "model": "a@b.com-model",
        "system": [{"type": "text", "text": "Reply to jane\u{200B}@corp.example"}],
        "messages": [
            {"role": "user", "content": "mail jane@corp.example, key AKIAIOSFODNN7EXAMPLE"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
              "function": {"name": "send", "arguments": "{\"to\":\"jane@corp.example\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sent to bob@corp.example"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.abcdefghijklmnop"}}]}
        ],
        "tools": [{"type": "function", "function": {"name": "send", "description": "sends to ops@corp.example"}}]
    });
    let mut m = Masker::default();
    let mut c = Counts::default();
    body::apply_body(&g, &p, body.as_object_mut().unwrap(), &mut m, &mut c);
    assert_eq!(body["model"], "a@b.com-model");
    assert_eq!(body["system"][0]["text"], "Reply to <EMAIL_1>");
    assert_eq!(
        body["messages"][0]["content"],
        "mail <EMAIL_1>, key AKIAIOSFODNN7EXAMPLE"
    );
    assert_eq!(
        body["messages"][1]["tool_calls"][0]["function"]["arguments"],
        "{\"to\":\"<EMAIL_1>\"}"
    );
    assert_eq!(body["messages"][2]["content"], "sent to <EMAIL_2>");
    assert_eq!(
        body["tools"][0]["function"]["description"],
        "sends to <EMAIL_3>"
    );
    assert_eq!(c.header(), "masked=email:5;blocked=secret:1");
}

#[test]
fn restoring_inside_json_escapes_the_value() {
    let g = Guard::builtin();
    let p = Policy::parse(&g, [("secret", "mask")]).unwrap();
    let pem = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----";
    let mut m = Masker::default();
    let masked = apply(&g, &p, pem, &mut m, &mut Counts::default()).unwrap();
    assert_eq!(masked, "<SECRET_1>");
    let answer = serde_json::json!({"content": "your key: <SECRET_1>"}).to_string();
    let restored = m.restore_json(&answer);
    let v: serde_json::Value = serde_json::from_str(&restored).unwrap();
    assert_eq!(v["content"], format!("your key: {pem}"));
}
