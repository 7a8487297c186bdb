//! `POST /v1/embeddings`: a pooled, non-streaming endpoint that fails over before the response
//! like every other request, served only by a pool's OpenAI-protocol variants.

use keel_core::embeddings::vector_to_base64;
use serde_json::{json, Value};

use crate::harness::*;

/// Three servers and four pools: `emb` (alias `vectors`) over two OpenAI-protocol variants
/// (`sim-0` first), `mixed` (an Anthropic-protocol variant `a` on `sim-2` weighted far above an
/// OpenAI one `o` on `sim-1`), `claude` (Anthropic only), and `emb-up` (as `emb`, answering
/// with the upstream's model name).
async fn start() -> Harness {
    let fleet = keel_sim::Fleet::start_n(3, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let (s0, s1, s2) = (fleet.get(0), fleet.get(1), fleet.get(2));
    let health = "[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n";
    let openai_pair = format!(
        "{}{}",
        variant("sim-0", &s0.openai_base(), "openai", 1000),
        variant("sim-1", &s1.openai_base(), "openai", 1)
    );
    let cfg = format!(
        "allow_force_variant = true\n\
         [[pools]]\nname = \"emb\"\naliases = [\"vectors\"]\n{health}{openai_pair}\
         [[pools]]\nname = \"mixed\"\n{health}{}{}\
         [[pools]]\nname = \"claude\"\n{health}{}\
         [[pools]]\nname = \"emb-up\"\nresponse_model = \"upstream\"\n{health}{openai_pair}",
        variant("a", &s2.anthropic_base(), "anthropic", 1000),
        variant("o", &s1.openai_base(), "openai", 1),
        variant("a", &s2.anthropic_base(), "anthropic", 1),
    );
    Harness::start(fleet, &cfg).await
}

async fn embed(h: &Harness, body: Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let r = h.post("/v1/embeddings", &body).await;
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.json().await.unwrap())
}

fn vectors(v: &Value) -> Vec<Vec<f32>> {
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            d["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

#[tokio::test]
async fn serves_embeddings_under_the_public_name() {
    let h = start().await;
    let body = json!({"model": "vectors", "input": ["first text", "second text"], "user": "u"});
    let (status, headers, v) = embed(&h, body.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(header(&headers, "x-keel-route"), "direct");
    assert_eq!(header(&headers, "x-keel-variant"), "sim-0");
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "vectors");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert_eq!(vectors(&v).len(), 2);
    assert_eq!(vectors(&v)[0].len(), 256);
    // Exactly what the server answers (keel renames the model only), and never streamed.
    let direct = reference_embeddings(&h, 0, &body).await;
    assert_eq!(v["data"], direct["data"]);
    let sent = h.server(0).state.last_body();
    assert_eq!(sent["model"], "sim");
    assert!(sent.get("stream").is_none(), "{sent}");

    // `response_model = "upstream"`: the upstream's name.
    let (_, _, v) = embed(&h, json!({"model": "emb-up", "input": "x"})).await;
    assert_eq!(v["model"], "sim");
    assert_eq!(
        h.metric(
            "keel_requests_total",
            &[("endpoint", "embeddings"), ("outcome", "ok")]
        )
        .await,
        2.0
    );
}

/// What server `i` answers to `body` directly.
async fn reference_embeddings(h: &Harness, i: usize, body: &Value) -> Value {
    let mut b = body.clone();
    b["model"] = json!("sim");
    keel_sim::http_client()
        .post(format!("{}/embeddings", h.server(i).openai_base()))
        .json(&b)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn fails_over_when_a_variant_answers_503() {
    let h = start().await;
    add_fault(h.server(0), json!({"kind": "error", "status": 503})).await;
    let (status, headers, v) = embed(&h, json!({"model": "emb", "input": "fail over"})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(header(&headers, "x-keel-variant"), "sim-1");
    assert_eq!(header(&headers, "x-keel-route"), "fallback");
    assert_eq!(header(&headers, "x-keel-attempts"), "2");
    assert_eq!(h.server(0).state.stats().errors, 1);
    assert_eq!(vectors(&v)[0].len(), 256);
}

#[tokio::test]
async fn fails_over_when_a_variant_refuses_connections() {
    let h = start().await;
    let refused = serde_json::from_value(json!({"kind": "refuse", "ms": 60_000})).unwrap();
    h.server(0).state.add_fault(refused);
    let addr = h.server(0).addr;
    wait_for!(
        "sim-0 to refuse connections",
        tokio::net::TcpStream::connect(addr).await.is_err()
    );
    let (status, headers, v) = embed(&h, json!({"model": "emb", "input": "still here"})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(header(&headers, "x-keel-variant"), "sim-1");
    assert_eq!(header(&headers, "x-keel-route"), "fallback");
}

#[tokio::test]
async fn a_mixed_pool_sends_embeddings_only_to_its_openai_variant() {
    let h = start().await;
    for i in 0..4 {
        let (status, headers, v) =
            embed(&h, json!({"model": "mixed", "input": format!("text {i}")})).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(header(&headers, "x-keel-variant"), "o");
        assert_eq!(header(&headers, "x-keel-attempts"), "1");
    }
    // Even when the Anthropic-protocol variant is forced first: it is left out of the plan
    // (it cannot serve embeddings) and the OpenAI one serves, with no attempt wasted.
    let r = h
        .post_with(
            "/v1/embeddings",
            &[("x-keel-force-variant", "a")],
            &json!({"model": "mixed", "input": "forced"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(r.headers(), "x-keel-variant"), "o");
    assert_eq!(header(r.headers(), "x-keel-attempts"), "1");
    assert_eq!(h.server(2).state.stats().requests, 0);
}

#[tokio::test]
async fn an_anthropic_only_pool_is_refused_naming_the_pool() {
    let h = start().await;
    let (status, _, v) = embed(&h, json!({"model": "claude", "input": "x"})).await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("`claude`") && m.contains("/v1/embeddings"),
        "{m}"
    );
    assert_eq!(h.server(2).state.stats().requests, 0);
}

#[tokio::test]
async fn bad_input_is_refused_naming_the_field() {
    let h = start().await;
    let cases = [
        (json!({"model": "emb"}), "`input`"),
        (json!({"model": "emb", "input": ""}), "`input`"),
        (json!({"model": "emb", "input": []}), "`input`"),
        (json!({"model": "emb", "input": ["ok", 7]}), "`input[1]`"),
        (json!({"model": "emb", "input": {"text": "x"}}), "`input`"),
        (
            json!({"model": "emb", "input": "x", "encoding_format": "int8"}),
            "`encoding_format`",
        ),
        (
            json!({"model": "emb", "input": "x", "dimensions": -1}),
            "`dimensions`",
        ),
        (json!({"input": "x"}), "`model`"),
    ];
    for (body, field) in cases {
        let (status, _, v) = embed(&h, body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(field), "{body}: {m}");
    }
    for i in 0..3 {
        assert_eq!(h.server(i).state.stats().requests, 0);
    }
}

#[tokio::test]
async fn base64_vectors_are_the_float_vectors_bytes() {
    let h = start().await;
    let input = json!(["one", "two words", "three little words"]);
    let (_, _, floats) = embed(
        &h,
        json!({"model": "emb", "input": input, "dimensions": 32}),
    )
    .await;
    let (status, _, b64) = embed(
        &h,
        json!({"model": "emb", "input": input, "dimensions": 32, "encoding_format": "base64"}),
    )
    .await;
    assert_eq!(status, 200, "{b64}");
    let floats = vectors(&floats);
    assert_eq!(floats.len(), 3);
    for (i, v) in floats.iter().enumerate() {
        assert_eq!(v.len(), 32);
        assert_eq!(b64["data"][i]["embedding"], vector_to_base64(v));
    }
}
