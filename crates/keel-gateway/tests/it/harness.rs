//! A gateway on loopback in front of a simulated fleet, configured from TOML like production.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use keel_gateway::{Config, Gateway};
use keel_sim::{Fleet, ServerConfig, ServerHandle};
use serde_json::{json, Value};
use tokio::sync::oneshot;

#[allow(dead_code)] // fields used by some test modules only
pub struct Harness {
    pub fleet: Fleet,
    pub gw: Arc<Gateway>,
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// The admin or an ops key, for reading the operations plane of a gateway with keys.
    pub ops_key: Option<String>,
}

/// One `[[pools.variants]]` table.
pub fn variant(name: &str, url: &str, protocol: &str, weight: u32) -> String {
    format!("[[pools.variants]]\nname = \"{name}\"\nurl = \"{url}\"\nprotocol = \"{protocol}\"\nupstream_model = \"sim\"\nweight = {weight}\n")
}

/// A pool over every server of the fleet; the first server gets `first_weight`, others 1.
/// Warm-up requests and refresh probes are off unless `pool_extra` has its own
/// `[pools.health]` table, so that upstream request counts in tests are the client's requests
/// only.
pub fn pool_over(
    fleet: &Fleet,
    name: &str,
    protocol: &str,
    first_weight: u32,
    pool_extra: &str,
) -> String {
    let health = if pool_extra.contains("[pools.health]") {
        ""
    } else {
        "[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n"
    };
    let mut s = format!("[[pools]]\nname = \"{name}\"\n{pool_extra}\n{health}");
    for (i, srv) in fleet.servers.iter().enumerate() {
        let url = if protocol == "openai" {
            srv.openai_base()
        } else {
            srv.anthropic_base()
        };
        s.push_str(&variant(
            &srv.name,
            &url,
            protocol,
            if i == 0 { first_weight } else { 1 },
        ));
    }
    s
}

impl Harness {
    pub async fn start(fleet: Fleet, config: &str) -> Harness {
        let env: HashMap<String, String> =
            HashMap::from([("UPSTREAM_KEY".into(), "sk-upstream-secret".into())]);
        let mut cfg =
            Config::parse(config, "test.toml", &env).unwrap_or_else(|e| panic!("{e}\n{config}"));
        // Access lines only where a test asks for them (`[log]`), not over the test output.
        if !config.contains("[log]") {
            cfg.log.access = keel_gateway::config::AccessLogTarget::Off;
        }
        let gw = Gateway::new(cfg);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(keel_gateway::http::server::serve(
            gw.clone(),
            listener,
            async move {
                let _ = stopped.await;
            },
        ));
        Harness {
            fleet,
            gw,
            addr,
            stop: Some(stop),
            task: Some(task),
            ops_key: None,
        }
    }

    /// `n` fast servers and one OpenAI pool `p` over them (first server weight `w0`).
    pub async fn openai(n: usize, w0: u32, top: &str, pool_extra: &str) -> Harness {
        let fleet = Fleet::start_n(n, ServerConfig::fast("s")).await.unwrap();
        let cfg = format!(
            "{top}\n{}",
            pool_over(&fleet, "p", "openai", w0, pool_extra)
        );
        Harness::start(fleet, &cfg).await
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn server(&self, i: usize) -> &ServerHandle {
        self.fleet.get(i)
    }

    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        keel_sim::http_client()
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .expect("gateway reachable")
    }

    /// A POST with extra request headers.
    pub async fn post_with(
        &self,
        path: &str,
        headers: &[(&str, &str)],
        body: &Value,
    ) -> reqwest::Response {
        let mut req = keel_sim::http_client().post(self.url(path)).json(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send().await.expect("gateway reachable")
    }

    /// A GET whose answer is JSON.
    /// A GET as an operator: with [`Harness::ops_key`] where the test set one.
    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        let req = keel_sim::http_client().get(self.url(path));
        match &self.ops_key {
            Some(k) => req.bearer_auth(k),
            None => req,
        }
    }

    pub async fn get_json(&self, path: &str) -> Value {
        self.get(path)
            .send()
            .await
            .expect("gateway reachable")
            .json()
            .await
            .expect("JSON answer")
    }

    pub async fn chat(&self, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
        let r = self.post("/v1/chat/completions", body).await;
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.unwrap();
        (
            status,
            headers,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// The sum of every series of metric `name` whose labels include all of `labels` (exact
    /// values), parsed from this gateway's exposition; 0 when none exists.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        parse_metric(&self.metrics().await, name, labels)
    }

    pub async fn metrics(&self) -> String {
        self.get("/metrics")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn chat_body(prompt: &str) -> Value {
    json!({"model": "p", "messages": [{"role": "user", "content": prompt}]})
}

pub fn stream_body(prompt: &str) -> Value {
    json!({"model": "p", "stream": true, "messages": [{"role": "user", "content": prompt}]})
}

pub async fn add_fault(server: &ServerHandle, fault: Value) {
    let r = keel_sim::http_client()
        .post(format!("http://{}/sim/faults", server.addr))
        .json(&fault)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// Waits (polling every 10 ms, for at most 20 s) until `cond` holds: tests wait for
/// conditions, never for fixed times, so a loaded machine only makes them slower.
macro_rules! wait_for {
    ($what:expr, $cond:expr) => {{
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            if $cond {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {}",
                $what
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }};
}
pub(crate) use wait_for;

/// A chat request with sim-0 forced as the first attempt (the rest of the plan stays as
/// fallbacks and migration targets).
pub async fn forced_sim0(h: &Harness, body: &Value) -> reqwest::Response {
    h.post_with(
        "/v1/chat/completions",
        &[("x-keel-force-variant", "sim-0")],
        body,
    )
    .await
}

/// The answer simulated server `i` gives without streaming: the reference text (the
/// simulator's generation is deterministic per prompt).
pub async fn reference(h: &Harness, i: usize, path: &str, body: &Value) -> Value {
    let url = if path.starts_with("/v1/messages") {
        format!("{}{path}", h.server(i).anthropic_base())
    } else {
        format!("{}{}", h.server(i).openai_base(), &path[3..])
    };
    let mut b = body.clone();
    b["stream"] = json!(false);
    b["model"] = json!("sim");
    keel_sim::http_client()
        .post(url)
        .json(&b)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub fn header<'a>(h: &'a reqwest::header::HeaderMap, name: &str) -> &'a str {
    h.get(name).map(|v| v.to_str().unwrap()).unwrap_or("")
}

/// Reads a whole stream body (also when it ends in a transport error) and decodes it strictly.
pub async fn read_stream(mut resp: reqwest::Response) -> Vec<keel_core::sse::SseEvent> {
    let mut bytes = Vec::new();
    while let Ok(Some(c)) = resp.chunk().await {
        bytes.extend_from_slice(&c);
    }
    keel_core::sse::decode_all(&bytes).expect("client sees valid SSE framing")
}

pub fn openai_stream_text(events: &[keel_core::sse::SseEvent]) -> String {
    events
        .iter()
        .filter(|e| e.data != "[DONE]")
        .filter_map(|e| {
            serde_json::from_str::<Value>(&e.data).ok()?["choices"].get(0)?["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// See [`Harness::metric`].
pub fn parse_metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut sum = 0.0;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (n, label_text) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.strip_suffix('}').unwrap_or(rest)),
            None => (series, ""),
        };
        if n != name {
            continue;
        }
        // Label values here never contain `",`; split on it.
        let present: Vec<(&str, &str)> = label_text
            .split("\",")
            .filter_map(|kv| {
                let (k, v) = kv.split_once("=\"")?;
                Some((k, v.trim_end_matches('"')))
            })
            .collect();
        if labels.iter().all(|l| present.contains(l)) {
            sum += value
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("bad value in {line}"));
        }
    }
    sum
}

#[test]
fn parse_metric_matches_exact_label_values() {
    let text = "# TYPE x counter\nx{pool=\"p\",outcome=\"ok\"} 1\nx{pool=\"p\",outcome=\"ok2\"} 10\nx{pool=\"q\",outcome=\"ok\"} 5\ny 3\n";
    assert_eq!(parse_metric(text, "x", &[("outcome", "ok")]), 6.0);
    assert_eq!(
        parse_metric(text, "x", &[("pool", "p"), ("outcome", "ok")]),
        1.0
    );
    assert_eq!(parse_metric(text, "x", &[]), 16.0);
    assert_eq!(parse_metric(text, "y", &[]), 3.0);
    assert_eq!(parse_metric(text, "z", &[]), 0.0);
}

/// A gateway served under a reload handle that re-reads `path` (access lines off).
pub async fn start_from_file(
    path: std::path::PathBuf,
) -> (
    SocketAddr,
    Arc<keel_gateway::admin::live::Live>,
    oneshot::Sender<()>,
) {
    use keel_gateway::admin::live::{ConfigSource, Live};
    let text = std::fs::read_to_string(&path).unwrap();
    let env = HashMap::from([("UPSTREAM_KEY".to_owned(), "sk-upstream-secret".to_owned())]);
    let mut cfg = Config::parse(&text, "test.toml", &env).unwrap_or_else(|e| panic!("{e}\n{text}"));
    cfg.log.access = keel_gateway::config::AccessLogTarget::Off;
    let source = ConfigSource {
        path,
        adjust: Box::new(|c: &mut Config| {
            c.log.access = keel_gateway::config::AccessLogTarget::Off
        }),
    };
    let live = Live::new(Gateway::new(cfg), Some(source));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(keel_gateway::http::server::serve_live(
        live.clone(),
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    (addr, live, stop)
}
