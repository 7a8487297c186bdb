//! The simulator's embeddings, structured output (`response_format`) and image inputs, on the
//! wire.

use keel_core::embeddings::vector_to_base64;
use keel_core::sse::decode_all;
use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};

async fn post(url: &str, body: &Value) -> reqwest::Response {
    keel_sim::http_client()
        .post(url)
        .json(body)
        .send()
        .await
        .expect("request sent")
}

async fn embed(base: &str, body: Value) -> (u16, Value) {
    let r = post(&format!("{base}/embeddings"), &body).await;
    (r.status().as_u16(), r.json().await.unwrap())
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[tokio::test]
async fn embeddings_follow_the_openai_shape_on_every_server() {
    let fleet = Fleet::start_n(2, ServerConfig::fast("e")).await.unwrap();
    let (a, b) = (fleet.get(0).openai_base(), fleet.get(1).openai_base());
    let body = json!({"model": "emb", "input": ["hello world", "routing keel"], "user": "u1"});
    let (status, v) = embed(&a, body.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "emb");
    assert_eq!(v["usage"], json!({"prompt_tokens": 4, "total_tokens": 4}));
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d["object"], "embedding");
        assert_eq!(d["index"], i);
        let e = floats(&d["embedding"]);
        assert_eq!(e.len(), 256);
        let norm: f32 = e.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    }
    assert_ne!(data[0]["embedding"], data[1]["embedding"]);
    // Another server gives the same text the same vector.
    assert_eq!(embed(&b, body).await.1["data"], v["data"]);

    // base64: the little-endian f32 bytes of the float vector.
    let (_, b64) = embed(
        &a,
        json!({"model": "emb", "input": "hello world", "encoding_format": "base64"}),
    )
    .await;
    let want = vector_to_base64(&floats(&data[0]["embedding"]));
    assert_eq!(b64["data"][0]["embedding"], want);

    // dimensions and token-id inputs.
    let (_, short) = embed(
        &a,
        json!({"model": "emb", "input": [[1, 2, 3], [4]], "dimensions": 8}),
    )
    .await;
    assert_eq!(short["data"][1]["embedding"].as_array().unwrap().len(), 8);
    assert_eq!(short["usage"]["prompt_tokens"], 4);
}

#[tokio::test]
async fn embeddings_errors_and_faults() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("e")).await.unwrap();
    let s = fleet.get(0);
    let base = s.openai_base();
    let (status, v) = embed(&base, json!({"model": "emb", "input": ["a", 2]})).await;
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("input[1]"),
        "{v}"
    );

    let r = post(
        &format!("http://{}/sim/faults", s.addr),
        &json!({"kind": "error", "status": 503, "count": 1}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        embed(&base, json!({"model": "emb", "input": "x"})).await.0,
        503
    );
    assert_eq!(
        embed(&base, json!({"model": "emb", "input": "x"})).await.0,
        200
    );

    // Anthropic's API has no embeddings: a request addressed to it gets Anthropic's 404.
    let r = keel_sim::http_client()
        .post(format!("{}/v1/embeddings", s.anthropic_base()))
        .header("anthropic-version", "2023-06-01")
        .json(&json!({"model": "emb", "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        (v["type"].as_str(), v["error"]["type"].as_str()),
        (Some("error"), Some("not_found_error"))
    );
}

fn chat_with_format(format: Value, stream: bool) -> Value {
    json!({"model": "sim", "stream": stream, "response_format": format,
        "messages": [{"role": "user", "content": "Describe a person."}]})
}

async fn chat_content(base: &str, body: &Value) -> String {
    let url = format!("{base}/chat/completions");
    if body["stream"] == json!(true) {
        let bytes = post(&url, body).await.bytes().await.unwrap();
        decode_all(&bytes)
            .unwrap()
            .iter()
            .filter(|e| e.data != "[DONE]")
            .filter_map(|e| {
                let v: Value = serde_json::from_str(&e.data).unwrap();
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect()
    } else {
        let v: Value = post(&url, body).await.json().await.unwrap();
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    }
}

#[tokio::test]
async fn response_format_answers_json_valid_against_the_schema() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("j")).await.unwrap();
    let base = fleet.get(0).openai_base();
    let schema = json!({"type": "object", "additionalProperties": false,
        "required": ["name", "age", "pets"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}}},
        "$defs": {"Pet": {"type": "object", "required": ["kind"], "properties": {"kind": {"enum": ["cat", "dog"]}}}}});
    let format = json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}});
    let whole = chat_content(&base, &chat_with_format(format.clone(), false)).await;
    let v: Value = serde_json::from_str(&whole).unwrap();
    assert!(
        v["name"].is_string() && v["age"].as_u64().unwrap() <= 120,
        "{v}"
    );
    assert!(
        ["cat", "dog"].contains(&v["pets"][0]["kind"].as_str().unwrap()),
        "{v}"
    );
    assert_eq!(v.as_object().unwrap().len(), 3);
    // Streamed as ordinary content deltas that add up to the same JSON.
    assert_eq!(
        chat_content(&base, &chat_with_format(format, true)).await,
        whole
    );

    let obj = chat_content(
        &base,
        &chat_with_format(json!({"type": "json_object"}), false),
    )
    .await;
    assert!(
        serde_json::from_str::<Value>(&obj).unwrap().is_object(),
        "{obj}"
    );

    let r = post(
        &format!("{base}/chat/completions"),
        &chat_with_format(json!({"type": "yaml"}), false),
    )
    .await;
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn images_count_as_prompt_tokens_in_both_protocols() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("i")).await.unwrap();
    let s = fleet.get(0);
    let text = json!({"type": "text", "text": "What is in this picture?"});
    let chat =
        |parts: Value| json!({"model": "sim", "messages": [{"role": "user", "content": parts}]});
    let url = format!("{}/chat/completions", s.openai_base());
    let image =
        json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}});
    let with: Value = post(&url, &chat(json!([text, image])))
        .await
        .json()
        .await
        .unwrap();
    let without: Value = post(&url, &chat(json!([text]))).await.json().await.unwrap();
    assert!(
        with["usage"]["prompt_tokens"].as_u64() > without["usage"]["prompt_tokens"].as_u64(),
        "{with} {without}"
    );

    let url = format!("{}/v1/messages", s.anthropic_base());
    let msg = |parts: Value| json!({"model": "sim", "max_tokens": 10, "messages": [{"role": "user", "content": parts}]});
    let image = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}});
    let with: Value = post(&url, &msg(json!([text, image])))
        .await
        .json()
        .await
        .unwrap();
    let without: Value = post(&url, &msg(json!([text]))).await.json().await.unwrap();
    assert!(
        with["usage"]["input_tokens"].as_u64() > without["usage"]["input_tokens"].as_u64(),
        "{with} {without}"
    );
}
