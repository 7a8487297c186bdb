//! The simulator on the wire: real HTTP requests against real servers on loopback.
//! Timing checks here are lower bounds only (a sleep never ends early), so a slow machine
//! cannot make them fail.

use std::time::{Duration, Instant};

use keel_core::protocol::Endpoint;
use keel_core::sse::{decode_all, SseEvent};
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

/// Streams a request and decodes the body with the strict SSE parser.
async fn stream(url: &str, body: &Value) -> Vec<SseEvent> {
    let resp = post(url, body).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    decode_all(&resp.bytes().await.unwrap()).expect("strict SSE framing")
}

fn openai_text(events: &[SseEvent]) -> String {
    events
        .iter()
        .filter(|e| e.data != "[DONE]")
        .filter_map(|e| {
            let v: Value = serde_json::from_str(&e.data).unwrap();
            let c = v["choices"].get(0)?;
            c["delta"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .map(str::to_owned)
        })
        .collect()
}

fn anthropic_text(events: &[SseEvent]) -> String {
    events
        .iter()
        .filter(|e| e.event.as_deref() == Some("content_block_delta"))
        .map(|e| {
            serde_json::from_str::<Value>(&e.data).unwrap()["delta"]["text"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect()
}

fn chat(prompt: &str) -> Value {
    json!({"model": "sim", "messages": [{"role": "user", "content": prompt}]})
}

#[tokio::test]
async fn openai_chat_stream_and_whole_agree_with_usage() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let base = fleet.get(0).openai_base();
    let mut body = chat("Tell me about keel.");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let events = stream(&format!("{base}/chat/completions"), &body).await;
    assert_eq!(events.last().unwrap().data, "[DONE]");
    let first: Value = serde_json::from_str(&events[0].data).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let usage_chunk: Value = serde_json::from_str(&events[events.len() - 2].data).unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    let finish: Value = serde_json::from_str(&events[events.len() - 3].data).unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let streamed = openai_text(&events);

    let whole: Value = post(
        &format!("{base}/chat/completions"),
        &chat("Tell me about   keel."),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(
        whole["choices"][0]["message"]["content"],
        streamed.as_str(),
        "normalized prompt gives the same text"
    );
    let usage = &whole["usage"];
    assert_eq!(
        usage["completion_tokens"].as_u64().unwrap(),
        keel_core::tokens::count(&streamed) as u64
    );
    assert_eq!(usage, &usage_chunk["usage"]);
}

#[tokio::test]
async fn anthropic_stream_follows_the_event_sequence() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let url = format!("{}/v1/messages", fleet.get(0).anthropic_base());
    let body = json!({"model": "sim", "max_tokens": 200, "stream": true, "system": "Be brief.",
        "messages": [{"role": "user", "content": "hi"}]});
    let events = stream(&url, &body).await;
    let names: Vec<&str> = events.iter().map(|e| e.event.as_deref().unwrap()).collect();
    let n = names.len();
    assert_eq!(
        &names[..3],
        &["message_start", "content_block_start", "ping"]
    );
    assert!(names[3..n - 3].iter().all(|e| *e == "content_block_delta"));
    assert_eq!(
        &names[n - 3..],
        &["content_block_stop", "message_delta", "message_stop"]
    );
    let delta: Value = serde_json::from_str(&events[n - 2].data).unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    let text = anthropic_text(&events);
    assert_eq!(
        delta["usage"]["output_tokens"].as_u64().unwrap(),
        keel_core::tokens::count(&text) as u64
    );

    let mut whole_body = body.clone();
    whole_body["stream"] = json!(false);
    let whole: Value = post(&url, &whole_body).await.json().await.unwrap();
    assert_eq!(whole["type"], "message");
    assert_eq!(whole["content"][0]["text"], text.as_str());

    // max_tokens and stop sequences.
    let mut short = whole_body.clone();
    short["max_tokens"] = json!(3);
    let v: Value = post(&url, &short).await.json().await.unwrap();
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["usage"]["output_tokens"], 3);
}

#[tokio::test]
async fn continuation_is_exact_on_another_server_for_every_protocol() {
    // Two servers of one family, with different speeds: text must not depend on which one.
    let fleet = Fleet::start_n(2, ServerConfig::fast("a")).await.unwrap();
    let (a, b) = (fleet.get(0), fleet.get(1));
    for (p, prompt) in [
        "Explain routing.",
        "What is a seam?",
        "x",
        "Write a haiku about GPUs please",
    ]
    .iter()
    .enumerate()
    {
        // OpenAI chat with vLLM's continue_final_message.
        let whole: Value = post(
            &format!("{}/chat/completions", a.openai_base()),
            &chat(prompt),
        )
        .await
        .json()
        .await
        .unwrap();
        let text = whole["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        for cut in [0, 1, text.len() / 3, text.len() / 2 + p, text.len() - 1] {
            let cut = (0..=cut).rev().find(|i| text.is_char_boundary(*i)).unwrap();
            let body = json!({"model": "sim", "continue_final_message": true, "add_generation_prompt": false,
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": &text[..cut]}]});
            let cont: Value = post(&format!("{}/chat/completions", b.openai_base()), &body)
                .await
                .json()
                .await
                .unwrap();
            assert_eq!(
                format!(
                    "{}{}",
                    &text[..cut],
                    cont["choices"][0]["message"]["content"].as_str().unwrap()
                ),
                text
            );

            // Anthropic prefill, streamed.
            let body = json!({"model": "sim", "max_tokens": 500, "stream": true,
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": &text[..cut]}]});
            let events = stream(&format!("{}/v1/messages", b.anthropic_base()), &body).await;
            assert_eq!(format!("{}{}", &text[..cut], anthropic_text(&events)), text);
        }
        // Completions: delivered text appended to the prompt.
        let whole: Value = post(
            &format!("{}/completions", a.openai_base()),
            &json!({"model": "sim", "prompt": prompt, "max_tokens": 30}),
        )
        .await
        .json()
        .await
        .unwrap();
        let text = whole["choices"][0]["text"].as_str().unwrap().to_owned();
        let pieces = keel_core::tokens::split(&text);
        let k = pieces.len() / 2;
        let head: String = pieces[..k].concat();
        let body = json!({"model": "sim", "prompt": format!("{prompt}{head}"), "max_tokens": 30 - k, "stream": true});
        let events = stream(&format!("{}/completions", b.openai_base()), &body).await;
        assert_eq!(format!("{head}{}", openai_text(&events)), text);
    }
}

#[tokio::test]
async fn final_assistant_message_without_continue_flag_starts_a_new_turn() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let url = format!("{}/chat/completions", fleet.get(0).openai_base());
    let body = json!({"model": "sim", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]});
    let v: Value = post(&url, &body).await.json().await.unwrap();
    let cont = json!({"model": "sim", "continue_final_message": true, "add_generation_prompt": false,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]});
    let c: Value = post(&url, &cont).await.json().await.unwrap();
    assert_ne!(
        v["choices"][0]["message"]["content"],
        c["choices"][0]["message"]["content"]
    );
    let bad = json!({"model": "sim", "continue_final_message": true, "add_generation_prompt": true, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(post(&url, &bad).await.status(), 400);
}

#[tokio::test]
async fn tool_calls_are_deterministic_in_both_protocols() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let s = fleet.get(0);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let body = json!({"model": "sim", "tools": tools, "messages": [{"role": "user", "content": "Call get_weather for me"}]});
    let v: Value = post(&format!("{}/chat/completions", s.openai_base()), &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string() && args["days"].is_u64());
    // Streamed arguments concatenate to the same JSON.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let events = stream(&format!("{}/chat/completions", s.openai_base()), &sbody).await;
    let streamed: String = events
        .iter()
        .filter(|e| e.data != "[DONE]")
        .filter_map(|e| {
            serde_json::from_str::<Value>(&e.data).unwrap()["choices"][0]["delta"]["tool_calls"][0]
                ["function"]["arguments"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(streamed, call["function"]["arguments"].as_str().unwrap());
    // No mention and tool_choice auto: plain text.
    let plain =
        json!({"model": "sim", "tools": tools, "messages": [{"role": "user", "content": "hello"}]});
    let v: Value = post(&format!("{}/chat/completions", s.openai_base()), &plain)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let abody = json!({"model": "sim", "max_tokens": 100, "tool_choice": {"type": "any"},
        "tools": [{"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
        "messages": [{"role": "user", "content": "hello"}]});
    let v: Value = post(&format!("{}/v1/messages", s.anthropic_base()), &abody)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["stop_reason"], "tool_use");
    assert_eq!(v["content"][0]["type"], "tool_use");
    assert!(v["content"][0]["input"]["q"].is_string());
}

async fn add_fault(server: &keel_sim::ServerHandle, fault: Value) {
    let r = post(&format!("http://{}/sim/faults", server.addr), &fault).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
}

#[tokio::test]
async fn error_faults_on_the_wire() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let s = fleet.get(0);
    let url = format!("{}/chat/completions", s.openai_base());
    add_fault(
        s,
        json!({"kind": "error", "status": 429, "retry_after_s": 2, "count": 1}),
    )
    .await;
    let r = post(&url, &chat("x")).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "2");
    assert_eq!(r.headers()["retry-after-ms"], "2000");
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "rate_limit_error"
    );
    assert_eq!(
        post(&url, &chat("x")).await.status(),
        200,
        "count-limited fault expired"
    );

    add_fault(s, json!([{"kind": "error", "status": 529, "count": 1}])).await;
    let r = post(
        &format!("{}/v1/messages", s.anthropic_base()),
        &json!({"model": "sim", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(r.status(), 529);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "overloaded_error"
    );

    for status in [500, 503] {
        add_fault(s, json!({"kind": "error", "status": status, "count": 1})).await;
        assert_eq!(post(&url, &chat("x")).await.status(), status);
    }
    // Runtime listing and clearing.
    add_fault(s, json!({"kind": "slowdown", "factor": 2})).await;
    let list: Value = keel_sim::http_client()
        .get(format!("http://{}/sim/faults", s.addr))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list[0]["kind"], "slowdown");
    keel_sim::http_client()
        .delete(format!("http://{}/sim/faults", s.addr))
        .send()
        .await
        .unwrap();
    let list: Value = keel_sim::http_client()
        .get(format!("http://{}/sim/faults", s.addr))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list, json!([]));
    // A bad fault names its field.
    let r = post(
        &format!("http://{}/sim/faults", s.addr),
        &json!({"kind": "stall"}),
    )
    .await;
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("after_tokens"));
}

#[tokio::test]
async fn connection_faults_on_the_wire() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let s = fleet.get(0);
    let url = format!("{}/chat/completions", s.openai_base());
    let mut sbody = chat("x");
    sbody["stream"] = json!(true);

    add_fault(s, json!({"kind": "reset", "count": 1})).await;
    assert!(
        keel_sim::http_client()
            .post(&url)
            .json(&chat("x"))
            .send()
            .await
            .is_err(),
        "reset before headers"
    );

    add_fault(s, json!({"kind": "hang", "count": 1})).await;
    keel_sim::install_crypto();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    assert!(client
        .post(&url)
        .json(&chat("x"))
        .send()
        .await
        .unwrap_err()
        .is_timeout());

    add_fault(s, json!({"kind": "close", "after_tokens": 3, "count": 1})).await;
    let resp = post(&url, &sbody).await;
    assert_eq!(resp.status(), 200);
    let mut got = Vec::new();
    let mut broken = false;
    let mut resp = resp;
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => got.extend_from_slice(&c),
            Ok(None) => break,
            Err(_) => {
                broken = true;
                break;
            }
        }
    }
    assert!(
        broken,
        "the stream must end in a transport error, not a clean end"
    );
    let events = decode_all(&got).unwrap();
    assert!(events.iter().all(|e| e.data != "[DONE]"));
    assert!(!openai_text(&events).is_empty());

    add_fault(
        s,
        json!({"kind": "malformed", "after_tokens": 2, "count": 1}),
    )
    .await;
    let events = stream(&url, &sbody).await;
    assert!(events
        .iter()
        .any(|e| e.data != "[DONE]" && serde_json::from_str::<Value>(&e.data).is_err()));
}

#[tokio::test]
async fn timing_faults_on_the_wire() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let s = fleet.get(0);
    let url = format!("{}/chat/completions", s.openai_base());
    let mut sbody = chat("x");
    sbody["stream"] = json!(true);

    // Stall: a gap of at least the stall after the 4th token.
    add_fault(
        s,
        json!({"kind": "stall", "after_tokens": 4, "ms": 300, "count": 1}),
    )
    .await;
    let mut resp = post(&url, &sbody).await;
    let mut arrivals = Vec::new();
    let mut dec = keel_core::sse::SseDecoder::new();
    let mut evs = Vec::new();
    while let Some(c) = resp.chunk().await.unwrap() {
        dec.feed(&c, &mut evs).unwrap();
        for _ in evs.drain(..) {
            arrivals.push(Instant::now());
        }
    }
    let max_gap = arrivals.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    assert!(max_gap >= Duration::from_millis(300), "{max_gap:?}");

    // Delay and cold start add to time to first token.
    add_fault(s, json!({"kind": "delay", "ms": 250, "count": 1})).await;
    let t = Instant::now();
    post(&url, &chat("x")).await;
    assert!(t.elapsed() >= Duration::from_millis(250));
    add_fault(
        s,
        json!({"kind": "cold_start", "extra_ms": 200, "count": 2}),
    )
    .await;
    for _ in 0..2 {
        let t = Instant::now();
        post(&url, &chat("x")).await;
        assert!(t.elapsed() >= Duration::from_millis(200));
    }
    // Slowdown stretches the gaps: 40 tokens at >= 10 ms each.
    add_fault(s, json!({"kind": "slowdown", "factor": 10, "count": 1})).await;
    let t = Instant::now();
    let mut long = chat("x");
    long["max_tokens"] = json!(40);
    let v: Value = post(&url, &long).await.json().await.unwrap();
    let n = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n > 10);
    assert!(
        t.elapsed() >= Duration::from_millis((n - 1) * 10),
        "{n} tokens in {:?}",
        t.elapsed()
    );
    // Degraded: with error_rate 1 every request fails with 503.
    add_fault(
        s,
        json!({"kind": "degraded", "error_rate": 1.0, "count": 1}),
    )
    .await;
    assert_eq!(post(&url, &chat("x")).await.status(), 503);
}

#[tokio::test]
async fn prefix_cache_lowers_ttft_and_is_reported() {
    let cfg = ServerConfig {
        prefill_us_per_token: 2000.0,
        ..ServerConfig::fast("a")
    };
    let fleet = Fleet::start_n(1, cfg).await.unwrap();
    let url = format!("{}/chat/completions", fleet.get(0).openai_base());
    let system = "You are a careful assistant. ".repeat(40);
    let body = |q: &str| json!({"model": "sim", "max_tokens": 1, "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]});
    let t = Instant::now();
    let cold: Value = post(&url, &body("first question"))
        .await
        .json()
        .await
        .unwrap();
    let cold_ms = t.elapsed().as_millis();
    let prompt_tokens = cold["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 200);
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Cold prefill pays 2 ms per token.
    assert!(
        cold_ms as u64 >= prompt_tokens * 2 - 5,
        "{cold_ms} ms for {prompt_tokens} tokens"
    );
    let t = Instant::now();
    let warm: Value = post(&url, &body("second question"))
        .await
        .json()
        .await
        .unwrap();
    let warm_ms = t.elapsed().as_millis();
    let cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= prompt_tokens - 20,
        "shared prefix is cached: {cached} of {prompt_tokens}"
    );
    // The server counts the prompt tokens it computed: all of the cold one, the rest of the warm.
    let warm_tokens = warm["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        fleet.get(0).state.stats().prefill_tokens,
        prompt_tokens + warm_tokens - cached
    );
    eprintln!("prefix cache: cold TTFT {cold_ms} ms, warm {warm_ms} ms");
}

#[tokio::test]
async fn auth_models_and_metrics() {
    let cfg = ServerConfig {
        api_key: Some("sk-sim".into()),
        models: vec!["m1".into()],
        ..ServerConfig::fast("a")
    };
    let fleet = Fleet::start_n(1, cfg).await.unwrap();
    let s = fleet.get(0);
    let url = format!("{}/chat/completions", s.openai_base());
    let mut body = chat("x");
    body["model"] = json!("m1");
    assert_eq!(post(&url, &body).await.status(), 401);
    let c = keel_sim::http_client();
    assert_eq!(
        c.post(&url)
            .bearer_auth("sk-sim")
            .json(&body)
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    body["model"] = json!("m2");
    assert_eq!(
        c.post(&url)
            .bearer_auth("sk-sim")
            .json(&body)
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    let models: Value = keel_sim::http_client()
        .get(format!("{}/models", s.openai_base()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "m1");
    let metrics = keel_sim::http_client()
        .get(format!("http://{}/metrics", s.addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:time_to_first_token_seconds_count{",
    ] {
        assert!(metrics.contains(name), "missing {name}");
    }
    assert!(metrics.contains("vllm:time_to_first_token_seconds_count{model_name=\"m1\"} 1"));
}

#[tokio::test]
async fn queueing_beyond_capacity_shows_in_metrics() {
    let cfg = ServerConfig {
        capacity: 1,
        ..ServerConfig::fast("a")
    };
    let fleet = Fleet::start_n(1, cfg).await.unwrap();
    let s = fleet.get(0);
    add_fault(s, json!({"kind": "hang", "ms": 0})).await; // no-op fault keeps list non-empty
    add_fault(
        s,
        json!({"kind": "stall", "after_tokens": 1, "ms": 400, "count": 1}),
    )
    .await;
    let url = format!("{}/chat/completions", s.openai_base());
    let u1 = url.clone();
    let first = tokio::spawn(async move { post(&u1, &chat("a")).await.status() });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let u2 = url.clone();
    let second = tokio::spawn(async move { post(&u2, &chat("b")).await.status() });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let metrics = keel_sim::http_client()
        .get(format!("http://{}/metrics", s.addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("vllm:num_requests_running{model_name=\"sim\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("vllm:num_requests_waiting{model_name=\"sim\"} 1"),
        "{metrics}"
    );
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(second.await.unwrap(), 200);
}

#[tokio::test]
async fn client_disconnect_is_counted_as_cancelled() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let s = fleet.get(0);
    add_fault(s, json!({"kind": "stall", "after_tokens": 2, "count": 1})).await;
    let mut body = chat("x");
    body["stream"] = json!(true);
    let mut resp = post(&format!("{}/chat/completions", s.openai_base()), &body).await;
    resp.chunk().await.unwrap();
    drop(resp);
    for _ in 0..100 {
        if s.state.stats().cancelled == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(s.state.stats().cancelled, 1);
    assert_eq!(s.state.stats().running, 0, "the slot is released");
}

#[tokio::test]
async fn load_generator_reports_open_loop_figures() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let mut cfg = keel_sim::load::LoadConfig::new(&fleet.get(0).openai_base(), "sim");
    cfg.rps = 50.0;
    cfg.duration = Duration::from_millis(400);
    cfg.stream = true;
    let report = keel_sim::load::run(cfg).await;
    assert_eq!(report.sent, 20);
    assert_eq!(report.ok, 20, "{}", report.table());
    assert!(report.ttft.p50_ms > 0.0 && report.gap.count > 0);
    assert!(report.table().contains("ttft"));
}

#[tokio::test]
async fn load_generator_abandons_a_request_nobody_answers() {
    // A server that accepts connections and never writes a byte: without a deadline each
    // request would wait for ever and so would the run.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            open.push(sock);
        }
    });
    let mut cfg = keel_sim::load::LoadConfig::new(&format!("http://{addr}/v1"), "sim");
    cfg.rps = 20.0;
    cfg.duration = Duration::from_millis(200);
    cfg.stream = true;
    cfg.request_timeout = Duration::from_millis(300);
    let report = keel_sim::load::run(cfg).await;
    assert_eq!(report.sent, 4);
    assert_eq!(report.ok, 0);
    assert_eq!(report.errors, 4, "{}", report.table());
    assert_eq!(
        report.error_kinds.get("timeout"),
        Some(&4),
        "{}",
        report.table()
    );
    held.abort();
}

#[tokio::test]
async fn load_generator_counts_the_same_tokens_in_either_protocol() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let mut tokens = Vec::new();
    for (base, endpoint) in [
        (fleet.get(0).openai_base(), Endpoint::ChatCompletions),
        (fleet.get(0).anthropic_base(), Endpoint::Messages),
    ] {
        let mut cfg = keel_sim::load::LoadConfig::new(&base, "sim");
        cfg.endpoint = endpoint;
        cfg.rps = 50.0;
        cfg.duration = Duration::from_millis(200);
        cfg.stream = true;
        cfg.max_tokens = 8;
        let report = keel_sim::load::run(cfg).await;
        assert_eq!(report.ok, 10, "{}", report.table());
        // One token event per generated token, at most max_tokens a request; finish and usage
        // events are not tokens.
        assert!(
            report.tokens >= report.ok && report.tokens <= 80,
            "{}",
            report.tokens
        );
        tokens.push(report.tokens);
    }
    assert_eq!(tokens[0], tokens[1], "the same answers, counted alike");
}

#[tokio::test]
async fn a_restart_refuses_connections_then_loads_then_serves_on_the_same_port() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("a")).await.unwrap();
    let s = fleet.get(0);
    let url = format!("{}/chat/completions", s.openai_base());
    let health = format!("http://{}/health", s.addr);
    assert_eq!(post(&url, &chat("x")).await.status(), 200);
    // Set over HTTP: the answer arrives before the listener closes.
    add_fault(
        s,
        json!([{"kind": "refuse", "ms": 400}, {"kind": "loading", "ms": 1500}]),
    )
    .await;
    let refused = Instant::now() + Duration::from_secs(5);
    loop {
        match tokio::net::TcpStream::connect(s.addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            _ => assert!(Instant::now() < refused, "connections were never refused"),
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Back on the same port, loading: /health and generation answer 503.
    let client = keel_sim::http_client();
    let back = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Ok(r) = client.get(&health).send().await {
            break r.status();
        }
        assert!(Instant::now() < back, "the server did not listen again");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(status, 503);
    let r = post(&url, &chat("x")).await;
    assert_eq!(r.status(), 503);
    assert!(r.text().await.unwrap().contains("Loading model"));
    // Then ready.
    let ready = Instant::now() + Duration::from_secs(5);
    while client.get(&health).send().await.unwrap().status() != 200 {
        assert!(Instant::now() < ready, "the server never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(post(&url, &chat("x")).await.status(), 200);
}
