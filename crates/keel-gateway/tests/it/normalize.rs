//! Prompt normalization at admission: what reaches the upstream, the fix codes reported, and
//! the opt-outs (header and first line) that leave the prompt byte-identical.

use keel_gateway::state::keys::{hash_secret, hash_text};
use keel_sim::{Fleet, ServerConfig};
use serde_json::json;

use crate::harness::*;

const MESSY: &str = "  Summarise \u{201c}the report\u{201d}\u{00a0}in  three\u{200b} bullets.\r\n\r\n\r\n\r\nKeep `a  \u{201c}b\u{201d}` as is.  ";

fn body(text: &str) -> serde_json::Value {
    json!({"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": text}]})
}

#[tokio::test]
async fn a_messy_prompt_reaches_the_upstream_normalized_with_its_fix_codes() {
    let h = Harness::openai(1, 1, "", "hedge = \"off\"\nnormalize = \"syntax\"\n").await;
    let r = h.post("/v1/chat/completions", &body(MESSY)).await;
    assert_eq!(r.status(), 200);
    let fixes = header(r.headers(), "x-keel-prompt-fix").to_owned();
    for code in ["quotes_ascii", "invisible_removed", "crlf_to_lf", "trimmed"] {
        assert!(fixes.contains(code), "{code} missing from {fixes}");
    }
    let sent = h.server(0).state.last_body();
    assert_eq!(
        sent["messages"][0]["content"],
        "Summarise \"the report\" in three bullets.\n\nKeep `a  \u{201c}b\u{201d}` as is.",
        "prose normalized, inline code untouched"
    );
    assert!(
        h.metric("keel_prompt_fixes_total", &[("fix", "quotes_ascii")])
            .await
            >= 1.0
    );

    // Opt-outs: the header, and a first line that is removed before forwarding.
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-normalize", "off")],
            &body(MESSY),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        h.server(0).state.last_body()["messages"][0]["content"],
        MESSY
    );
    let r = h
        .post(
            "/v1/chat/completions",
            &body(&format!("#keel-no-normalize\n{MESSY}")),
        )
        .await;
    assert_eq!(header(r.headers(), "x-keel-prompt-fix"), "opt_out");
    assert_eq!(
        h.server(0).state.last_body()["messages"][0]["content"],
        MESSY
    );

    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-normalize", "loud")],
            &body(MESSY),
        )
        .await;
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn a_pool_without_normalize_forwards_the_prompt_as_sent() {
    let h = Harness::openai(1, 1, "", "hedge = \"off\"\n").await;
    let r = h.post("/v1/chat/completions", &body(MESSY)).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-keel-prompt-fix").is_none());
    assert_eq!(
        h.server(0).state.last_body()["messages"][0]["content"],
        MESSY
    );
}

#[tokio::test]
async fn full_mode_uses_the_pool_rules_and_repairs_a_json_example() {
    let pool = "hedge = \"off\"\nnormalize = \"full\"\n[[pools.normalize_rules]]\nname = \"friendly\"\npattern = 'be\\s+(nice|kind)'\nreplacement = \"Use a warm tone\"\n";
    let h = Harness::openai(1, 1, "", pool).await;
    let r = h
        .post(
            "/v1/chat/completions",
            &body("Be  nice. Reply like {\"ok\": true"),
        )
        .await;
    assert_eq!(r.status(), 200);
    let fixes = header(r.headers(), "x-keel-prompt-fix").to_owned();
    for code in [
        "spaces_collapsed",
        "rule_rewritten:friendly",
        "schema_brace_recovered",
    ] {
        assert!(fixes.contains(code), "{code} missing from {fixes}");
    }
    assert_eq!(
        h.server(0).state.last_body()["messages"][0]["content"],
        "Use a warm tone. Reply like {\"ok\": true}"
    );
    assert!(
        h.metric(
            "keel_prompt_fixes_total",
            &[("fix", "rule_rewritten:friendly")]
        )
        .await
            >= 1.0
    );
}

#[tokio::test]
async fn x_keel_normalize_full_applies_the_built_in_rules_on_a_syntax_pool() {
    let pool = "hedge = \"off\"\nnormalize = \"syntax\"\nclient_normalize = [\"off\", \"syntax\", \"full\"]\n";
    let h = Harness::openai(1, 1, "", pool).await;
    let prompt = "Summarize this.  Don't use markdown.";
    let r = h.post("/v1/chat/completions", &body(prompt)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        h.server(0).state.last_body()["messages"][0]["content"],
        "Summarize this. Don't use markdown."
    );
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-normalize", "full")],
            &body(prompt),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert!(header(r.headers(), "x-keel-prompt-fix").contains("rule_rewritten:no_markdown"));
    assert_eq!(
        h.server(0).state.last_body()["messages"][0]["content"],
        "Summarize this. Output plain text only, with no formatting characters."
    );
}

/// `x-keel-normalize: full` is the operator's to offer: refused by default (400 in the
/// client's protocol, naming the modes allowed), accepted where the pool's or the key's
/// `client_normalize` lists it; the mode that applies anyway is always accepted.
#[tokio::test]
async fn a_client_may_choose_full_only_where_the_operator_allows_it() {
    let (plain, trusted) = (
        "sk-normalize-plain-0123456789",
        "sk-normalize-trusted-0123456789",
    );
    let hash = |k: &str| hash_text(&hash_secret(k));
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "[[keys]]\nid = \"plain\"\nhash = \"{}\"\nrpm = 3\n\n[[keys]]\nid = \"trusted\"\nhash = \"{}\"\nclient_normalize = [\"full\"]\n\n[[keys]]\nid = \"ops\"\nhash = \"{}\"\nroles = [\"ops\"]\n\n{}\n{}",
        hash(plain),
        hash(trusted),
        hash("sk-normalize-ops-reader-0123456"),
        pool_over(&fleet, "p", "openai", 1, "hedge = \"off\"\n"),
        pool_over(&fleet, "q", "openai", 1, "hedge = \"off\"\nclient_normalize = [\"syntax\", \"full\"]\n"),
    );
    let mut h = Harness::start(fleet, &cfg).await;
    h.ops_key = Some("sk-normalize-ops-reader-0123456".into());
    let h = h;
    let example = "Reply like {\"ok\": true";
    let ask = |key: &'static str, model: &'static str, mode: &'static str| {
        let h = &h;
        async move {
            let auth = format!("Bearer {key}");
            let mut b = body(example);
            b["model"] = json!(model);
            h.post_with(
                "/v1/chat/completions",
                &[("authorization", auth.as_str()), ("x-keel-normalize", mode)],
                &b,
            )
            .await
        }
    };
    // By default: off and syntax, not full.
    assert_eq!(ask(plain, "p", "syntax").await.status(), 200);
    assert_eq!(ask(plain, "p", "off").await.status(), 200);
    for _ in 0..3 {
        let r = ask(plain, "p", "full").await;
        assert_eq!(r.status(), 400, "refused before the key's limits, not 429");
        let b: serde_json::Value = r.json().await.unwrap();
        let msg = b["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("full is not allowed") && msg.contains("allowed: off, syntax"),
            "{msg}"
        );
    }
    assert_eq!(
        h.metric(
            "keel_prompt_fixes_total",
            &[("fix", "schema_brace_recovered")]
        )
        .await,
        0.0,
        "no full normalization ran"
    );
    // In the client's protocol.
    let r = h
        .post_with(
            "/v1/messages",
            &[
                ("authorization", &format!("Bearer {trusted}")),
                ("x-keel-normalize", "syntax"),
            ],
            &json!({"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status(), 400);
    let b: serde_json::Value = r.json().await.unwrap();
    assert_eq!(b["type"], "error");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("key `trusted`"),
        "{b}"
    );
    // Where the pool lists it, or the key does.
    for (key, model) in [(plain, "q"), (trusted, "p")] {
        let r = ask(key, model, "full").await;
        assert_eq!(r.status(), 200, "{key} on {model}");
        assert!(header(r.headers(), "x-keel-prompt-fix").contains("schema_brace_recovered"));
        assert_eq!(
            h.server(0).state.last_body()["messages"][0]["content"],
            "Reply like {\"ok\": true}"
        );
    }
    assert!(
        h.metric("keel_prompt_repair_bytes_total", &[("pool", "q")])
            .await
            > 0.0
    );
}

/// A key's `normalize` applies to its requests on a pool without one; another key's requests go
/// as sent, and the request header still wins over the key.
#[tokio::test]
async fn a_keys_normalize_mode_applies_to_its_requests_only() {
    let (tidy, plain) = (
        "sk-normalize-tidy-0123456789",
        "sk-normalize-plain-0123456789",
    );
    let hash = |k: &str| hash_text(&hash_secret(k));
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "[[keys]]\nid = \"tidy\"\nhash = \"{}\"\nnormalize = \"syntax\"\n\n[[keys]]\nid = \"plain\"\nhash = \"{}\"\n\n{}",
        hash(tidy),
        hash(plain),
        pool_over(&fleet, "p", "openai", 1, "hedge = \"off\"\n")
    );
    let h = Harness::start(fleet, &cfg).await;
    let ask = |key: &'static str, extra: Option<(&'static str, &'static str)>| {
        let h = &h;
        async move {
            let auth = format!("Bearer {key}");
            let mut headers = vec![("authorization", auth.as_str())];
            headers.extend(extra);
            let r = h
                .post_with("/v1/chat/completions", &headers, &body(MESSY))
                .await;
            assert_eq!(r.status(), 200);
            let fixes = r
                .headers()
                .get("x-keel-prompt-fix")
                .map(|v| v.to_str().unwrap().to_owned());
            let sent = h.server(0).state.last_body()["messages"][0]["content"]
                .as_str()
                .unwrap()
                .to_owned();
            (fixes, sent)
        }
    };
    let (fixes, sent) = ask(tidy, None).await;
    assert!(fixes.is_some_and(|f| !f.is_empty()), "fix codes reported");
    assert_ne!(sent, MESSY, "the tidy key's prompt is normalized");
    let (fixes, sent) = ask(plain, None).await;
    assert!(fixes.is_none());
    assert_eq!(sent, MESSY, "the other key's prompt goes as sent");
    let (_, sent) = ask(tidy, Some(("x-keel-normalize", "off"))).await;
    assert_eq!(sent, MESSY, "the request's header wins over the key");
}

/// With `decision_prompt_edits = true`, the decision record shows what normalization changed:
/// the text around each change, before and after, with invisible characters written out; by
/// default it keeps no prompt text there.
#[tokio::test]
async fn the_decision_record_shows_the_prompts_edits() {
    for keep in [true, false] {
        let top = if keep {
            "decision_prompt_edits = true\n"
        } else {
            ""
        };
        let h = Harness::openai(1, 1, top, "hedge = \"off\"\nnormalize = \"syntax\"\n").await;
        let r = h.post("/v1/chat/completions", &body(MESSY)).await;
        assert_eq!(r.status(), 200);
        let id = header(r.headers(), "x-keel-request-id").to_owned();
        let _ = r.bytes().await;
        let record = h.get_json(&format!("/keel/decisions/{id}")).await;
        assert!(record["prompt_fixes"]
            .as_array()
            .is_some_and(|f| !f.is_empty()));
        if !keep {
            assert!(record.get("prompt_edits").is_none(), "{record}");
            continue;
        }
        let edits = record["prompt_edits"].as_array().expect("edits").clone();
        assert!(edits.iter().all(|e| e["at"] == "messages[0]"), "{edits:?}");
        let sides = |k: &str| -> Vec<String> {
            edits
                .iter()
                .map(|e| e[k].as_str().unwrap().to_owned())
                .collect()
        };
        let (before, after) = (sides("before").concat(), sides("after").concat());
        assert!(
            before.contains("\u{201c}the report\u{201d}\\u{a0}in"),
            "{before}"
        );
        assert!(after.contains("\"the report\" in"), "{after}");
        assert!(before.contains("three\\u{200b} bullets.\\r\n"), "{before}");
        assert!(
            !after.contains("\\u{200b}") && !after.contains("\\r"),
            "{after}"
        );
    }
}
