//! The dialects on the wire: one simulated server answering every cloud's format by path, with
//! the hub protocols' text, faults, counters and credentials.

use base64::Engine;
use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};

const PROMPT: &str = "Tell me about the harbour at dawn";

async fn post(url: &str, headers: &[(&str, &str)], body: &Value) -> reqwest::Response {
    let mut req = keel_sim::http_client().post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.expect("request sent")
}

async fn json_of(resp: reqwest::Response) -> Value {
    resp.json().await.expect("a JSON body")
}

const BEARER: (&str, &str) = ("authorization", "Bearer any");

fn sigv4() -> (&'static str, String) {
    (
        "authorization",
        format!(
            "AWS4-HMAC-SHA256 Credential=AKID/20250101/us-east-1/bedrock/aws4_request, SignedHeaders=host;x-amz-date, Signature={}",
            "0f".repeat(32)
        ),
    )
}

fn gemini_body() -> Value {
    json!({"contents": [{"role": "user", "parts": [{"text": PROMPT}]}],
        "generationConfig": {"maxOutputTokens": 1024}})
}

fn bedrock_body() -> Value {
    json!({"messages": [{"role": "user", "content": [{"text": PROMPT}]}],
        "inferenceConfig": {"maxTokens": 1024}})
}

fn gemini_stream_text(body: &str) -> (String, Vec<Value>) {
    let events: Vec<Value> = body
        .split("\r\n\r\n")
        .filter(|e| !e.is_empty())
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    let text = events
        .iter()
        .filter_map(|e| e["candidates"][0]["content"]["parts"][0]["text"].as_str())
        .collect();
    (text, events)
}

#[tokio::test]
async fn every_dialect_gives_the_hub_text() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let base = fleet.get(0).anthropic_base();
    let messages = json_of(
        post(
            &format!("{base}/v1/messages"),
            &[],
            &json!({"model": "sim", "max_tokens": 1024, "messages": [{"role": "user", "content": PROMPT}]}),
        )
        .await,
    )
    .await;
    let hub_text = messages["content"][0]["text"].as_str().unwrap().to_owned();
    assert!(!hub_text.is_empty());

    let g = json_of(
        post(
            &format!("{base}/v1beta/models/sim:generateContent"),
            &[],
            &gemini_body(),
        )
        .await,
    )
    .await;
    assert_eq!(g["candidates"][0]["content"]["parts"][0]["text"], hub_text);
    assert_eq!(g["modelVersion"], "sim");

    let resp = post(
        &format!("{base}/v1beta/models/sim:streamGenerateContent?alt=sse"),
        &[],
        &gemini_body(),
    )
    .await;
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let (text, events) = gemini_stream_text(&resp.text().await.unwrap());
    assert_eq!(text, hub_text);
    assert_eq!(
        events.last().unwrap()["candidates"][0]["finishReason"],
        "STOP"
    );

    let v = json_of(
        post(
            &format!("{base}/v1/projects/p/locations/us-central1/publishers/google/models/sim:generateContent"),
            &[BEARER],
            &gemini_body(),
        )
        .await,
    )
    .await;
    assert_eq!(v["candidates"][0]["content"]["parts"][0]["text"], hub_text);

    let c = json_of(
        post(
            &format!("{base}/v1/projects/p/locations/us-east5/publishers/anthropic/models/sim:rawPredict"),
            &[BEARER],
            &json!({"anthropic_version": "vertex-2023-10-16", "max_tokens": 1024,
                "messages": [{"role": "user", "content": PROMPT}]}),
        )
        .await,
    )
    .await;
    assert_eq!(c["content"][0]["text"], hub_text);

    let (k, v) = sigv4();
    let b = json_of(
        post(
            &format!("{base}/model/sim/converse"),
            &[(k, &v), ("x-amz-date", "20250101T000000Z")],
            &bedrock_body(),
        )
        .await,
    )
    .await;
    assert_eq!(b["output"]["message"]["content"][0]["text"], hub_text);

    // The OpenAI-hub dialects give the Chat Completions text.
    let chat = json!({"model": "sim", "max_tokens": 1024, "messages": [{"role": "user", "content": PROMPT}]});
    let openai = json_of(post(&format!("{base}/v1/chat/completions"), &[], &chat).await).await;
    let chat_text = openai["choices"][0]["message"]["content"].clone();
    let a = json_of(
        post(
            &format!("{base}/openai/deployments/sim/chat/completions?api-version=2024-10-21"),
            &[],
            &chat,
        )
        .await,
    )
    .await;
    assert_eq!(a["choices"][0]["message"]["content"], chat_text);
    let r = json_of(
        post(
            &format!("{base}/v1/responses"),
            &[],
            &json!({"model": "sim", "input": PROMPT, "max_output_tokens": 1024, "store": false}),
        )
        .await,
    )
    .await;
    assert_eq!(r["output"][0]["content"][0]["text"], chat_text);

    let stats = fleet.get(0).state.stats();
    assert_eq!(stats.requests, 9);
    assert_eq!(stats.completed, 9);
}

async fn add_fault(server: &keel_sim::ServerHandle, fault: Value) {
    let r = post(&format!("http://{}/sim/faults", server.addr), &[], &fault).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
}

#[tokio::test]
async fn dialect_faults_on_the_wire() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let s = fleet.get(0);
    let base = s.anthropic_base();
    let gemini = format!("{base}/v1beta/models/sim:generateContent");
    let gemini_stream = format!("{base}/v1beta/models/sim:streamGenerateContent?alt=sse");
    let (k, auth) = sigv4();
    let aws = [(k, auth.as_str()), ("x-amz-date", "20250101T000000Z")];

    add_fault(
        s,
        json!({"kind": "error", "status": 429, "retry_after_s": 2, "count": 1}),
    )
    .await;
    let resp = post(&gemini, &[], &gemini_body()).await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"], "2");
    assert_eq!(json_of(resp).await["error"]["status"], "RESOURCE_EXHAUSTED");

    add_fault(s, json!({"kind": "error", "status": 503, "count": 1})).await;
    let resp = post(&format!("{base}/model/sim/converse"), &aws, &bedrock_body()).await;
    assert_eq!(resp.status(), 503);
    assert!(resp.headers()["x-amzn-errortype"]
        .to_str()
        .unwrap()
        .starts_with("ServiceUnavailableException"));
    assert!(json_of(resp).await["message"].is_string());

    add_fault(s, json!({"kind": "loading", "count": 1})).await;
    let resp = post(&format!("{base}/model/sim/converse"), &aws, &bedrock_body()).await;
    assert_eq!(resp.status(), 429);
    assert!(resp.headers()["x-amzn-errortype"]
        .to_str()
        .unwrap()
        .starts_with("ModelNotReadyException"));

    add_fault(
        s,
        json!({"kind": "error", "status": 429, "retry_after_s": 1.5, "count": 1}),
    )
    .await;
    let resp = post(
        &format!("{base}/openai/deployments/sim/chat/completions?api-version=2024-10-21"),
        &[],
        &json!({"model": "x", "messages": [{"role": "user", "content": PROMPT}]}),
    )
    .await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after-ms"], "1500");
    assert_eq!(json_of(resp).await["error"]["code"], "429");

    // A stream cut mid-answer has no finishReason: the reader sees a cut stream.
    add_fault(s, json!({"kind": "close", "after_tokens": 3, "count": 1})).await;
    let mut resp = post(&gemini_stream, &[], &gemini_body()).await;
    let mut got = Vec::new();
    let cut = loop {
        match resp.chunk().await {
            Ok(Some(c)) => got.extend_from_slice(&c),
            Ok(None) => break false,
            Err(_) => break true,
        }
    };
    assert!(cut, "the connection drops mid-body");
    let text = String::from_utf8(got).unwrap();
    assert!(!text.contains("finishReason"));

    // An in-stream error in Bedrock's framing: an exception frame ends the stream.
    add_fault(
        s,
        json!({"kind": "stream_error", "status": 429, "after_tokens": 2, "count": 1}),
    )
    .await;
    let resp = post(
        &format!("{base}/model/sim/converse-stream"),
        &aws,
        &bedrock_body(),
    )
    .await;
    assert_eq!(
        resp.headers()["content-type"],
        "application/vnd.amazon.eventstream"
    );
    let bytes = resp.bytes().await.unwrap();
    let needle = b"throttlingException";
    assert!(bytes.windows(needle.len()).any(|w| w == needle));
    assert!(!bytes.windows(11).any(|w| w == b"messageStop"));

    // ... and in the Anthropic hub's: `event: error`, no message_stop.
    add_fault(
        s,
        json!({"kind": "stream_error", "after_tokens": 2, "count": 1}),
    )
    .await;
    let body = post(
        &format!("{base}/v1/messages"),
        &[],
        &json!({"model": "sim", "max_tokens": 1024, "stream": true, "messages": [{"role": "user", "content": PROMPT}]}),
    )
    .await
    .text()
    .await
    .unwrap();
    assert!(body.contains(
        "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\""
    ));
    assert!(!body.contains("message_stop"));

    // A malformed Gemini chunk is not JSON.
    add_fault(
        s,
        json!({"kind": "malformed", "after_tokens": 1, "count": 1}),
    )
    .await;
    let body = post(&gemini_stream, &[], &gemini_body())
        .await
        .text()
        .await
        .unwrap();
    assert!(body
        .split("\r\n\r\n")
        .filter(|e| !e.is_empty())
        .any(|e| serde_json::from_str::<Value>(&e[6..]).is_err()));

    let stats = s.state.stats();
    assert_eq!(stats.errors, 7);
}

fn grant(addr: &str) -> String {
    let e = |v: Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let jwt = format!(
        "{}.{}.c2lnbmF0dXJl",
        e(json!({"alg": "RS256", "typ": "JWT", "kid": "k1"})),
        e(
            json!({"iss": "sa@p.iam.gserviceaccount.com", "scope": "https://www.googleapis.com/auth/cloud-platform",
            "aud": format!("http://{addr}/token"), "iat": now, "exp": now + 3600})
        )
    );
    format!("grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer&assertion={jwt}")
}

#[tokio::test]
async fn credentials_are_checked_as_each_cloud_does() {
    let cfg = ServerConfig {
        api_key: Some("secret".into()),
        ..ServerConfig::fast("a")
    };
    let fleet = Fleet::start_n(1, cfg).await.unwrap();
    let s = fleet.get(0);
    let base = s.anthropic_base();
    let vertex =
        format!("{base}/v1/projects/p/locations/l/publishers/google/models/sim:generateContent");

    let resp = post(&vertex, &[BEARER], &gemini_body()).await;
    assert_eq!(resp.status(), 401);
    assert_eq!(json_of(resp).await["error"]["status"], "UNAUTHENTICATED");

    let client = keel_sim::http_client();
    let token_url = format!("{base}/token");
    let bad = client
        .post(&token_url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(grant("elsewhere:1"))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert_eq!(json_of(bad).await["error"], "invalid_grant");
    let answer = json_of(
        client
            .post(&token_url)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(grant(&s.addr.to_string()))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(answer["token_type"], "Bearer");
    assert_eq!(answer["expires_in"], 3600);
    let token = format!("Bearer {}", answer["access_token"].as_str().unwrap());
    assert_eq!(s.state.stats().tokens_issued, 1);
    let resp = post(&vertex, &[("authorization", &token)], &gemini_body()).await;
    assert_eq!(resp.status(), 200);
    let resp = post(
        &vertex,
        &[("authorization", "Bearer secret")],
        &gemini_body(),
    )
    .await;
    assert_eq!(resp.status(), 200, "the configured key is a bearer too");

    let gemini = format!("{base}/v1beta/models/sim:generateContent");
    assert_eq!(post(&gemini, &[], &gemini_body()).await.status(), 400);
    assert_eq!(
        post(&gemini, &[("x-goog-api-key", "secret")], &gemini_body())
            .await
            .status(),
        200
    );
    assert_eq!(
        post(&format!("{gemini}?key=secret"), &[], &gemini_body())
            .await
            .status(),
        200
    );

    let azure = format!("{base}/openai/deployments/sim/chat/completions?api-version=2024-10-21");
    let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(post(&azure, &[], &chat).await.status(), 401);
    assert_eq!(
        post(&azure, &[("api-key", "secret")], &chat).await.status(),
        200
    );
    assert_eq!(
        post(
            &format!("{base}/openai/deployments/sim/chat/completions"),
            &[("api-key", "secret")],
            &chat
        )
        .await
        .status(),
        404,
        "no api-version"
    );

    let converse = format!("{base}/model/sim/converse");
    let resp = post(&converse, &[], &bedrock_body()).await;
    assert_eq!(resp.status(), 403);
    let (k, v) = sigv4();
    let wrong_service = v.replace("/bedrock/", "/s3/");
    assert_eq!(
        post(
            &converse,
            &[(k, &wrong_service), ("x-amz-date", "20250101T000000Z")],
            &bedrock_body()
        )
        .await
        .status(),
        403
    );
    assert_eq!(
        post(
            &converse,
            &[(k, &v), ("x-amz-date", "20250101T000000Z")],
            &bedrock_body()
        )
        .await
        .status(),
        200
    );
}

/// (url, headers, body, JSON pointer to the stop reason, its expected value).
type RefusalCase<'a> = (String, Vec<(&'a str, &'a str)>, Value, &'a str, &'a str);

#[tokio::test]
async fn a_refusal_is_a_finished_answer_in_every_shape() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let s = fleet.get(0);
    let base = s.anthropic_base();
    let (k, auth) = sigv4();
    let aws = [(k, auth.as_str()), ("x-amz-date", "20250101T000000Z")];
    let chat = json!({"model": "sim", "messages": [{"role": "user", "content": PROMPT}]});
    let cases: Vec<RefusalCase> = vec![
        (
            format!("{base}/v1/chat/completions"),
            vec![],
            chat.clone(),
            "/choices/0/finish_reason",
            "content_filter",
        ),
        (
            format!("{base}/openai/deployments/sim/chat/completions?api-version=2024-10-21"),
            vec![],
            chat.clone(),
            "/choices/0/finish_reason",
            "content_filter",
        ),
        (
            format!("{base}/v1/messages"),
            vec![],
            json!({"model": "sim", "max_tokens": 1024, "messages": [{"role": "user", "content": PROMPT}]}),
            "/stop_reason",
            "refusal",
        ),
        (
            format!("{base}/v1beta/models/sim:generateContent"),
            vec![],
            gemini_body(),
            "/candidates/0/finishReason",
            "SAFETY",
        ),
        (
            format!("{base}/model/sim/converse"),
            aws.to_vec(),
            bedrock_body(),
            "/stopReason",
            "content_filtered",
        ),
        (
            format!("{base}/v1/responses"),
            vec![],
            json!({"model": "sim", "input": PROMPT}),
            "/incomplete_details/reason",
            "content_filter",
        ),
    ];
    for (url, headers, body, pointer, expected) in cases {
        add_fault(s, json!({"kind": "refusal", "after_tokens": 2, "count": 1})).await;
        let resp = post(&url, &headers, &body).await;
        assert_eq!(resp.status(), 200, "{url}");
        let v = json_of(resp).await;
        assert_eq!(v.pointer(pointer).unwrap(), expected, "{url}: {v}");
    }
    assert_eq!(s.state.stats().errors, 0, "a refusal is not an error");
}

#[tokio::test]
async fn a_cut_stream_continues_exactly_on_another_dialect() {
    // What mid-stream migration does: the text delivered before the cut, sent to another
    // dialect as a trailing assistant turn, is continued to the uninterrupted answer.
    let fleet = Fleet::start_n(2, ServerConfig::fast("a")).await.unwrap();
    let (first, second) = (fleet.get(0), fleet.get(1));
    let whole = json_of(
        post(
            &format!(
                "{}/v1beta/models/sim:generateContent",
                first.anthropic_base()
            ),
            &[],
            &gemini_body(),
        )
        .await,
    )
    .await;
    let whole = whole["candidates"][0]["content"]["parts"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();

    add_fault(
        first,
        json!({"kind": "close", "after_tokens": 5, "count": 1}),
    )
    .await;
    let mut resp = post(
        &format!(
            "{}/v1beta/models/sim:streamGenerateContent?alt=sse",
            first.anthropic_base()
        ),
        &[],
        &gemini_body(),
    )
    .await;
    let mut got = Vec::new();
    while let Ok(Some(c)) = resp.chunk().await {
        got.extend_from_slice(&c);
    }
    let (delivered, _) = gemini_stream_text(&String::from_utf8(got).unwrap());
    assert!(!delivered.is_empty() && delivered.len() < whole.len());

    let (k, auth) = sigv4();
    let rest = json_of(
        post(
            &format!("{}/model/sim/converse", second.anthropic_base()),
            &[(k, &auth), ("x-amz-date", "20250101T000000Z")],
            &json!({"messages": [
                {"role": "user", "content": [{"text": PROMPT}]},
                {"role": "assistant", "content": [{"text": delivered}]}],
                "inferenceConfig": {"maxTokens": 1024}}),
        )
        .await,
    )
    .await;
    let rest = rest["output"]["message"]["content"][0]["text"]
        .as_str()
        .unwrap();
    assert_eq!(format!("{delivered}{rest}"), whole);

    let rest = json_of(
        post(
            &format!(
                "{}/v1/projects/p/locations/l/publishers/anthropic/models/sim:rawPredict",
                second.anthropic_base()
            ),
            &[BEARER],
            &json!({"anthropic_version": "vertex-2023-10-16", "max_tokens": 1024, "messages": [
                {"role": "user", "content": PROMPT},
                {"role": "assistant", "content": delivered}]}),
        )
        .await,
    )
    .await;
    assert_eq!(
        format!(
            "{delivered}{}",
            rest["content"][0]["text"].as_str().unwrap()
        ),
        whole
    );
}
