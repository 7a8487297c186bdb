//! Context fit: a prompt no variant can hold is refused at once with a 400 naming the sizes (in
//! the client's protocol), a long prompt goes to a variant whose window holds it, middle-out
//! trims a long conversation and says so, and a huge prompt fails fast whether keel knows the
//! windows or only the upstream does.

use keel_sim::{Fleet, FleetConfig, ServerConfig};
use serde_json::{json, Value};

use crate::harness::*;

/// Two fast servers with the given upstream windows (`None`: no limit).
async fn fleet(windows: [Option<u64>; 2]) -> Fleet {
    let servers = windows
        .iter()
        .enumerate()
        .map(|(i, w)| ServerConfig {
            context_window: *w,
            ..ServerConfig::fast(&format!("sim-{i}"))
        })
        .collect();
    Fleet::start(&FleetConfig {
        servers,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// One pool `p` over the fleet; variant `i` declares `windows[i]` as its `context_window`.
fn config(fleet: &Fleet, protocol: &str, windows: [Option<u64>; 2], pool_extra: &str) -> String {
    let mut s = format!("max_body_bytes = 16777216\n[[pools]]\nname = \"p\"\n{pool_extra}\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n");
    for (i, srv) in fleet.servers.iter().enumerate() {
        let url = if protocol == "openai" {
            srv.openai_base()
        } else {
            srv.anthropic_base()
        };
        s.push_str(&variant(&srv.name, &url, protocol, 1));
        if let Some(w) = windows[i] {
            s.push_str(&format!("context_window = {w}\n"));
        }
    }
    s
}

async fn start(upstream: [Option<u64>; 2], declared: [Option<u64>; 2], extra: &str) -> Harness {
    let f = fleet(upstream).await;
    let cfg = config(&f, "openai", declared, extra);
    Harness::start(f, &cfg).await
}

/// About `n` tokens of English.
fn words(n: usize) -> String {
    "the quick brown fox jumps over the lazy dog ".repeat(n / 9 + 1)
}

fn upstream_requests(h: &Harness) -> u64 {
    (0..2).map(|i| h.server(i).state.stats().requests).sum()
}

async fn post(h: &Harness, path: &str, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let headers: &[(&str, &str)] = if path == "/v1/messages" {
        &[("anthropic-version", "2023-06-01")]
    } else {
        &[]
    };
    let r = h.post_with(path, headers, body).await;
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_prompt_no_window_holds_gets_an_immediate_400_naming_the_sizes_in_both_protocols() {
    let h = start([None, None], [Some(1000), Some(2000)], "").await;
    let prompt = words(3000);
    let (status, _, v) = post(&h, "/v1/chat/completions", &json!({"model": "p", "messages": [{"role": "user", "content": prompt}], "max_tokens": 100})).await;
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("context length exceeded") && msg.contains("2000 tokens"),
        "{msg}"
    );
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let (status, _, v) = post(&h, "/v1/messages", &json!({"model": "p", "max_tokens": 100, "messages": [{"role": "user", "content": prompt}]})).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("2000 tokens"), "{msg}");
    // Refused at admission: no upstream saw it.
    assert_eq!(upstream_requests(&h), 0);

    // max_tokens counts too: a short prompt asking for more output than any window holds.
    let (status, _, v) = post(
        &h,
        "/v1/chat/completions",
        &json!({"model": "p", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}),
    )
    .await;
    assert_eq!(status, 400, "{v}");
}

#[tokio::test]
async fn a_long_prompt_goes_to_the_variant_whose_window_holds_it() {
    let h = start([None, None], [Some(500), Some(100_000)], "").await;
    let long = json!({"model": "p", "messages": [{"role": "user", "content": words(2000)}], "max_tokens": 16});
    for _ in 0..8 {
        let (status, headers, v) = post(&h, "/v1/chat/completions", &long).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(header(&headers, "x-keel-variant"), "sim-1");
    }
    assert_eq!(h.server(0).state.stats().requests, 0);
}

/// system, first user, 20 middle turns of about 60 tokens each, last user.
fn long_conversation() -> Vec<Value> {
    let mut ms = vec![
        json!({"role": "system", "content": "You answer briefly."}),
        json!({"role": "user", "content": "first question"}),
    ];
    for i in 0..20 {
        let role = if i % 2 == 0 { "assistant" } else { "user" };
        ms.push(json!({"role": role, "content": format!("turn {i}: {}", words(60))}));
    }
    ms.push(json!({"role": "user", "content": "the last question"}));
    ms
}

#[tokio::test]
async fn middle_out_trims_a_long_conversation_to_fit_and_says_so() {
    let h = start(
        [None, None],
        [Some(400), Some(400)],
        "transforms = [\"middle-out\"]",
    )
    .await;
    let messages = long_conversation();
    let (status, headers, v) = post(
        &h,
        "/v1/chat/completions",
        &json!({"model": "p", "messages": messages, "max_tokens": 20}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(header(&headers, "x-keel-prompt-fix"), "middle_out_trimmed");
    let trimmed: usize = header(&headers, "x-keel-trimmed-messages").parse().unwrap();
    let variant = header(&headers, "x-keel-variant");
    let i = usize::from(variant == "sim-1");
    let sent = h.server(i).state.last_body();
    let sent = sent["messages"].as_array().unwrap();
    assert_eq!(sent.len() + trimmed, messages.len());
    assert!(trimmed >= 15, "{trimmed} dropped");
    // The ends are kept, in order; what was dropped came from the middle.
    assert_eq!(sent[0], messages[0]);
    assert_eq!(sent[1], messages[1]);
    assert_eq!(sent.last(), messages.last());
    let kept_middle: Vec<&Value> = sent[2..sent.len() - 1].iter().collect();
    for m in &kept_middle {
        let pos = messages.iter().position(|x| x == *m).unwrap();
        assert!(
            !(8..14).contains(&pos),
            "the middle turn {pos} was kept: {kept_middle:?}"
        );
    }

    // A conversation that fits is left alone.
    let (status, headers, _) = post(&h, "/v1/chat/completions", &chat_body("hi")).await;
    assert_eq!(status, 200);
    assert!(headers.get("x-keel-prompt-fix").is_none());

    // Even the messages always kept do not fit: 400 that says so.
    let body = json!({"model": "p", "max_tokens": 20, "messages": [{"role": "user", "content": words(1000)}]});
    let (status, _, v) = post(&h, "/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("middle-out"),
        "{v}"
    );
}

/// A 9 MB prompt (the report: 45 s and a 504 from the demo before).
fn huge() -> String {
    "All work and no play makes keel a dull gateway. ".repeat(9_000_000 / 48)
}

#[tokio::test]
async fn a_huge_prompt_is_refused_at_admission_when_windows_are_known() {
    let h = start([None, None], [Some(128_000), Some(128_000)], "").await;
    let body = json!({"model": "p", "messages": [{"role": "user", "content": huge()}]});
    let (status, headers, v) = post(&h, "/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("needs more than") && msg.contains("128000 tokens"),
        "{msg}"
    );
    assert_eq!(header(&headers, "x-keel-attempts"), "0");
    assert_eq!(upstream_requests(&h), 0);
}

#[tokio::test]
async fn an_upstream_context_length_error_reaches_the_client_at_once_in_both_protocols() {
    // keel knows no window; the upstreams do (and would otherwise spend minutes on prefill).
    for protocol in ["openai", "anthropic"] {
        let f = fleet([Some(128_000), Some(128_000)]).await;
        let cfg = config(&f, protocol, [None, None], "");
        let h = Harness::start(f, &cfg).await;
        for path in ["/v1/chat/completions", "/v1/messages"] {
            // 1 MB (about 200k tokens): past the window, and lighter on the test machine.
            let text = "All work and no play makes keel a dull gateway. ".repeat(1_000_000 / 48);
            let body = json!({"model": "p", "max_tokens": 16, "messages": [{"role": "user", "content": text}]});
            let (status, headers, v) = post(&h, path, &body).await;
            assert_eq!(status, 400, "{protocol} {path}: {v}");
            // Not retried on the other variant: the client's error, returned as it came.
            assert_eq!(
                header(&headers, "x-keel-attempts"),
                "1",
                "{protocol} {path}"
            );
            let text = v.to_string();
            assert!(
                text.contains("maximum context length") || text.contains("prompt is too long"),
                "{protocol} {path}: {text}"
            );
        }
        assert_eq!(upstream_requests(&h), 2, "{protocol}");
    }
}
