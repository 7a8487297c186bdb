//! `POST /v1/messages/count_tokens` answered from the pools: forwarded to an Anthropic-protocol
//! variant where the pool has one (also when the client names the pool by an alias, and in a
//! mixed pool whose preferred variant speaks OpenAI), estimated by keel otherwise.

use serde_json::{json, Value};

use crate::harness::*;

/// Pool `mixed` (alias `mixed-alias`): OpenAI-protocol `o` on `sim-0`, weighted far above an
/// Anthropic-protocol `a` on `sim-1`; pool `gpt` (alias `gpt-alias`): OpenAI only, on `sim-0`.
async fn start() -> Harness {
    let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let (s0, s1) = (fleet.get(0), fleet.get(1));
    let health = "[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n";
    let cfg = format!(
        "[[pools]]\nname = \"mixed\"\naliases = [\"mixed-alias\"]\n{health}{}{}\
         [[pools]]\nname = \"gpt\"\naliases = [\"gpt-alias\"]\n{health}{}",
        variant("o", &s0.openai_base(), "openai", 1000),
        variant("a", &s1.anthropic_base(), "anthropic", 1),
        variant("o", &s0.openai_base(), "openai", 1),
    );
    Harness::start(fleet, &cfg).await
}

async fn count(h: &Harness, model: &str) -> (u16, reqwest::header::HeaderMap, Value) {
    let body = json!({"model": model, "system": "Be brief.",
        "messages": [{"role": "user", "content": "How many tokens is this?"}]});
    let r = h
        .post_with(
            "/v1/messages/count_tokens",
            &[("anthropic-version", "2023-06-01")],
            &body,
        )
        .await;
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.json().await.unwrap())
}

#[tokio::test]
async fn a_mixed_pool_forwards_count_tokens_to_its_anthropic_variant() {
    let h = start().await;
    for model in ["mixed", "mixed-alias"] {
        let before = h.server(1).state.stats().requests;
        let (status, headers, v) = count(&h, model).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(header(&headers, "x-keel-variant"), "a");
        assert!(v["input_tokens"].as_u64().unwrap() > 0, "{v}");
        assert_eq!(h.server(1).state.stats().requests, before + 1);
    }
    // Never sent to the OpenAI-protocol variant, which has no such endpoint.
    assert_eq!(h.server(0).state.stats().requests, 0);
}

#[tokio::test]
async fn an_openai_only_pool_answers_keels_estimate_under_any_of_its_names() {
    let h = start().await;
    let (_, _, by_name) = count(&h, "gpt").await;
    let (status, _, by_alias) = count(&h, "gpt-alias").await;
    assert_eq!(status, 200);
    assert_eq!(by_name, by_alias);
    assert!(by_name["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(h.server(0).state.stats().requests, 0);
}
