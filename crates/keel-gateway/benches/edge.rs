//! What a cloud dialect's credentials cost per request at the upstream edge: SigV4 signing of a
//! typical Bedrock Converse request (the AWS SDKs' own signer), and, for scale, the RS256 grant
//! a Vertex AI service account signs once per token lifetime (never per request once warm).
//!
//! `cargo bench -p keel-gateway --bench edge`. The dialects' body and stream translation is in
//! `cargo bench -p keel-core --bench translate` (the `dialect_*` groups).

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

use keel_gateway::config::cloud::AwsKeys;
use keel_gateway::upstream::{cloud, Request};

fn request() -> Request {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": [{"text": "Summarize the quarterly report in three bullet points."}]}],
        "system": [{"text": "You are a concise assistant."}],
        "inferenceConfig": {"maxTokens": 512, "temperature": 0.2}
    });
    let mut headers = http::HeaderMap::new();
    headers.insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    headers.insert(
        "traceparent",
        http::HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    );
    Request {
        url: "https://bedrock-runtime.us-east-1.amazonaws.com/model/anthropic.claude-3-5-haiku-20241022-v1%3A0/converse-stream".into(),
        headers,
        body: serde_json::to_vec(&body).unwrap().into(),
    }
}

fn edge(c: &mut Criterion) {
    let keys = AwsKeys {
        access_key_id: "AKIDEXAMPLE".into(),
        secret_access_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY".into(),
        session_token: None,
    };
    let template = request();
    c.bench_function("sigv4/sign_converse_request", |b| {
        b.iter_batched(
            || Request {
                url: template.url.clone(),
                headers: template.headers.clone(),
                body: template.body.clone(),
            },
            |mut req| {
                cloud::sign_sigv4(&mut req, "us-east-1", &keys).unwrap();
                black_box(req)
            },
            criterion::BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, edge);
criterion_main!(benches);
