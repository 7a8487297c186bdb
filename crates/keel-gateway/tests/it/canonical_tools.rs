//! Stable upstream bytes for prompt caches (`canonical_tools`): clients that send the same tools
//! with their keys in another order reach the upstream with identical tool text, so its prefix
//! cache (which sees the tools first, as a chat template renders them) keeps hitting.

use serde_json::{json, Map, Value};

use crate::harness::*;

/// The same tool, its keys in the `n`th of 20 orders (as different clients and SDK versions
/// send them).
fn tools(n: usize) -> Value {
    let fields = ["word", "lang", "region", "register", "era"];
    let mut props = Map::new();
    for k in 0..fields.len() {
        props.insert(
            fields[(k + n) % fields.len()].into(),
            json!({"type": "string"}),
        );
    }
    let parameters = json!({"type": "object", "properties": props, "required": ["word"]});
    let mut function = Map::new();
    let parts = [
        ("name", json!("lookup")),
        ("description", json!("Look a word up")),
        ("parameters", parameters),
    ];
    for k in 0..3 {
        let (key, v) = &parts[if (n / 5).is_multiple_of(2) { k } else { 2 - k }];
        function.insert((*key).into(), v.clone());
    }
    let mut tool = Map::new();
    if (n / 10).is_multiple_of(2) {
        tool.insert("type".into(), json!("function"));
        tool.insert("function".into(), Value::Object(function));
    } else {
        tool.insert("function".into(), Value::Object(function));
        tool.insert("type".into(), json!("function"));
    }
    json!([tool])
}

/// Cached prompt tokens over 20 requests, each with the tool's keys in another order (the
/// first request only fills the cache).
async fn cached_tokens(canonical: bool) -> (u64, u64) {
    let h = Harness::openai(
        1,
        1,
        "",
        &format!("hedge = \"off\"\ncanonical_tools = {canonical}\n"),
    )
    .await;
    let system = "You are a careful dictionary assistant. ".repeat(20);
    let mut cached = 0;
    let mut prompt = 0;
    for i in 0..20 {
        let body = json!({"model": "p", "max_tokens": 8, "tools": tools(i),
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "define serendipity"}]});
        let (status, _, v) = h.chat(&body).await;
        assert_eq!(status, 200, "{v}");
        if i >= 1 {
            cached += v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            prompt += v["usage"]["prompt_tokens"].as_u64().unwrap();
        }
    }
    let seen = h.server(0).state.last_body();
    if canonical {
        // What the server saw is the sorted form, whatever the client sent last.
        let keys: Vec<&String> = seen["tools"][0].as_object().unwrap().keys().collect();
        assert_eq!(keys, ["function", "type"]);
    }
    (cached, prompt)
}

#[tokio::test]
async fn tools_in_varying_key_order_keep_the_upstream_prefix_cache_hitting() {
    let (plain, prompt) = cached_tokens(false).await;
    let (canonical, _) = cached_tokens(true).await;
    println!(
        "prefix cache, tools in 20 key orders: {plain} of {prompt} prompt tokens cached as sent, {canonical} with canonical_tools"
    );
    assert!(
        canonical > plain,
        "canonical_tools must raise the hit rate ({plain} → {canonical})"
    );
    assert!(canonical * 10 >= prompt * 9, "{canonical} of {prompt}");
}
