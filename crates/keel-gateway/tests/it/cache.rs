//! The response cache end to end: whole and streamed hits in both protocols replay the
//! original answer, tenants never share answers, `no-store`/`no-cache`/`off` are honoured,
//! truncated answers are never stored, identical concurrent requests go upstream once, and the
//! semantic mode answers a near-identical prompt. (Redis shared by two keel processes:
//! `crates/keel/tests/replicas.rs`.)

use keel_gateway::state::keys::{hash_secret, hash_text};
use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};

use crate::harness::*;

const CACHE: &str = "hedge = \"off\"\n[pools.cache]\n";

/// Requests the simulated fleet received.
fn upstream(h: &Harness) -> u64 {
    h.fleet
        .servers
        .iter()
        .map(|s| s.state.stats().requests)
        .sum()
}

fn chat(prompt: &str, stream: bool) -> Value {
    json!({"model": "p", "temperature": 0, "max_tokens": 24, "stream": stream,
        "messages": [{"role": "user", "content": prompt}]})
}

fn messages(prompt: &str, stream: bool) -> Value {
    json!({"model": "p", "temperature": 0, "max_tokens": 24, "stream": stream,
        "messages": [{"role": "user", "content": prompt}]})
}

async fn anthropic_harness(pool_extra: &str) -> Harness {
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = pool_over(&fleet, "p", "anthropic", 1, pool_extra);
    Harness::start(fleet, &cfg).await
}

/// The text and finish reason of a whole answer or a stream, whichever protocol.
fn answer_of_body(v: &Value) -> (String, String) {
    if v["type"] == "message" {
        let text = v["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect();
        (text, v["stop_reason"].as_str().unwrap().to_owned())
    } else {
        (
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned(),
            v["choices"][0]["finish_reason"]
                .as_str()
                .unwrap()
                .to_owned(),
        )
    }
}

/// The text and finish reason of a stream; asserts exactly one terminal event, at the end.
fn answer_of_stream(events: &[keel_core::sse::SseEvent]) -> (String, String) {
    let anthropic = events.iter().any(|e| e.event.is_some());
    let mut text = String::new();
    let mut finish = String::new();
    let mut terminals = 0;
    for (i, e) in events.iter().enumerate() {
        let terminal = if anthropic {
            e.event.as_deref() == Some("message_stop")
        } else {
            e.data == "[DONE]"
        };
        if terminal {
            terminals += 1;
            assert_eq!(i, events.len() - 1, "the terminal event ends the stream");
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(&e.data) else {
            continue;
        };
        assert_ne!(v["type"], "error", "no error event: {}", e.data);
        if anthropic {
            if let Some(t) = v.pointer("/delta/text").and_then(Value::as_str) {
                text.push_str(t);
            }
            if let Some(r) = v.pointer("/delta/stop_reason").and_then(Value::as_str) {
                finish = r.to_owned();
            }
        } else {
            if let Some(t) = v
                .pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
            {
                text.push_str(t);
            }
            if let Some(r) = v
                .pointer("/choices/0/finish_reason")
                .and_then(Value::as_str)
            {
                finish = r.to_owned();
            }
        }
    }
    assert_eq!(terminals, 1, "exactly one terminal event");
    (text, finish)
}

/// Whole first (stored), then whole and streamed hits; then a streamed miss stored at its
/// end and answered whole from the cache. Every hit equals the original; the fleet sees one
/// request per distinct prompt.
async fn replays_equal_the_original(h: &Harness, path: &str, body: fn(&str, bool) -> Value) {
    let r = h.post(path, &body("name three rivers", false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(r.headers(), "x-keel-cache"), "stored");
    let original_id = header(r.headers(), "x-keel-request-id").to_owned();
    let original = answer_of_body(&r.json().await.unwrap());
    assert!(!original.0.is_empty());
    assert_eq!(upstream(h), 1);

    let r = h.post(path, &body("name three rivers", false)).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    assert_eq!(header(r.headers(), "x-keel-route"), "cached");
    assert_eq!(header(r.headers(), "x-keel-attempts"), "0");
    let hit_id = header(r.headers(), "x-keel-request-id").to_owned();
    assert_eq!(answer_of_body(&r.json().await.unwrap()), original);

    let r = h.post(path, &body("name three rivers", true)).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    assert!(header(r.headers(), "content-type").starts_with("text/event-stream"));
    assert_eq!(answer_of_stream(&read_stream(r).await), original);
    assert_eq!(upstream(h), 1, "both hits were answered by keel");

    // The hit's decision record names the request whose answer it replayed.
    let record = h.get_json(&format!("/keel/decisions/{hit_id}")).await;
    assert_eq!(record["route"], "cached");
    assert_eq!(record["cached_from"], original_id.as_str());

    // A streamed miss is stored when it completes; a whole request then hits it.
    let r = h.post(path, &body("name three lakes", true)).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "miss");
    let streamed = answer_of_stream(&read_stream(r).await);
    wait_for!(
        "the streamed answer to be stored",
        h.metric("keel_cache_stored_total", &[]).await >= 2.0
    );
    let r = h.post(path, &body("name three lakes", false)).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    assert_eq!(answer_of_body(&r.json().await.unwrap()), streamed);
    assert_eq!(upstream(h), 2);
    assert_eq!(
        h.metric("keel_cache_lookups_total", &[("result", "hit")])
            .await,
        3.0
    );
}

#[tokio::test]
async fn openai_whole_and_streamed_hits_replay_the_original() {
    let h = Harness::openai(1, 1, "", CACHE).await;
    replays_equal_the_original(&h, "/v1/chat/completions", chat).await;
}

#[tokio::test]
async fn anthropic_whole_and_streamed_hits_replay_the_original() {
    let h = anthropic_harness(CACHE).await;
    replays_equal_the_original(&h, "/v1/messages", messages).await;
}

#[tokio::test]
async fn a_paced_replay_is_the_same_answer_in_more_pieces() {
    let h = Harness::openai(1, 1, "", &format!("{CACHE}pace_replay = true\n")).await;
    let r = h
        .post(
            "/v1/chat/completions",
            &chat("describe the sea at length", true),
        )
        .await;
    let original = read_stream(r).await;
    wait_for!(
        "the answer to be stored",
        h.metric("keel_cache_stored_total", &[]).await >= 1.0
    );
    let r = h
        .post(
            "/v1/chat/completions",
            &chat("describe the sea at length", true),
        )
        .await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    let replayed = read_stream(r).await;
    assert_eq!(answer_of_stream(&replayed), answer_of_stream(&original));
    assert!(replayed.len() > 3, "the text comes in pieces");
}

#[tokio::test]
async fn uncacheable_requests_and_client_directives_bypass_the_cache() {
    let h = Harness::openai(1, 1, "", CACHE).await;
    let path = "/v1/chat/completions";
    // Sampling above the ceiling (and no temperature: the APIs' default 1.0), n > 1, tools.
    let hot =
        json!({"model": "p", "temperature": 0.9, "messages": [{"role": "user", "content": "x"}]});
    let unset = json!({"model": "p", "messages": [{"role": "user", "content": "x"}]});
    let tools = json!({"model": "p", "temperature": 0, "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]});
    for b in [&hot, &unset, &tools, &hot] {
        let r = h.post(path, b).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(r.headers(), "x-keel-cache"), "bypass");
    }
    assert_eq!(upstream(&h), 4);

    // no-store: never stored, so the next identical request goes upstream too.
    let b = chat("count to five", false);
    let r = h
        .post_with(path, &[("cache-control", "no-store")], &b)
        .await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "bypass");
    let r = h.post(path, &b).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "stored");
    assert_eq!(upstream(&h), 6);
    // no-cache: not answered from the cache (the fresh answer is stored again); off: neither.
    let r = h
        .post_with(path, &[("cache-control", "no-cache")], &b)
        .await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "stored");
    let r = h.post_with(path, &[("x-keel-cache", "off")], &b).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "bypass");
    assert_eq!(upstream(&h), 8);
    let r = h.post(path, &b).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    assert_eq!(upstream(&h), 8);

    // A value keel does not know is the client's error, in its protocol.
    let r = h
        .post_with(path, &[("x-keel-cache", "sometimes")], &b)
        .await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("x-keel-cache"));

    // Without [pools.cache] nothing is cached.
    let plain = Harness::openai(1, 1, "", "hedge = \"off\"\n").await;
    for _ in 0..2 {
        let r = plain.post(path, &b).await;
        assert_eq!(header(r.headers(), "x-keel-cache"), "bypass");
    }
    assert_eq!(upstream(&plain), 2);
}

#[tokio::test]
async fn one_tenant_never_receives_anothers_answer() {
    let (ka, kb) = (
        "sk-cache-tenant-a-0123456789",
        "sk-cache-tenant-b-0123456789",
    );
    let hash = |k: &str| hash_text(&hash_secret(k));
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "[[keys]]\nid = \"a\"\nhash = \"{}\"\ntenant = \"team-a\"\n\n[[keys]]\nid = \"b\"\nhash = \"{}\"\ntenant = \"team-b\"\n\n{}",
        hash(ka),
        hash(kb),
        pool_over(&fleet, "p", "openai", 1, CACHE)
    );
    let h = Harness::start(fleet, &cfg).await;
    let ask = |key: &'static str| {
        let h = &h;
        async move {
            let auth = format!("Bearer {key}");
            let r = h
                .post_with(
                    "/v1/chat/completions",
                    &[("authorization", &auth)],
                    &chat("a secret plan", false),
                )
                .await;
            assert_eq!(r.status(), 200);
            header(r.headers(), "x-keel-cache").to_owned()
        }
    };
    assert_eq!(ask(ka).await, "stored");
    assert_eq!(
        ask(kb).await,
        "stored",
        "team-b does not get team-a's answer"
    );
    assert_eq!(ask(ka).await, "hit");
    assert_eq!(ask(kb).await, "hit");
    assert_eq!(upstream(&h), 2);
}

#[tokio::test]
async fn a_truncated_stream_is_never_stored() {
    let h = Harness::openai(1, 1, "", &format!("max_migrations = 0\n{CACHE}")).await;
    add_fault(
        h.server(0),
        json!({"kind": "close", "after_tokens": 3, "count": 1}),
    )
    .await;
    let b = chat("tell me a long story", true);
    let r = h.post("/v1/chat/completions", &b).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "miss");
    let events = read_stream(r).await;
    assert!(
        events.iter().any(|e| e.data.contains("incomplete")),
        "the stream ended in an error event"
    );
    wait_for!(
        "the incomplete answer to be counted",
        h.metric("keel_cache_skipped_total", &[("reason", "incomplete")])
            .await
            >= 1.0
    );
    assert_eq!(h.metric("keel_cache_stored_total", &[]).await, 0.0);
    // The next identical request goes upstream and completes; that answer is stored.
    let r = h.post("/v1/chat/completions", &b).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "miss");
    let (text, finish) = answer_of_stream(&read_stream(r).await);
    assert!(!text.is_empty() && !finish.is_empty());
    assert_eq!(upstream(&h), 2);
    wait_for!(
        "the complete answer to be stored",
        h.metric("keel_cache_stored_total", &[]).await >= 1.0
    );
}

#[tokio::test]
async fn identical_concurrent_requests_go_upstream_once() {
    let h = Harness::openai(1, 1, "", CACHE).await;
    // The leader's answer is held back long enough for the others to arrive.
    add_fault(
        h.server(0),
        json!({"kind": "delay", "ms": 1500, "count": 1}),
    )
    .await;
    let n = 6;
    let b = chat("one answer for everyone", false);
    let url = h.url("/v1/chat/completions");
    let leader = {
        let (url, b) = (url.clone(), b.clone());
        tokio::spawn(async move { keel_sim::http_client().post(url).json(&b).send().await })
    };
    wait_for!("the leader to be in flight", h.gw.cache.in_flight() == 1);
    let mut tasks = vec![leader];
    for i in 0..n - 1 {
        let (url, mut b) = (url.clone(), b.clone());
        if i % 2 == 1 {
            b["stream"] = json!(true);
        }
        tasks.push(tokio::spawn(async move {
            keel_sim::http_client().post(url).json(&b).send().await
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        let r = t.await.unwrap().unwrap();
        assert_eq!(r.status(), 200);
        let streamed = header(r.headers(), "content-type").starts_with("text/event-stream");
        answers.push(if streamed {
            answer_of_stream(&read_stream(r).await)
        } else {
            answer_of_body(&r.json().await.unwrap())
        });
    }
    assert_eq!(
        upstream(&h),
        1,
        "one upstream request for {n} identical ones"
    );
    assert!(answers.iter().all(|a| a == &answers[0]));
    assert_eq!(
        h.metric("keel_cache_lookups_total", &[("result", "coalesced")])
            .await,
        (n - 1) as f64
    );
    assert_eq!(h.gw.cache.in_flight(), 0);
}

/// Starts a streaming request and waits for its first bytes; the response and those bytes.
async fn started(url: &str, body: &Value) -> (reqwest::Response, Vec<u8>) {
    let mut r = keel_sim::http_client()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().expect("a first chunk").to_vec();
    (r, first)
}

/// The rest of a stream after `first`, decoded.
async fn rest_of(mut r: reqwest::Response, mut bytes: Vec<u8>) -> Vec<keel_core::sse::SseEvent> {
    while let Ok(Some(c)) = r.chunk().await {
        bytes.extend_from_slice(&c);
    }
    keel_core::sse::decode_all(&bytes).expect("valid SSE framing")
}

/// Streaming requests behind an identical streaming one follow its stream live: each has its
/// first bytes while the leader is still generating (the flight is open), and ends with exactly
/// the leader's events; one upstream request in all. Both protocols.
#[tokio::test]
async fn streaming_followers_get_the_leaders_stream_live() {
    let extra = format!("max_migrations = 0\n{CACHE}");
    for (h, path, body) in [
        (
            Harness::openai(1, 1, "", &extra).await,
            "/v1/chat/completions",
            chat("follow me", true),
        ),
        (
            anthropic_harness(&extra).await,
            "/v1/messages",
            messages("follow me", true),
        ),
    ] {
        // 24 tokens about 100 ms apart: the leader generates for seconds.
        add_fault(
            h.server(0),
            json!({"kind": "slowdown", "factor": 100, "count": 1}),
        )
        .await;
        let url = h.url(path);
        let (leader, leader_first) = started(&url, &body).await;
        assert_eq!(header(leader.headers(), "x-keel-cache"), "miss");
        let mut followers = Vec::new();
        for _ in 0..2 {
            let (r, first) = started(&url, &body).await;
            assert_eq!(header(r.headers(), "x-keel-cache"), "hit", "{path}");
            assert_eq!(header(r.headers(), "x-keel-route"), "cached");
            assert_eq!(
                h.gw.cache.in_flight(),
                1,
                "{path}: the follower's first bytes came while the leader was still generating"
            );
            followers.push(rest_of(r, first));
        }
        let leader_events = rest_of(leader, leader_first).await;
        for f in followers {
            let events = f.await;
            assert_eq!(
                events.iter().map(|e| &e.data).collect::<Vec<_>>(),
                leader_events.iter().map(|e| &e.data).collect::<Vec<_>>(),
                "{path}: a follower gets the leader's events"
            );
        }
        assert_eq!(upstream(&h), 1, "{path}");
        assert_eq!(
            h.metric("keel_cache_lookups_total", &[("result", "coalesced")])
                .await,
            2.0
        );
        wait_for!("the flight to end", h.gw.cache.in_flight() == 0);
    }
}

/// The leader's client leaving does not cut its followers: the generation goes on for them,
/// they get the complete answer, and it is stored.
#[tokio::test]
async fn a_leader_whose_client_leaves_keeps_generating_for_its_followers() {
    let h = Harness::openai(1, 1, "", &format!("max_migrations = 0\n{CACHE}")).await;
    add_fault(
        h.server(0),
        json!({"kind": "slowdown", "factor": 60, "count": 1}),
    )
    .await;
    let url = h.url("/v1/chat/completions");
    let body = chat("the leader leaves", true);
    let (leader, _) = started(&url, &body).await;
    let (follower, first) = started(&url, &body).await;
    assert_eq!(header(follower.headers(), "x-keel-cache"), "hit");
    assert_eq!(
        h.gw.cache.in_flight(),
        1,
        "following while the leader generates"
    );
    drop(leader);
    let events = rest_of(follower, first).await;
    let (text, finish) = answer_of_stream(&events);
    assert!(!text.is_empty());
    assert_eq!(finish, "length", "the whole answer, to its end");
    assert_eq!(events.last().unwrap().data, "[DONE]");
    assert_eq!(upstream(&h), 1);
    wait_for!(
        "the complete answer to be stored",
        h.metric("keel_cache_stored_total", &[]).await >= 1.0
    );
    let r = h.post("/v1/chat/completions", &body).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    assert_eq!(answer_of_stream(&read_stream(r).await), (text, finish));
}

/// A stream's raw bytes to its end, and whether it ended cleanly (not aborted).
async fn raw_rest(mut r: reqwest::Response, mut bytes: Vec<u8>) -> (Vec<u8>, bool) {
    loop {
        match r.chunk().await {
            Ok(Some(c)) => bytes.extend_from_slice(&c),
            Ok(None) => return (bytes, true),
            Err(_) => return (bytes, false),
        }
    }
}

/// Whether a raw stream holds a generated token (a content delta).
fn has_token(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    text.lines().any(|l| {
        l.strip_prefix("data: ")
            .and_then(|d| serde_json::from_str::<Value>(d).ok())
            .and_then(|v| {
                v.pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
                    .map(|t| !t.is_empty())
            })
            .unwrap_or(false)
    })
}

/// A follower is sent the leader's tokens while the leader's upstream is still stalled (its
/// answer far from complete), and a leader that fails mid-stream ends every follower with the
/// same error event: each follower's bytes equal the leader's, all end cleanly after the error
/// event, and one upstream request served them all.
#[tokio::test]
async fn a_stalled_then_failing_leader_streams_to_its_followers_and_ends_them_with_its_error() {
    // The upstream sends three tokens, then stalls for good; keel gives up at its stall timeout
    // (no migration), which ends the leader's stream with keel's error event.
    let extra = format!("max_migrations = 0\ntimeouts = {{ stall_ms = 4000 }}\n{CACHE}");
    let h = Harness::openai(1, 1, "", &extra).await;
    add_fault(
        h.server(0),
        json!({"kind": "stall", "after_tokens": 3, "count": 1}),
    )
    .await;
    let url = h.url("/v1/chat/completions");
    let body = chat("stall, then fail", true);
    let (leader, leader_first) = started(&url, &body).await;
    let mut followers = Vec::new();
    for _ in 0..2 {
        let (mut r, mut bytes) = started(&url, &body).await;
        assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
        while !has_token(&bytes) {
            bytes.extend_from_slice(&r.chunk().await.unwrap().expect("more of the stream"));
        }
        // The order of events, not a clock: the follower holds a token while the leader's
        // upstream generation is still stalled and its flight open.
        assert_eq!(
            h.server(0).state.stats().running,
            1,
            "the leader's upstream is still stalled"
        );
        assert_eq!(
            h.gw.cache.in_flight(),
            1,
            "the leader's answer is not complete"
        );
        followers.push(raw_rest(r, bytes));
    }
    let (leader_bytes, leader_clean) = raw_rest(leader, leader_first).await;
    let events = keel_core::sse::decode_all(&leader_bytes).unwrap();
    let last = events.last().unwrap();
    assert!(
        last.data.contains("\"error\"") && last.data.contains("incomplete"),
        "the leader's stream ends with keel's error event: {}",
        last.data
    );
    assert!(
        leader_clean,
        "after its error event, the leader's body ends cleanly"
    );
    for f in followers {
        let (bytes, clean) = f.await;
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            String::from_utf8_lossy(&leader_bytes),
            "a follower gets the leader's bytes, its error event included"
        );
        assert!(clean, "and ends as the leader's stream ended");
    }
    assert_eq!(upstream(&h), 1);
    assert_eq!(
        h.metric("keel_cache_lookups_total", &[("result", "coalesced")])
            .await,
        2.0
    );
    wait_for!("the flight to end", h.gw.cache.in_flight() == 0);
    assert_eq!(h.metric("keel_cache_stored_total", &[]).await, 0.0);
}

/// The stream window an h2 client that reads nothing grants: less than one event, so the
/// server can send it almost nothing until it reads.
const UNREAD_WINDOW_BYTES: u32 = 64;

/// A streaming request over h2c from a client that takes (almost) nothing of the response
/// until it reads it with [`read_h2`]: the slowest reader there is.
async fn unread_h2(h: &Harness, path: &str, body: &Value) -> (String, h2::RecvStream) {
    let tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(UNREAD_WINDOW_BYTES)
        .handshake::<_, bytes::Bytes>(tcp)
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let req = http::Request::post(h.url(path))
        .header("content-type", "application/json")
        .body(())
        .unwrap();
    let (response, mut send) = client.send_request(req, false).unwrap();
    send.send_data(bytes::Bytes::from(body.to_string()), true)
        .unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    let cache = response.headers()["x-keel-cache"]
        .to_str()
        .unwrap()
        .to_owned();
    (cache, response.into_body())
}

/// Reads an h2 response body to its end, granting window as it goes; `Err` if it was reset.
async fn read_h2(mut body: h2::RecvStream) -> Result<Vec<u8>, h2::Error> {
    let mut out = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// Each reader of a coalesced stream goes at its own pace: while the leader's own client and
/// one follower take nothing (HTTP/2 clients that grant no window), another follower gets the
/// whole answer to its end; then the slow two read theirs, byte for byte the same. One upstream
/// request in all.
#[tokio::test]
async fn a_reader_that_takes_nothing_holds_back_neither_the_generation_nor_the_others() {
    // No write timeout in this test: the slow readers wait on purpose.
    let h = Harness::openai(
        1,
        1,
        "client_write_timeout_ms = 600000",
        &format!("max_migrations = 0\n{CACHE}"),
    )
    .await;
    // 24 tokens about 100 ms apart: the followers join while the leader generates.
    add_fault(
        h.server(0),
        json!({"kind": "slowdown", "factor": 100, "count": 1}),
    )
    .await;
    let path = "/v1/chat/completions";
    let body = chat("at my own pace", true);
    let (cache, slow_leader) = unread_h2(&h, path, &body).await;
    assert_eq!(cache, "miss", "the leader");
    let (cache, slow_follower) = unread_h2(&h, path, &body).await;
    assert_eq!(cache, "hit", "a follower");
    let (r, first) = started(&h.url(path), &body).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    let done = std::sync::Arc::new(std::sync::Mutex::new(None));
    tokio::spawn({
        let done = done.clone();
        async move {
            let got = raw_rest(r, first).await;
            *done.lock().unwrap() = Some(got);
        }
    });
    wait_for!(
        "the reading follower's stream to end while the others took nothing",
        done.lock().unwrap().is_some()
    );
    let (bytes, clean) = done.lock().unwrap().take().unwrap();
    assert!(clean);
    let (text, finish) = answer_of_stream(&keel_core::sse::decode_all(&bytes).unwrap());
    assert!(
        !text.is_empty() && !finish.is_empty(),
        "the whole answer, to its end"
    );
    for (who, slow) in [
        ("the leader", slow_leader),
        ("the slow follower", slow_follower),
    ] {
        let got = read_h2(slow).await.unwrap_or_else(|e| panic!("{who}: {e}"));
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&bytes),
            "{who} gets the same bytes at its own pace"
        );
    }
    assert_eq!(upstream(&h), 1);
    assert_eq!(
        h.metric("keel_cache_lookups_total", &[("result", "coalesced")])
            .await,
        2.0
    );
}

#[tokio::test]
async fn a_leader_that_fails_sends_its_waiters_upstream() {
    let h = Harness::openai(1, 1, "", &format!("max_migrations = 0\n{CACHE}")).await;
    // The leader's stream starts late and is cut after two tokens.
    add_fault(h.server(0), json!({"kind": "delay", "ms": 800, "count": 1})).await;
    add_fault(
        h.server(0),
        json!({"kind": "close", "after_tokens": 2, "count": 1}),
    )
    .await;
    let url = h.url("/v1/chat/completions");
    let leader = {
        let (url, b) = (url.clone(), chat("will fail first", true));
        tokio::spawn(async move { keel_sim::http_client().post(url).json(&b).send().await })
    };
    wait_for!("the leader to be in flight", h.gw.cache.in_flight() == 1);
    let waiter = h
        .post("/v1/chat/completions", &chat("will fail first", false))
        .await;
    let cut = read_stream(leader.await.unwrap().unwrap()).await;
    assert!(cut.iter().any(|e| e.data.contains("incomplete")));
    assert_eq!(waiter.status(), 200, "the waiter went upstream itself");
    assert_eq!(header(waiter.headers(), "x-keel-cache"), "stored");
    assert_eq!(upstream(&h), 2);
}

/// A whole chat completion whose text is `content`, for a `raw` fault (keel takes a JSON body
/// answered to a stream request as the whole answer).
fn raw_answer(content: &str) -> Value {
    let body = json!({"id": "c1", "object": "chat.completion", "created": 1, "model": "sim",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
            "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}});
    json!({"kind": "raw", "body": body.to_string(), "count": 1})
}

#[tokio::test]
async fn a_structured_output_off_its_schema_is_not_stored() {
    let h = Harness::openai(1, 1, "", CACHE).await;
    let mut b = chat("describe a person", false);
    b["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "person",
        "schema": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}});
    add_fault(h.server(0), raw_answer(r#"{"age": 3}"#)).await;
    let r = h.post("/v1/chat/completions", &b).await;
    assert_eq!(r.status(), 200);
    assert_eq!(answer_of_body(&r.json().await.unwrap()).0, r#"{"age": 3}"#);
    assert_eq!(
        h.metric("keel_cache_skipped_total", &[("reason", "invalid")])
            .await,
        1.0
    );
    // The next answer fits the schema: stored, then served.
    add_fault(h.server(0), raw_answer(r#"{"name": "Ada"}"#)).await;
    let r = h.post("/v1/chat/completions", &b).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "stored");
    let r = h.post("/v1/chat/completions", &b).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    assert_eq!(
        answer_of_body(&r.json().await.unwrap()).0,
        r#"{"name": "Ada"}"#
    );
    assert_eq!(upstream(&h), 2);
}

#[tokio::test]
async fn the_semantic_mode_answers_a_near_identical_prompt() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let extra = format!("{CACHE}semantic = {{ embeddings_pool = \"e\", max_distance = 0.15 }}\n");
    let cfg = format!(
        "{}\n{}",
        pool_over(&fleet, "p", "openai", 1, &extra),
        pool_over(&fleet, "e", "openai", 1, "hedge = \"off\"\n")
    );
    let h = Harness::start(fleet, &cfg).await;
    let path = "/v1/chat/completions";
    let r = h
        .post(path, &chat("What is the capital city of France?", false))
        .await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "stored");
    let original = answer_of_body(&r.json().await.unwrap());
    // Same words, other case and punctuation: another exact key, a close embedding.
    let r = h
        .post(path, &chat("what is the capital city of france", false))
        .await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    assert_eq!(answer_of_body(&r.json().await.unwrap()), original);
    assert_eq!(
        h.metric("keel_cache_lookups_total", &[("result", "semantic_hit")])
            .await,
        1.0
    );
    // Another question is not near; other parameters never match.
    let r = h
        .post(path, &chat("Write a poem about dragons and gold", false))
        .await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "stored");
    let mut longer = chat("What is the capital city of France?", false);
    longer["max_tokens"] = json!(7);
    let r = h.post(path, &longer).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "stored");
}

/// The Responses API runs as Chat Completions: its hits come from the same entries, rendered
/// as a Response object or as Responses stream events.
#[tokio::test]
async fn responses_hits_are_rendered_in_responses_form() {
    let h = Harness::openai(1, 1, "", CACHE).await;
    let body = |stream: bool| {
        json!({"model": "p", "temperature": 0, "instructions": "be brief", "input": "name a bird",
            "max_output_tokens": 24, "stream": stream})
    };
    let text_of = |v: &Value| {
        v["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let r = h.post("/v1/responses", &body(false)).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "stored");
    let original = text_of(&r.json().await.unwrap());
    let r = h.post("/v1/responses", &body(false)).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "response");
    assert_eq!(text_of(&v), original);
    let r = h.post("/v1/responses", &body(true)).await;
    assert_eq!(header(r.headers(), "x-keel-cache"), "hit");
    let events = read_stream(r).await;
    let last: Value = serde_json::from_str(&events.last().unwrap().data).unwrap();
    // `incomplete` when max_output_tokens cut the answer, as it did the original.
    assert_eq!(last["response"]["status"], v["status"]);
    assert_eq!(
        last["type"],
        format!("response.{}", v["status"].as_str().unwrap())
    );
    assert_eq!(text_of(&last["response"]), original);
    assert_eq!(upstream(&h), 1);
}
