//! Hot reload and graceful restart with streams in flight, in both protocols: a reload never
//! drops or alters a stream that started before it; variants whose definition did not change
//! keep their live state; a config with errors, or one that moves the listen address, is
//! refused and the running one stays; on shutdown readiness fails at once, streams that end
//! within `drain_ms` complete, and the rest end with an explicit error event.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use keel_gateway::admin::live::{Reloader, CUT_MESSAGE};
use keel_gateway::Config;
use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};

use crate::harness::*;

/// The pools the stream tests use: `p` (OpenAI protocol) and `a` (Anthropic) over the same
/// fleet, with nothing that could move a slow stream (no hedge, no migration, no adaptive
/// stall): what the client gets is exactly what the variant sent.
fn two_pools(fleet: &Fleet, extra: &str) -> String {
    let still = format!("hedge = \"off\"\nmax_migrations = 0\nadaptive_stall = false\n{extra}");
    format!(
        "allow_force_variant = true\n{}\n{}",
        pool_over(fleet, "p", "openai", 1, &still),
        pool_over(fleet, "a", "anthropic", 1, &still)
    )
}

/// A streamed request in `protocol`'s shape for pool `p` or `a`.
fn streamed(anthropic: bool, prompt: &str) -> (&'static str, Value) {
    let model = if anthropic { "a" } else { "p" };
    let body = json!({"model": model, "stream": true, "max_tokens": 24,
                      "messages": [{"role": "user", "content": prompt}]});
    let path = if anthropic {
        "/v1/messages"
    } else {
        "/v1/chat/completions"
    };
    (path, body)
}

/// The text of a stream, and whether it ended with the protocol's clean end.
fn stream_text(anthropic: bool, events: &[keel_core::sse::SseEvent]) -> (String, bool) {
    if !anthropic {
        let done = events.last().is_some_and(|e| e.data == "[DONE]");
        return (openai_stream_text(events), done);
    }
    let text = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("content_block_delta"))
        .filter_map(|e| {
            let v: Value = serde_json::from_str(&e.data).ok()?;
            v["delta"]["text"].as_str().map(str::to_owned)
        })
        .collect();
    let done = events
        .last()
        .is_some_and(|e| e.event.as_deref() == Some("message_stop"));
    (text, done)
}

/// The text the simulator generates for the request (deterministic per prompt).
async fn reference_text(h: &Harness, anthropic: bool, path: &str, body: &Value) -> String {
    let r = reference(h, 0, path, body).await;
    let text = if anthropic {
        &r["content"][0]["text"]
    } else {
        &r["choices"][0]["message"]["content"]
    };
    text.as_str().unwrap().to_owned()
}

/// Sends a streamed request forced to `variant` and waits for its response head and first
/// bytes (the stream is in flight on the generation current now).
async fn start_stream(h: &Harness, anthropic: bool, prompt: &str, variant: &str) -> Started {
    let (path, body) = streamed(anthropic, prompt);
    let mut resp = h
        .post_with(path, &[("x-keel-force-variant", variant)], &body)
        .await;
    assert_eq!(resp.status(), 200, "{path}");
    let first = resp.chunk().await.unwrap().expect("a first chunk");
    Started {
        anthropic,
        path,
        body,
        first: first.to_vec(),
        resp,
    }
}

struct Started {
    anthropic: bool,
    path: &'static str,
    body: Value,
    first: Vec<u8>,
    resp: reqwest::Response,
}

impl Started {
    /// The whole stream as the client received it.
    async fn finish(mut self) -> Vec<keel_core::sse::SseEvent> {
        let mut bytes = self.first;
        while let Ok(Some(c)) = self.resp.chunk().await {
            bytes.extend_from_slice(&c);
        }
        keel_core::sse::decode_all(&bytes).expect("valid SSE framing")
    }
}

pub(crate) fn config(text: &str) -> Config {
    let env = HashMap::from([("UPSTREAM_KEY".to_owned(), "sk-upstream-secret".to_owned())]);
    let mut cfg = Config::parse(text, "test.toml", &env).unwrap_or_else(|e| panic!("{e}\n{text}"));
    cfg.log.access = keel_gateway::config::AccessLogTarget::Off;
    cfg
}

/// The reload handle of a harness's gateway (the server task makes it when it starts).
pub(crate) async fn live_of(h: &Harness) -> Arc<dyn Reloader> {
    wait_for!("the server to start", h.gw.process.reloader().is_some());
    h.gw.process
        .reloader()
        .expect("served under a reload handle")
}

#[tokio::test]
async fn streams_in_flight_cross_a_reload_intact_in_both_protocols() {
    let fleet = Fleet::start_n(2, ServerConfig::fast("s")).await.unwrap();
    for s in &fleet.servers {
        add_fault(s, json!({"kind": "slowdown", "factor": 60})).await;
    }
    let before = two_pools(&fleet, "");
    // The next config: sim-1 leaves both pools (its streams drain on the old generation),
    // pool `p` gets another timeout, and a pool `q` appears.
    let fleet_one = &fleet.servers[..1];
    let mut after = String::from("allow_force_variant = true\n");
    for (name, protocol) in [("p", "openai"), ("a", "anthropic")] {
        let s = &fleet_one[0];
        let url = if protocol == "openai" {
            s.openai_base()
        } else {
            s.anthropic_base()
        };
        after.push_str(&format!("[[pools]]\nname = \"{name}\"\nhedge = \"off\"\nmax_migrations = 0\nadaptive_stall = false\n[pools.timeouts]\ntotal_ms = 120000\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}", variant(&s.name, &url, protocol, 1)));
    }
    after.push_str(&pool_over(&fleet, "q", "openai", 1, ""));
    let h = Harness::start(fleet, &before).await;
    let live = live_of(&h).await;

    let mut streams = Vec::new();
    for anthropic in [false, true] {
        for (i, variant) in ["sim-0", "sim-1"].iter().enumerate() {
            let prompt = format!("a story about reloads number {i}");
            streams.push(start_stream(&h, anthropic, &prompt, variant).await);
        }
    }
    let report = live
        .apply(config(&after))
        .expect("a valid config is applied");
    assert_eq!(report["generation"], 2, "{report}");
    // A figure for bench/RESULTS.md's reload row (not asserted: times are measured, never tested).
    println!(
        "reload applied in {} ms with 4 streams in flight",
        report["took_ms"]
    );
    let changes = report["pools"].as_array().unwrap();
    assert!(
        changes.contains(&json!({"pool": "q", "change": "added"})),
        "{report}"
    );
    assert!(
        changes
            .iter()
            .any(|c| c["pool"] == "p" && c["removed"] == json!(["sim-1"])),
        "{report}"
    );

    // New requests see the new generation at once (even before the streams end).
    assert_eq!(
        h.chat(&json!({"model": "q", "messages": [{"role": "user", "content": "hi"}]}))
            .await
            .0,
        200
    );
    let forced_gone = h
        .post_with(
            "/v1/chat/completions",
            &[("x-keel-force-variant", "sim-1")],
            &stream_body("x"),
        )
        .await;
    assert_eq!(forced_gone.status(), 400, "sim-1 left pool p");

    for s in streams {
        let (anthropic, path, body) = (s.anthropic, s.path, s.body.clone());
        let events = s.finish().await;
        let (text, clean_end) = stream_text(anthropic, &events);
        assert!(
            clean_end,
            "{path}: the stream ends with its protocol's end: {events:?}"
        );
        assert_eq!(
            text,
            reference_text(&h, anthropic, path, &body).await,
            "{path}: the text is unaltered"
        );
    }
    assert_eq!(
        h.metric("keel_config_reloads_total", &[("outcome", "ok")])
            .await,
        1.0
    );
}

#[tokio::test]
async fn unchanged_variants_keep_their_live_state_across_a_reload() {
    // The servers want a key; variants `b` and `c` are configured without it, so their first
    // request gets a 401 and keel marks their credential broken (for a minute): state learned
    // live, which a reload must not forget for `b` (unchanged) but resets for `c` (redefined).
    let server = ServerConfig {
        api_key: Some("sk-upstream-secret".into()),
        ..ServerConfig::fast("s")
    };
    let fleet = Fleet::start_n(3, server).await.unwrap();
    let urls: Vec<String> = fleet.servers.iter().map(|s| s.openai_base()).collect();
    let pool = |c_weight: u32, extra_variant: &str| {
        let s = &urls;
        format!(
            "allow_force_variant = true\n[[pools]]\nname = \"p\"\nhedge = \"off\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n\
             {}api_key = \"${{UPSTREAM_KEY}}\"\n{}{}{extra_variant}",
            variant("a", &s[0], "openai", 1),
            variant("b", &s[1], "openai", 1),
            variant("c", &s[2], "openai", c_weight),
        )
    };
    let h = Harness::start(fleet, &pool(1, "")).await;
    for v in ["b", "c"] {
        let r = h
            .post_with(
                "/v1/chat/completions",
                &[("x-keel-force-variant", v)],
                &chat_body("x"),
            )
            .await;
        assert_eq!(r.status(), 200, "failed over to `a`");
    }
    let broken = |health: &Value, name: &str| {
        health["pools"][0]["variants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no variant {name}: {health}"))["credential_broken"]
            .as_bool()
            .unwrap()
    };
    // Marked once keel's own request confirms the refusal (a client's alone does not).
    wait_for!("both credentials confirmed broken", {
        let health = h.get_json("/keel/health").await;
        broken(&health, "b") && broken(&health, "c")
    });

    // `c` redefined (its weight), a variant `d` added: the pool changed, `b` did not.
    let d = format!(
        "{}api_key = \"${{UPSTREAM_KEY}}\"\n",
        variant("d", &urls[0], "openai", 1)
    );
    let report = live_of(&h).await.apply(config(&pool(2, &d))).unwrap();
    assert_eq!(report["pools"][0]["kept"], json!(["a", "b"]), "{report}");
    assert_eq!(report["pools"][0]["redefined"], json!(["c"]), "{report}");
    assert_eq!(report["pools"][0]["added"], json!(["d"]), "{report}");
    let health = h.get_json("/keel/health").await;
    assert!(
        broken(&health, "b"),
        "an unchanged variant keeps what keel learned: {health}"
    );
    assert!(
        !broken(&health, "c"),
        "a redefined variant starts afresh: {health}"
    );
    assert!(!broken(&health, "d"), "{health}");
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

async fn admin_reload(addr: std::net::SocketAddr, key: Option<&str>) -> (u16, Value) {
    // As an operator's tool sends it (a gateway without keys wants JSON: see `routes::Access`).
    let mut req = keel_sim::http_client()
        .post(format!("http://{addr}/keel/admin/reload"))
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test]
async fn the_admin_reload_refuses_a_bad_config_and_keeps_the_running_one() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let admin = "sk-keel-test-admin";
    let admin_hash =
        keel_gateway::state::keys::hash_text(&keel_gateway::state::keys::hash_secret(admin));
    let good = format!(
        "[admin]\nkey_hash = \"{admin_hash}\"\n{}",
        pool_over(&fleet, "p", "openai", 1, "")
    );
    let path = scratch("admin.toml");
    std::fs::write(&path, &good).unwrap();
    let (addr, live, _stop) = start_from_file(path.clone()).await;
    let chat = |model: &str| {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
        async move {
            keel_sim::http_client()
                .post(format!("http://{addr}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };

    assert_eq!(
        admin_reload(addr, None).await.0,
        401,
        "the admin key is required"
    );

    // An error in the file: refused, with the file's own error message; the old config serves.
    std::fs::write(
        &path,
        good.replace("name = \"p\"", "name = \"p\"\nmax_attempts = 0"),
    )
    .unwrap();
    let (status, body) = admin_reload(addr, Some(admin)).await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("admin.toml:") && message.contains("max_attempts: must be at least 1"),
        "{message}"
    );
    assert_eq!(body["error"]["code"], "invalid", "{body}");
    assert_eq!(live.current().generation, 1);
    assert_eq!(chat("p").await, 200);

    // A new listen address needs a restart: refused, said so.
    std::fs::write(&path, format!("listen = \"127.0.0.1:1\"\n{good}")).unwrap();
    let (status, body) = admin_reload(addr, Some(admin)).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("listen: changing the listen address"),
        "{body}"
    );
    assert_eq!(body["error"]["code"], "refused", "{body}");

    // A good one: pool `p` renamed `p2`.
    std::fs::write(&path, good.replace("name = \"p\"", "name = \"p2\"")).unwrap();
    let (status, body) = admin_reload(addr, Some(admin)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["generation"], 2);
    assert_eq!(chat("p2").await, 200);
    assert_eq!(chat("p").await, 404);

    let metrics = keel_sim::http_client()
        .get(format!("http://{addr}/metrics"))
        .bearer_auth(admin)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for (outcome, n) in [("ok", 1.0), ("invalid", 1.0), ("refused", 1.0)] {
        assert_eq!(
            parse_metric(
                &metrics,
                "keel_config_reloads_total",
                &[("outcome", outcome)]
            ),
            n,
            "{outcome}"
        );
    }
    drop(fleet);
}

#[tokio::test]
async fn the_file_watch_reloads_a_changed_file() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let text = format!(
        "[reload]\nwatch = true\n{}",
        pool_over(&fleet, "p", "openai", 1, "")
    );
    let path = scratch("watched.toml");
    std::fs::write(&path, &text).unwrap();
    let (_addr, live, _stop) = start_from_file(path.clone()).await;
    // The watch acts on a file that stayed the same for a whole poll (a second). Its first
    // look may come after a write (the task starts on its own time), so write again if
    // nothing happened within a few polls; the length changes too, so that a coarse
    // modification time cannot hide a change.
    let mut n = 0;
    wait_for!("the watch to reload the file", {
        n += 1;
        let name = format!("name = \"p-watched-{}\"", "x".repeat(n));
        std::fs::write(&path, text.replace("name = \"p\"", &name)).unwrap();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(4);
        while live.current().generation == 1 && std::time::Instant::now() < until {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        live.current().generation > 1
    });
    assert!(live.current().pool("p").is_none());
    drop(fleet);
}

#[tokio::test]
async fn shutdown_fails_readiness_completes_short_streams_and_cuts_the_rest_with_an_error_event() {
    // sim-0 is slow (a token a second: 16 s or more for a reply), sim-1 quicker (a token
    // every 20 ms): streams on sim-1 end within the drain, those on sim-0 cannot.
    let fleet = Fleet::start_n(2, ServerConfig::fast("s")).await.unwrap();
    add_fault(
        &fleet.servers[0],
        json!({"kind": "slowdown", "factor": 1000}),
    )
    .await;
    add_fault(&fleet.servers[1], json!({"kind": "slowdown", "factor": 20})).await;
    let cfg = format!("drain_ms = 3000\n{}", two_pools(&fleet, ""));
    let mut h = Harness::start(fleet, &cfg).await;
    let ready = keel_sim::http_client()
        .get(h.url("/keel/ready"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    assert_eq!(h.get_json("/keel/live").await["live"], true);

    let mut slow = Vec::new();
    for anthropic in [false, true] {
        slow.push(start_stream(&h, anthropic, "a long story", "sim-0").await);
    }
    // Quick streams, sent just before shutdown: they finish within the drain.
    let mut quick = Vec::new();
    for anthropic in [false, true] {
        quick.push(start_stream(&h, anthropic, "a short story", "sim-1").await);
    }
    h.stop();
    let gw = h.gw.clone();
    wait_for!("draining to begin", gw.process.draining());
    let (status, doc) = keel_gateway::admin::live::admin::ready(&gw);
    assert_eq!(status, 503, "readiness fails at once: {doc}");
    wait_for!(
        "the listener to close",
        keel_sim::http_client()
            .get(h.url("/keel/ready"))
            .send()
            .await
            .is_err()
    );

    for s in quick {
        let (anthropic, path, body) = (s.anthropic, s.path, s.body.clone());
        let events = s.finish().await;
        let (text, clean_end) = stream_text(anthropic, &events);
        assert!(clean_end, "{path}: {events:?}");
        assert_eq!(text, reference_text(&h, anthropic, path, &body).await);
    }
    for s in slow {
        let (anthropic, path) = (s.anthropic, s.path);
        let events = s.finish().await;
        let last = events.last().unwrap();
        assert!(
            last.data.contains(CUT_MESSAGE),
            "{path}: ends with keel's error event: {events:?}"
        );
        if anthropic {
            assert_eq!(last.event.as_deref(), Some("error"));
        }
        assert!(
            !stream_text(anthropic, &events).1,
            "{path}: not a clean end"
        );
    }
    let task = h.task.take().unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(20), task)
        .await
        .expect("the server returns after the drain")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_request_on_a_connection_open_during_the_drain_is_refused_in_its_protocol() {
    let h = Harness::openai(1, 1, "", "").await;
    h.gw.process.begin_drain();
    let (status, _, body) = h.chat(&chat_body("x")).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down"),
        "{body}"
    );
    let r = keel_sim::http_client()
        .get(h.url("/keel/ready"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(h.get_json("/keel/live").await["draining"], true);
}

#[tokio::test]
async fn a_reload_that_would_drop_every_key_is_refused_unless_the_file_says_auth_open() {
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let admin = "sk-keel-test-reload-admin-0123456";
    let tenant = "sk-keel-test-reload-tenant-012345";
    let hash =
        |k: &str| keel_gateway::state::keys::hash_text(&keel_gateway::state::keys::hash_secret(k));
    let pool = pool_over(&fleet, "p", "openai", 1, "");
    let keyed = format!(
        "[admin]\nkey_hash = \"{}\"\n[[keys]]\nid = \"t\"\nhash = \"{}\"\n{pool}",
        hash(admin),
        hash(tenant)
    );
    let path = scratch("auth.toml");
    std::fs::write(&path, &keyed).unwrap();
    let (addr, live, _stop) = start_from_file(path.clone()).await;
    let chat_status = || async move {
        keel_sim::http_client()
            .post(format!("http://{addr}/v1/chat/completions"))
            .json(&json!({"model": "p", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(chat_status().await, 401);

    // A file that lost its keys (half written, a section dropped in a merge): refused.
    std::fs::write(
        &path,
        format!("[admin]\nkey_hash = \"{}\"\n{pool}", hash(admin)),
    )
    .unwrap();
    let (status, body) = admin_reload(addr, Some(admin)).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "refused", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("auth = \"open\""),
        "{body}"
    );
    // The admin key alone may not go either.
    std::fs::write(
        &path,
        keyed.replace(&format!("[admin]\nkey_hash = \"{}\"\n", hash(admin)), ""),
    )
    .unwrap();
    let (status, body) = admin_reload(addr, Some(admin)).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(live.current().generation, 1);
    assert_eq!(chat_status().await, 401, "authentication stays on");

    // Said on purpose: keel runs open.
    std::fs::write(&path, format!("auth = \"open\"\n{pool}")).unwrap();
    let (status, body) = admin_reload(addr, Some(admin)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(chat_status().await, 200);
    drop(fleet);
}
