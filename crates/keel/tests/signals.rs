//! `keel serve` as a process under signals, in both protocols: SIGHUP reloads the config while
//! streams are in flight (they complete unaltered, the next request sees the new config, a file
//! with errors leaves the running config and is counted); SIGTERM drains (readiness fails at
//! once, a stream that ends within `drain_ms` completes, one that cannot ends with an error
//! event, and the process exits cleanly).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod support;
use support::{free_port, keel_serve, wait_listening, Proc};

fn scratch(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("signals-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// One simulated server sending a token every `gap_ms`.
fn sim(port: u16, gap_ms: u64) -> Proc {
    let cfg = scratch(&format!("sim-{port}.toml"));
    std::fs::write(
        &cfg,
        format!("[[servers]]\nname = \"s{port}\"\nttft_ms = 2\nttft_sigma = 0\nprefill_us_per_token = 0\ngap_ms = {gap_ms}\ngap_sigma = 0\ncapacity = 64\n"),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "sim",
            "--config",
            cfg.to_str().unwrap(),
            "--base-port",
            &port.to_string(),
        ])
        .env("KEEL_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start keel sim");
    wait_listening(port, "keel sim");
    Proc(child)
}

/// Pool `name` in both protocols' shapes over the sim at `port`: `name` (OpenAI protocol) and
/// `name-a` (Anthropic); nothing that could move a stream (no hedge, no migration).
fn pools(name: &str, port: u16) -> String {
    let mut s = String::new();
    for (pool, protocol, url) in [
        (
            name.to_owned(),
            "openai",
            format!("http://127.0.0.1:{port}/v1"),
        ),
        (
            format!("{name}-a"),
            "anthropic",
            format!("http://127.0.0.1:{port}"),
        ),
    ] {
        s.push_str(&format!(
            "[[pools]]\nname = \"{pool}\"\nhedge = \"off\"\nmax_migrations = 0\nadaptive_stall = false\n\
             [pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n\
             [[pools.variants]]\nname = \"v\"\nurl = \"{url}\"\nprotocol = \"{protocol}\"\nupstream_model = \"sim\"\n"
        ));
    }
    s
}

fn serve(cfg: &Path, port: u16) -> Proc {
    keel_serve(cfg, port, "warn", Stdio::null())
}

fn signal(p: &Proc, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &p.0.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(ok.success());
}

fn request(pool: &str, anthropic: bool, stream: bool) -> (String, Value) {
    let model = if anthropic {
        format!("{pool}-a")
    } else {
        pool.to_owned()
    };
    let path = if anthropic {
        "/v1/messages"
    } else {
        "/v1/chat/completions"
    };
    let body = json!({"model": model, "stream": stream, "max_tokens": 24,
                      "messages": [{"role": "user", "content": "a story about signals"}]});
    (path.to_owned(), body)
}

async fn post(port: u16, path: &str, body: &Value) -> reqwest::Response {
    keel_sim::http_client()
        .post(format!("http://127.0.0.1:{port}{path}"))
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .expect("keel reachable")
}

/// A stream whose head and first bytes have arrived.
struct InFlight {
    anthropic: bool,
    bytes: Vec<u8>,
    resp: reqwest::Response,
}

async fn start(port: u16, pool: &str, anthropic: bool) -> InFlight {
    let (path, body) = request(pool, anthropic, true);
    let mut resp = post(port, &path, &body).await;
    assert_eq!(resp.status(), 200, "{path}");
    let bytes = resp.chunk().await.unwrap().expect("first bytes").to_vec();
    InFlight {
        anthropic,
        bytes,
        resp,
    }
}

impl InFlight {
    /// The text received and whether the stream ended cleanly, plus its last event's data.
    async fn finish(mut self) -> (String, bool, String) {
        while let Ok(Some(c)) = self.resp.chunk().await {
            self.bytes.extend_from_slice(&c);
        }
        let events = keel_core::sse::decode_all(&self.bytes).expect("valid SSE framing");
        let last = events.last().map(|e| e.data.clone()).unwrap_or_default();
        let mut text = String::new();
        for e in &events {
            let Ok(v) = serde_json::from_str::<Value>(&e.data) else {
                continue;
            };
            let piece = if self.anthropic {
                &v["delta"]["text"]
            } else {
                &v["choices"][0]["delta"]["content"]
            };
            text.push_str(piece.as_str().unwrap_or(""));
        }
        let clean = if self.anthropic {
            events
                .last()
                .is_some_and(|e| e.event.as_deref() == Some("message_stop"))
        } else {
            last == "[DONE]"
        };
        (text, clean, last)
    }
}

/// The whole answer's text, asked without streaming.
async fn whole_text(port: u16, pool: &str, anthropic: bool) -> (u16, String) {
    let (path, body) = request(pool, anthropic, false);
    let r = post(port, &path, &body).await;
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    let text = if anthropic {
        &v["content"][0]["text"]
    } else {
        &v["choices"][0]["message"]["content"]
    };
    (status, text.as_str().unwrap_or("").to_owned())
}

async fn reloads(port: u16, outcome: &str) -> f64 {
    let text = keel_sim::http_client()
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let series = format!("keel_config_reloads_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// Polls `cond` every 50 ms for at most 20 s.
async fn wait_until<F: std::future::Future<Output = bool>>(
    what: &str,
    mut cond: impl FnMut() -> F,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_with_streams_in_flight_and_keeps_the_config_on_errors() {
    let sim_port = free_port();
    let _sim = sim(sim_port, 60);
    let port = free_port();
    let cfg = scratch("hup.toml");
    let first = format!("listen = \"127.0.0.1:{port}\"\n{}", pools("p", sim_port));
    std::fs::write(&cfg, &first).unwrap();
    let keel = serve(&cfg, port);

    let streams = vec![start(port, "p", false).await, start(port, "p", true).await];
    // The next config adds pools `q`, `q-a`.
    std::fs::write(&cfg, format!("{first}{}", pools("q", sim_port))).unwrap();
    signal(&keel, "-HUP");
    wait_until("the reload", || async { reloads(port, "ok").await == 1.0 }).await;
    for anthropic in [false, true] {
        assert_eq!(
            whole_text(port, "q", anthropic).await.0,
            200,
            "the new pool serves"
        );
    }
    for s in streams {
        let anthropic = s.anthropic;
        let (text, clean, last) = s.finish().await;
        assert!(clean, "the stream ends with its protocol's end, not {last}");
        assert_eq!(text, whole_text(port, "p", anthropic).await.1, "unaltered");
    }

    // A file with an error: the running config stays, and the refusal is counted.
    std::fs::write(
        &cfg,
        first.replace("hedge = \"off\"", "hedge = \"sometimes\""),
    )
    .unwrap();
    signal(&keel, "-HUP");
    wait_until("the refused reload", || async {
        reloads(port, "invalid").await == 1.0
    })
    .await;
    assert_eq!(
        whole_text(port, "q", false).await.0,
        200,
        "the running config stays"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_fails_readiness_drains_and_cuts_what_outlives_the_drain() {
    // `slow` sends a token a second (16 s or more per answer); `quick` one every 20 ms.
    let (slow_port, quick_port) = (free_port(), free_port());
    let (_slow, _quick) = (sim(slow_port, 1000), sim(quick_port, 20));
    let port = free_port();
    let cfg = scratch("term.toml");
    let text = format!(
        "listen = \"127.0.0.1:{port}\"\ndrain_ms = 3000\n{}{}",
        pools("slow", slow_port),
        pools("quick", quick_port)
    );
    std::fs::write(&cfg, text).unwrap();
    let mut keel = serve(&cfg, port);
    let ready = keel_sim::http_client()
        .get(format!("http://127.0.0.1:{port}/keel/ready"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);

    let mut slow = Vec::new();
    let mut quick = Vec::new();
    for anthropic in [false, true] {
        slow.push(start(port, "slow", anthropic).await);
        quick.push(start(port, "quick", anthropic).await);
    }
    signal(&keel, "-TERM");
    wait_until("readiness to fail", || async {
        match keel_sim::http_client()
            .get(format!("http://127.0.0.1:{port}/keel/ready"))
            .send()
            .await
        {
            Ok(r) => r.status() == 503,
            Err(_) => true, // the listener is closed: no probe gets a 200 either
        }
    })
    .await;
    for s in quick {
        let (_, clean, last) = s.finish().await;
        assert!(
            clean,
            "a stream that ends within the drain completes, not {last}"
        );
    }
    for s in slow {
        let (_, clean, last) = s.finish().await;
        assert!(!clean);
        assert!(
            last.contains("keel is shutting down"),
            "ends with keel's error event: {last}"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = keel.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "keel did not exit after the drain"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
}
