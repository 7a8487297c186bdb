//! Every cloud dialect (Azure OpenAI, Gemini, Vertex AI's Gemini and Claude, Bedrock, the
//! Responses API) as a variant behind keel, on keel-sim, which answers each in its own wire
//! format: clients of both protocols, whole and streamed, tool calls, errors, failover, and
//! mid-stream migration from every cloud to another, byte for byte.

use serde_json::{json, Value};

use keel_core::sse::SseEvent;

use crate::harness::*;

/// The cloud dialects, each with the `[[pools.variants]]` keys that reach it on a sim server
/// whose root URL is `root` (the Responses API's base URL ends in `/v1`, as OpenAI's SDK's).
const CLOUDS: [&str; 6] = [
    "azure",
    "gemini",
    "vertex-gemini",
    "vertex-claude",
    "bedrock",
    "responses",
];

fn cloud_variant(name: &str, root: &str) -> String {
    let keys = match name {
        "azure" => format!("protocol = \"azure\"\nurl = \"{root}\"\ndeployment = \"sim\"\napi_key = \"azure-key\""),
        "gemini" => format!("protocol = \"gemini\"\nurl = \"{root}\"\nupstream_model = \"sim\"\napi_key = \"gemini-key\""),
        "vertex-gemini" => format!("protocol = \"vertex\"\nurl = \"{root}\"\nproject = \"p\"\nlocation = \"us-east5\"\nupstream_model = \"gemini-sim\"\naccess_token = \"vertex-token\""),
        "vertex-claude" => format!("protocol = \"vertex\"\nurl = \"{root}\"\nproject = \"p\"\nlocation = \"us-east5\"\nupstream_model = \"claude-sim@1\"\naccess_token = \"vertex-token\""),
        "bedrock" => format!("protocol = \"bedrock\"\nurl = \"{root}\"\nregion = \"us-east-1\"\nupstream_model = \"anthropic.claude-sim-v1:0\"\naws_access_key_id = \"AKIDTEST\"\naws_secret_access_key = \"test-secret\""),
        "responses" => format!("protocol = \"openai-responses\"\nurl = \"{root}/v1\"\nupstream_model = \"sim\"\napi_key = \"openai-key\""),
        "openai" => format!("protocol = \"openai\"\nurl = \"{root}/v1\"\nupstream_model = \"sim\""),
        "anthropic" => format!("protocol = \"anthropic\"\nurl = \"{root}\"\nupstream_model = \"sim\""),
        other => panic!("no such cloud {other}"),
    };
    format!("[[pools.variants]]\nname = \"{name}\"\n{keys}\n")
}

/// A gateway with pool `c` over one sim server per variant in `names`, in order.
async fn clouds(names: &[&str], pool_extra: &str) -> Harness {
    let fleet = keel_sim::Fleet::start_n(names.len(), keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    clouds_on(fleet, names, pool_extra).await
}

/// [`clouds`] over a fleet already started (server `i` behind `names[i]`).
async fn clouds_on(fleet: keel_sim::Fleet, names: &[&str], pool_extra: &str) -> Harness {
    let mut cfg = format!(
        "allow_force_variant = true\n[[pools]]\nname = \"c\"\n{pool_extra}\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n"
    );
    for (i, n) in names.iter().enumerate() {
        cfg.push_str(&cloud_variant(n, &fleet.get(i).anthropic_base()));
    }
    Harness::start(fleet, &cfg).await
}

async fn forced(h: &Harness, path: &str, body: &Value, variant: &str) -> reqwest::Response {
    h.post_with(path, &[("x-keel-force-variant", variant)], body)
        .await
}

/// The answer to `prompt` as server 1 gives it whole, uncut; and the events and text of the
/// same prompt streamed through keel with `variant` forced (its server given a fault first).
async fn uncut_and_streamed(
    h: &Harness,
    prompt: &str,
    variant: &str,
) -> (String, Vec<SseEvent>, String) {
    let want = reference(h, 1, "/v1/chat/completions", &chat(prompt, false)).await;
    let want = want["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let resp = forced(h, "/v1/chat/completions", &chat(prompt, true), variant).await;
    let events = read_stream(resp).await;
    let got = openai_stream_text(&events);
    (want, events, got)
}

fn chat(prompt: &str, stream: bool) -> Value {
    json!({"model": "c", "max_tokens": 60, "stream": stream, "messages": [{"role": "user", "content": prompt}]})
}

fn anthropic_text(events: &[SseEvent]) -> String {
    events
        .iter()
        .filter(|e| e.event.as_deref() == Some("content_block_delta"))
        .filter_map(|e| {
            serde_json::from_str::<Value>(&e.data).ok()?["delta"]["text"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

#[tokio::test]
async fn every_cloud_answers_clients_of_both_protocols_whole_and_streamed() {
    let mut names = vec!["openai"];
    names.extend(CLOUDS);
    let h = clouds(&names, "").await;
    let reference = reference(
        &h,
        0,
        "/v1/chat/completions",
        &chat("tell me about clouds", false),
    )
    .await;
    let want = reference["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let finish = reference["choices"][0]["finish_reason"]
        .as_str()
        .unwrap()
        .to_owned();
    for cloud in CLOUDS {
        // OpenAI client, whole.
        let resp = forced(
            &h,
            "/v1/chat/completions",
            &chat("tell me about clouds", false),
            cloud,
        )
        .await;
        assert_eq!(resp.status(), 200, "{cloud}");
        assert_eq!(header(resp.headers(), "x-keel-variant"), cloud);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["object"], "chat.completion", "{cloud}: {v}");
        assert_eq!(v["model"], "c", "{cloud}: the public name");
        assert_eq!(
            v["choices"][0]["message"]["content"],
            want.as_str(),
            "{cloud}"
        );
        assert_eq!(
            v["choices"][0]["finish_reason"],
            finish.as_str(),
            "{cloud}: {v}"
        );
        assert!(
            v["usage"]["prompt_tokens"].as_u64().unwrap() > 0,
            "{cloud}: the prompt is counted: {v}"
        );
        assert!(
            v["usage"]["completion_tokens"].as_u64().unwrap() > 0,
            "{cloud}: {v}"
        );

        // OpenAI client, streamed.
        let resp = forced(
            &h,
            "/v1/chat/completions",
            &chat("tell me about clouds", true),
            cloud,
        )
        .await;
        assert_eq!(resp.status(), 200, "{cloud}");
        let events = read_stream(resp).await;
        assert_eq!(openai_stream_text(&events), want, "{cloud}: streamed text");
        let data: Vec<&SseEvent> = events.iter().filter(|e| !e.comment_only).collect();
        assert_eq!(data.last().unwrap().data, "[DONE]", "{cloud}");
        assert_eq!(
            data.iter().filter(|e| e.data == "[DONE]").count(),
            1,
            "{cloud}"
        );

        // Anthropic client, whole.
        let resp = forced(
            &h,
            "/v1/messages",
            &chat("tell me about clouds", false),
            cloud,
        )
        .await;
        assert_eq!(resp.status(), 200, "{cloud}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["type"], "message", "{cloud}: {v}");
        assert_eq!(v["content"][0]["text"], want.as_str(), "{cloud}");
        let stop = if finish == "length" {
            "max_tokens"
        } else {
            "end_turn"
        };
        assert_eq!(v["stop_reason"], stop, "{cloud}: {v}");

        // Anthropic client, streamed.
        let resp = forced(
            &h,
            "/v1/messages",
            &chat("tell me about clouds", true),
            cloud,
        )
        .await;
        let events = read_stream(resp).await;
        assert_eq!(anthropic_text(&events), want, "{cloud}: streamed text");
        let names: Vec<&str> = events.iter().filter_map(|e| e.event.as_deref()).collect();
        assert_eq!(names.first(), Some(&"message_start"), "{cloud}: {names:?}");
        assert_eq!(names.last(), Some(&"message_stop"), "{cloud}: {names:?}");
    }
}

/// `/keel/health` says what each variant's upstream speaks.
#[tokio::test]
async fn health_names_each_variants_dialect() {
    let h = clouds(&CLOUDS, "").await;
    let health = h.get_json("/keel/health").await;
    let dialects: Vec<&str> = health["pools"][0]["variants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["dialect"].as_str().unwrap())
        .collect();
    assert_eq!(
        dialects,
        [
            "azure",
            "gemini",
            "vertex",
            "vertex",
            "bedrock",
            "openai-responses"
        ]
    );
}

#[tokio::test]
async fn every_cloud_makes_tool_calls_for_both_protocols() {
    let h = clouds(&CLOUDS, "").await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    for cloud in CLOUDS {
        for stream in [false, true] {
            let body = json!({"model": "c", "max_tokens": 64, "stream": stream, "tools": tools,
                "tool_choice": "required", "messages": [{"role": "user", "content": "weather in Paris?"}]});
            let resp = forced(&h, "/v1/chat/completions", &body, cloud).await;
            assert_eq!(resp.status(), 200, "{cloud}");
            let (name, args, finish) = if stream {
                let events = read_stream(resp).await;
                let chunks: Vec<Value> = events
                    .iter()
                    .filter(|e| !e.comment_only && e.data != "[DONE]")
                    .map(|e| serde_json::from_str(&e.data).unwrap())
                    .collect();
                let mut name = String::new();
                let mut args = String::new();
                let mut finish = String::new();
                for c in &chunks {
                    let choice = &c["choices"][0];
                    if let Some(tc) = choice["delta"]["tool_calls"].get(0) {
                        name.push_str(tc["function"]["name"].as_str().unwrap_or(""));
                        args.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
                    }
                    if let Some(f) = choice["finish_reason"].as_str() {
                        finish = f.to_owned();
                    }
                }
                (name, args, finish)
            } else {
                let v: Value = resp.json().await.unwrap();
                let tc = &v["choices"][0]["message"]["tool_calls"][0];
                (
                    tc["function"]["name"].as_str().unwrap_or("").to_owned(),
                    tc["function"]["arguments"]
                        .as_str()
                        .unwrap_or("")
                        .to_owned(),
                    v["choices"][0]["finish_reason"]
                        .as_str()
                        .unwrap_or("")
                        .to_owned(),
                )
            };
            assert_eq!(name, "get_weather", "{cloud} stream={stream}");
            let args: Value = serde_json::from_str(&args)
                .unwrap_or_else(|e| panic!("{cloud} stream={stream}: arguments {args:?}: {e}"));
            assert!(args["city"].is_string(), "{cloud} stream={stream}: {args}");
            assert_eq!(finish, "tool_calls", "{cloud} stream={stream}");
        }
    }
}

/// A stream cut or stalled in any cloud continues on another cloud's variant: the client sees
/// one stream whose text is the uninterrupted generation, byte for byte.
#[tokio::test]
async fn a_stream_cut_in_any_cloud_continues_in_another_byte_for_byte() {
    // Each cloud loses its stream to another that continues by prefill (the simulator
    // continues a trailing assistant turn exactly); every prefill dialect is a target once.
    let targets = [
        ("azure", "bedrock"),
        ("gemini", "vertex-claude"),
        ("vertex-gemini", "gemini"),
        ("vertex-claude", "vertex-gemini"),
        ("bedrock", "openai"),
        ("responses", "bedrock"),
    ];
    for (i, (cloud, target)) in targets.into_iter().enumerate() {
        let fault = if i % 2 == 0 {
            json!({"kind": "close", "after_tokens": 5})
        } else {
            json!({"kind": "stall", "after_tokens": 7})
        };
        let h = clouds(&[cloud, target], "stall_ms = 400").await;
        assert!(CLOUDS.contains(&cloud));
        add_fault(h.server(0), fault.clone()).await;
        let body = chat(&format!("a long story {i}"), true);
        let want = reference(
            &h,
            1,
            "/v1/chat/completions",
            &chat(&format!("a long story {i}"), false),
        )
        .await;
        let want = want["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        let resp = forced(&h, "/v1/chat/completions", &body, cloud).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(
            header(resp.headers(), "x-keel-variant"),
            cloud,
            "the cloud served the first byte"
        );
        let id = header(resp.headers(), "x-keel-request-id").to_owned();
        let events = read_stream(resp).await;
        assert_eq!(
            openai_stream_text(&events),
            want,
            "{cloud} → {target} ({fault}): byte-identical to the uninterrupted answer"
        );
        let data: Vec<&SseEvent> = events.iter().filter(|e| !e.comment_only).collect();
        assert_eq!(data.iter().filter(|e| e.data == "[DONE]").count(), 1);
        let record = h.get_json(&format!("/keel/decisions/{id}")).await;
        let text = record.to_string();
        assert!(
            text.contains(target) && text.contains("continuation"),
            "{cloud} → {target}: the record shows the continuation: {record}"
        );
    }
}

/// The same, for an Anthropic client (its stream in Messages events) leaving Bedrock for Gemini.
#[tokio::test]
async fn an_anthropic_stream_leaves_bedrock_for_gemini_byte_for_byte() {
    let h = clouds(&["bedrock", "gemini"], "stall_ms = 400").await;
    add_fault(h.server(0), json!({"kind": "close", "after_tokens": 4})).await;
    let want = reference(&h, 1, "/v1/messages", &chat("cross the clouds", false)).await;
    let want = want["content"][0]["text"].as_str().unwrap().to_owned();
    let events = read_stream(
        forced(
            &h,
            "/v1/messages",
            &chat("cross the clouds", true),
            "bedrock",
        )
        .await,
    )
    .await;
    assert_eq!(anthropic_text(&events), want);
    let names: Vec<&str> = events.iter().filter_map(|e| e.event.as_deref()).collect();
    assert_eq!(
        names.iter().filter(|n| **n == "message_start").count(),
        1,
        "{names:?}"
    );
    assert_eq!(
        names.iter().filter(|n| **n == "message_stop").count(),
        1,
        "{names:?}"
    );
}

/// A cloud's rate limit fails over before the first byte; with nowhere else to go, the client
/// gets what a native variant's rate limit gives (keel's 503, in its own protocol) with the
/// provider's wait as Retry-After: the dialect's error was classified like OpenAI's and
/// Anthropic's.
#[tokio::test]
async fn a_cloud_rate_limit_fails_over_and_otherwise_reaches_the_client_in_its_words() {
    for cloud in [
        "anthropic",
        "gemini",
        "bedrock",
        "azure",
        "vertex-claude",
        "responses",
    ] {
        let other = if cloud == "anthropic" {
            "openai"
        } else {
            "anthropic"
        };
        let h = clouds(&[cloud, other], "").await;
        add_fault(
            h.server(0),
            json!({"kind": "error", "status": 429, "retry_after_s": 7}),
        )
        .await;
        let resp = forced(&h, "/v1/chat/completions", &chat("hello", false), cloud).await;
        assert_eq!(resp.status(), 200, "{cloud}");
        assert_eq!(
            header(resp.headers(), "x-keel-variant"),
            other,
            "{cloud}: failed over"
        );

        let h = clouds(&[cloud], "").await;
        add_fault(
            h.server(0),
            json!({"kind": "error", "status": 429, "retry_after_s": 7}),
        )
        .await;
        let resp = h.post("/v1/chat/completions", &chat("hello", false)).await;
        assert_eq!(resp.status(), 503, "{cloud}");
        let wait: u64 = header(resp.headers(), "retry-after").parse().unwrap_or(0);
        assert!(
            (1..=7).contains(&wait),
            "{cloud}: the provider's wait is told: {wait}"
        );
        let v: Value = resp.json().await.unwrap();
        assert!(
            v["error"]["message"].is_string(),
            "{cloud}: OpenAI's error shape: {v}"
        );
        let resp = h.post("/v1/messages", &chat("hello", false)).await;
        assert_eq!(resp.status(), 503, "{cloud}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["type"], "error", "{cloud}: Anthropic's error shape: {v}");
    }
}

/// What a dialect cannot express moves the request to a variant that can; alone, the client
/// gets a 400 naming the field.
#[tokio::test]
async fn what_a_cloud_cannot_express_goes_elsewhere_or_is_a_400_naming_the_field() {
    // Bedrock takes images as bytes only, not by URL.
    let body = json!({"model": "c", "max_tokens": 20, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]});
    let h = clouds(&["bedrock", "openai"], "").await;
    let resp = forced(&h, "/v1/chat/completions", &body, "bedrock").await;
    let status = resp.status();
    assert_eq!(header(resp.headers(), "x-keel-variant"), "openai");
    assert_eq!(status, 200, "{}", resp.text().await.unwrap());
    let h = clouds(&["bedrock"], "").await;
    let (status, _, v) = h.chat(&body).await;
    assert_eq!(status, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("image") && message.contains("Bedrock"),
        "{v}"
    );
}

/// A Vertex AI service account: keel signs the JWT grant, fetches one token at the key file's
/// `token_uri` (keel-sim's, which checks the grant's claims), and uses it for every request;
/// no request after warm-up fetches another.
#[tokio::test]
async fn a_service_account_token_is_fetched_once_and_used_by_every_request() {
    let fleet = keel_sim::Fleet::start_n(1, keel_sim::ServerConfig::fast("s"))
        .await
        .unwrap();
    let root = fleet.get(0).anthropic_base();
    let fixture: Value =
        serde_json::from_str(include_str!("../fixtures/service-account.json")).unwrap();
    let mut account = fixture.clone();
    account["token_uri"] = json!(format!("{root}/token"));
    let file = std::env::temp_dir().join(format!("keel-sa-{}.json", std::process::id()));
    std::fs::write(&file, account.to_string()).unwrap();
    let mut cfg = String::from(
        "[[pools]]\nname = \"c\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n",
    );
    for (name, model) in [
        ("vertex-claude", "claude-sim@1"),
        ("vertex-gemini", "gemini-sim"),
    ] {
        cfg.push_str(&format!(
            "[[pools.variants]]\nname = \"{name}\"\nprotocol = \"vertex\"\nurl = \"{root}\"\nproject = \"p\"\nlocation = \"us-east5\"\nupstream_model = \"{model}\"\ncredentials_file = \"{}\"\n",
            file.display()
        ));
    }
    let h = Harness::start(fleet, &cfg).await;
    let stats = || async {
        keel_sim::http_client()
            .get(format!("{root}/sim/stats"))
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    };
    for i in 0..40 {
        let (status, _, v) = h.chat(&chat(&format!("hello {i}"), i % 2 == 0)).await;
        assert_eq!(status, 200, "{v}");
    }
    std::fs::remove_file(&file).ok();
    let s = stats().await;
    // One token per variant (each holds its own source), fetched at start-up.
    assert_eq!(s["tokens_issued"], 2, "{s}");
    assert_eq!(
        h.metric("keel_upstream_token_fetches_total", &[("pool", "c")])
            .await,
        2.0
    );
    assert!(
        s["errors"].as_u64().unwrap_or(0) == 0,
        "every bearer was accepted: {s}"
    );
}

/// A pool of all six dialects and both protocols, three of its clouds stalling or cutting
/// streams mid-answer at random: no stream fails, and every one is the uninterrupted answer,
/// byte for byte, where the continuation was a prefill. Azure and the Responses API continue
/// by instruction (hosted OpenAI models take no prefill): there the seam is measured, words
/// glued or repeated where the model's restart and the delivered text meet, as on OpenAI.
#[tokio::test]
async fn a_pool_of_every_cloud_with_faulty_members_loses_no_stream_and_no_byte() {
    let mut names = vec!["openai", "anthropic"];
    names.extend(CLOUDS);
    let h = clouds(&names, "stall_ms = 300").await;
    // gemini, bedrock and responses misbehave on half their answers.
    for (i, fault) in [
        (3, json!({"kind": "stall", "after_tokens": 6, "rate": 0.5})),
        (6, json!({"kind": "close", "after_tokens": 4, "rate": 0.5})),
        (7, json!({"kind": "close", "after_tokens": 9, "rate": 0.5})),
    ] {
        assert!(names[i] == "gemini" || names[i] == "bedrock" || names[i] == "responses");
        add_fault(h.server(i), fault).await;
    }
    let mut instruction_seams = Vec::new();
    for i in 0..24 {
        let prompt = format!("story number {i}");
        let want = reference(&h, 0, "/v1/chat/completions", &chat(&prompt, false)).await;
        let want = want["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        let first = names[2 + i % CLOUDS.len()];
        let path = if i % 2 == 0 {
            "/v1/chat/completions"
        } else {
            "/v1/messages"
        };
        let resp = forced(&h, path, &chat(&prompt, true), first).await;
        assert_eq!(resp.status(), 200, "{first}");
        let route = header(resp.headers(), "x-keel-route").to_owned();
        let events = read_stream(resp).await;
        let text = if path == "/v1/messages" {
            anthropic_text(&events)
        } else {
            openai_stream_text(&events)
        };
        let notes: Vec<String> = events
            .iter()
            .filter(|e| e.comment_only)
            .map(|e| String::from_utf8_lossy(&e.raw).into_owned())
            .collect();
        let by_instruction = notes
            .iter()
            .any(|n| n.contains("to=azure") || n.contains("to=responses"));
        if by_instruction {
            let (missing, extra) = crate::prefill_refusal::word_diff(&want, &text);
            assert!(
                missing <= 2 && extra <= 2,
                "{first} ({path}): an instruction seam off by {missing}/{extra} words: {notes:?}\n{text}\n{want}"
            );
            instruction_seams.push((missing, extra));
        } else {
            assert_eq!(text, want, "{first} ({path}, route {route}): {notes:?}");
        }
    }
    eprintln!("instruction seams (words missing, extra): {instruction_seams:?}");
    let migrated = h.metric("keel_migrations_total", &[("pool", "c")]).await;
    assert!(
        migrated >= 2.0,
        "the faults cut streams: {migrated} migrations"
    );
}

/// A provider's safety stop (Azure `content_filter`, Gemini `SAFETY`, a Bedrock content
/// filter, …) is a finished answer: the client gets it in its protocol's words and keel does not
/// fail over to find a more obliging model.
#[tokio::test]
async fn a_cloud_safety_stop_is_a_finished_answer_never_failed_over() {
    let h = clouds(&CLOUDS, "").await;
    for i in 0..CLOUDS.len() {
        add_fault(h.server(i), json!({"kind": "refusal", "after_tokens": 3})).await;
    }
    for cloud in CLOUDS {
        for stream in [false, true] {
            let resp = forced(
                &h,
                "/v1/chat/completions",
                &chat("something unsafe", stream),
                cloud,
            )
            .await;
            assert_eq!(resp.status(), 200, "{cloud}");
            assert_eq!(
                header(resp.headers(), "x-keel-variant"),
                cloud,
                "{cloud}: not failed over"
            );
            let finish = if stream {
                let events = read_stream(resp).await;
                events
                    .iter()
                    .filter(|e| !e.comment_only && e.data != "[DONE]")
                    .filter_map(|e| {
                        let v: Value = serde_json::from_str(&e.data).ok()?;
                        v["choices"][0]["finish_reason"].as_str().map(str::to_owned)
                    })
                    .next_back()
                    .unwrap_or_default()
            } else {
                let v: Value = resp.json().await.unwrap();
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned()
            };
            assert_eq!(finish, "content_filter", "{cloud} stream={stream}");
            let resp = forced(&h, "/v1/messages", &chat("something unsafe", stream), cloud).await;
            assert_eq!(resp.status(), 200, "{cloud}");
            if !stream {
                let v: Value = resp.json().await.unwrap();
                assert_eq!(v["stop_reason"], "refusal", "{cloud}: {v}");
            }
        }
    }
}

/// An error inside a cloud's stream (a Bedrock `throttlingException` frame, Gemini's `error`
/// chunk, a Responses `error` event) is the stream breaking: it continues elsewhere.
#[tokio::test]
async fn an_error_inside_a_cloud_stream_continues_elsewhere() {
    for cloud in [
        "bedrock",
        "gemini",
        "vertex-gemini",
        "responses",
        "azure",
        "vertex-claude",
    ] {
        let h = clouds(&[cloud, "anthropic"], "").await;
        add_fault(
            h.server(0),
            json!({"kind": "stream_error", "after_tokens": 5, "status": 429}),
        )
        .await;
        let want = reference(&h, 1, "/v1/chat/completions", &chat("keep going", false)).await;
        let want = want["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        let resp = forced(&h, "/v1/chat/completions", &chat("keep going", true), cloud).await;
        assert_eq!(resp.status(), 200, "{cloud}");
        let events = read_stream(resp).await;
        assert_eq!(openai_stream_text(&events), want, "{cloud}");
        let done = events.iter().filter(|e| e.data == "[DONE]").count();
        assert_eq!(done, 1, "{cloud}");
    }
}

/// A stream cut where both kinds of continuation are possible continues by prefill (exact)
/// rather than by instruction; where only instruction is left (Azure, the Responses API), it
/// still continues, its seam measured.
#[tokio::test]
async fn a_cut_stream_prefers_an_exact_continuation_and_otherwise_takes_an_instruction() {
    let h = clouds(&["bedrock", "azure", "responses", "gemini"], "").await;
    add_fault(h.server(0), json!({"kind": "close", "after_tokens": 5})).await;
    for i in 0..6 {
        let prompt = format!("prefer exact {i}");
        let want = reference(&h, 3, "/v1/chat/completions", &chat(&prompt, false)).await;
        let want = want["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        let events =
            read_stream(forced(&h, "/v1/chat/completions", &chat(&prompt, true), "bedrock").await)
                .await;
        let notes: Vec<String> = events
            .iter()
            .filter(|e| e.comment_only)
            .map(|e| String::from_utf8_lossy(&e.raw).into_owned())
            .collect();
        assert!(notes.iter().any(|n| n.contains("to=gemini")), "{notes:?}");
        assert_eq!(openai_stream_text(&events), want);
    }
    for only in ["azure", "responses"] {
        let h = clouds(&["bedrock", only], "").await;
        add_fault(h.server(0), json!({"kind": "close", "after_tokens": 5})).await;
        let (want, events, got) = uncut_and_streamed(&h, "by instruction", "bedrock").await;
        let (missing, extra) = crate::prefill_refusal::word_diff(&want, &got);
        eprintln!("instruction seam on {only}: {missing} words missing, {extra} extra");
        assert!(missing <= 2 && extra <= 2, "{only}: {got}\n{want}");
        assert_eq!(events.iter().filter(|e| e.data == "[DONE]").count(), 1);
    }
}

/// What a dialect drops on the way is named in `x-keel-prompt-fix`, like the client protocols'
/// own translation.
#[tokio::test]
async fn what_a_cloud_drops_is_named_in_the_prompt_fix_header() {
    let h = clouds(&["gemini", "bedrock"], "").await;
    let mut body = chat("hello", false);
    body["metadata"] = json!({"user_id": "u-1"});
    for cloud in ["gemini", "bedrock"] {
        let resp = forced(&h, "/v1/messages", &body, cloud).await;
        assert_eq!(resp.status(), 200, "{cloud}");
        let fixes = header(resp.headers(), "x-keel-prompt-fix").to_owned();
        assert!(fixes.contains("metadata_dropped"), "{cloud}: {fixes:?}");
    }
}

/// Bedrock, Vertex AI's Claude and Gemini refusing a prefill (as Anthropic's newer models do:
/// keel-sim answers with the refusal in each cloud's own error shape) are learned and switched
/// to `instruction`, and the cut stream still ends whole.
#[tokio::test]
async fn a_cloud_that_refuses_prefill_is_learned_and_continues_by_instruction() {
    for cloud in ["bedrock", "vertex-claude", "gemini"] {
        let fleet = keel_sim::Fleet::start(&keel_sim::FleetConfig {
            generation: Default::default(),
            servers: vec![
                keel_sim::ServerConfig::fast("a"),
                keel_sim::ServerConfig {
                    refuse_prefill: true,
                    ..keel_sim::ServerConfig::fast("b")
                },
            ],
        })
        .await
        .unwrap();
        let h = clouds_on(fleet, &["anthropic", cloud], "stall_ms = 400").await;
        add_fault(h.server(0), json!({"kind": "stall", "after_tokens": 5})).await;
        let (want, events, got) = uncut_and_streamed(&h, "seams again", "anthropic").await;
        let (missing, extra) = crate::prefill_refusal::word_diff(&want, &got);
        assert!(missing <= 2 && extra <= 2, "{cloud}: {got}\n{want}");
        assert_eq!(
            events.iter().filter(|e| e.data == "[DONE]").count(),
            1,
            "{cloud}"
        );
        let health = h.get_json("/keel/health").await;
        let v = &health["pools"][0]["variants"][1];
        assert_eq!(v["resume"], "instruction", "{cloud}: {health}");
        assert_eq!(v["resume_learned"], true, "{cloud}: {health}");
    }
}
