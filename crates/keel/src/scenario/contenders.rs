//! The contenders: keel in process (as configured, `keel-rr`, `keel:LINES`) and the peer
//! gateways started by `bench/peers/<name>.sh`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use keel_core::protocol::{Endpoint, Protocol};
use keel_sim::config::PrefillConvention;
use keel_sim::text::Generator;
use keel_sim::{Fleet, ServerHandle};

use super::*;

/// A contender: something that serves `model` "bench" at `url` over the fleet.
pub struct Running {
    pub url: String,
    /// Headers sent with every request (a peer's per-request routing config).
    pub headers: Vec<(String, String)>,
    /// The peer's main process (for memory and CPU pinning); `None` in-process.
    pub pid: Option<u32>,
    pub stop: Box<dyn FnOnce() + Send>,
}

/// Whether the contender at `url` answers a one-token chat request with a success.
pub async fn answers(client: &reqwest::Client, url: &str, headers: &[(String, String)]) -> bool {
    let probe = json!({"model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]});
    let mut req = client.post(url).json(&probe);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    req.send()
        .await
        .map(|r| r.status().is_success())
        .unwrap_or(false)
}

/// A pool table named `name` (`extra` lines in it) with one OpenAI variant per simulated server.
pub fn pool_toml(fleet: &Fleet, name: &str, extra: &str) -> String {
    pool_toml_of(&fleet.servers, Protocol::OpenAi, name, extra)
}

/// A pool table named `name` (`extra` lines in it) with one variant speaking `protocol` per
/// simulated server.
pub fn pool_toml_of(
    servers: &[ServerHandle],
    protocol: Protocol,
    name: &str,
    extra: &str,
) -> String {
    pool_toml_with(servers, protocol, name, extra, "")
}

/// [`pool_toml_of`] with `variant_extra` lines in every variant table.
pub fn pool_toml_with(
    servers: &[ServerHandle],
    protocol: Protocol,
    name: &str,
    extra: &str,
    variant_extra: &str,
) -> String {
    let mut toml = format!("[[pools]]\nname = \"{name}\"\n{extra}\n");
    for srv in servers {
        let url = match protocol {
            Protocol::OpenAi => srv.openai_base(),
            Protocol::Anthropic => srv.anthropic_base(),
        };
        toml.push_str(&format!(
            "[[pools.variants]]\nname = \"{}\"\nurl = \"{url}\"\nprotocol = \"{}\"\nupstream_model = \"sim\"\n{variant_extra}\n",
            srv.name,
            protocol.as_str()
        ));
    }
    toml
}

/// The text a simulated server of `generator`'s family answers to `body` on `endpoint` when
/// nothing goes wrong: what every answer through a gateway must equal byte for byte.
pub fn reference_text(generator: &Generator, endpoint: Endpoint, body: &Value) -> String {
    let sreq = keel_sim::wire::parse_request(endpoint, body, PrefillConvention::Explicit)
        .expect("bench requests are valid");
    generator
        .generate(
            sreq.mode,
            &sreq.context,
            &sreq.prefill,
            sreq.max_tokens,
            &sreq.stop,
        )
        .text()
}

/// An in-process gateway serving `toml` on a free loopback port, after its warm-up requests;
/// sending on the returned sender stops it.
pub async fn start_gateway(
    toml: &str,
    origin: &str,
) -> Result<(std::net::SocketAddr, tokio::sync::oneshot::Sender<()>), String> {
    let mut cfg = keel_gateway::Config::parse(toml, origin, &Default::default())
        .map_err(|e| e.to_string())?;
    // Measured gateways write no access lines unless asked to (`KEEL_LOG`), as before.
    if std::env::var_os("KEEL_LOG").is_none() {
        cfg.log.access = keel_gateway::config::AccessLogTarget::Off;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let gw = keel_gateway::Gateway::new(cfg);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(keel_gateway::http::server::serve(
        gw,
        listener,
        async move {
            let _ = rx.await;
        },
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok((addr, tx))
}

/// keel's pool lines for `keel-rr`: the scenario's, with round robin instead of the policy and
/// without affinity.
pub(crate) fn round_robin_pool(extra: &str) -> String {
    let mut lines: Vec<&str> = extra
        .lines()
        .filter(|l| {
            let key = l.split('=').next().unwrap_or("").trim();
            key != "policy" && key != "affinity"
        })
        .collect();
    lines.push("policy = \"round_robin\"");
    lines.join("\n")
}

/// keel over the fleet with `pool` lines in its pool table (a contender `keel:LINES` adds
/// LINES, `;`-separated, to the scenario's, e.g. `keel:max_hedges = 1`).
pub(crate) async fn start_keel(s: &Scenario, fleet: &Fleet, pool: &str) -> Result<Running, String> {
    let toml = pool_toml_with(
        &fleet.servers,
        Protocol::OpenAi,
        "bench",
        pool,
        &s.keel_variant,
    );
    let (addr, tx) = start_gateway(&toml, &format!("<scenario {}>", s.name)).await?;
    Ok(Running {
        url: format!("http://{addr}/v1/chat/completions"),
        headers: Vec::new(),
        pid: None,
        stop: Box::new(move || {
            let _ = tx.send(());
        }),
    })
}

/// A peer gateway started by its script in `bench/peers/<name>.sh DIR PORT BASE_URL...`, which
/// writes `DIR/<name>.pid`; it serves the fleet as model `bench` on `PORT`.
pub async fn start_peer(name: &str, fleet: &Fleet, out: &Path) -> Result<Running, String> {
    let script = PathBuf::from(format!("bench/peers/{name}.sh"));
    if !script.exists() {
        return Err(format!("no peer script {}", script.display()));
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let dir = out.join(name);
    let status = std::process::Command::new("bash")
        .arg(&script)
        .arg(&dir)
        .arg(port.to_string())
        .args(fleet.servers.iter().map(|s| s.openai_base()))
        .status()
        .map_err(|e| format!("{name}: {e}"))?;
    if !status.success() {
        return Err(format!("{} exited with {status}", script.display()));
    }
    let pid_file = dir.join(format!("{name}.pid"));
    let stop = move || {
        if let Ok(pid) = std::fs::read_to_string(&pid_file) {
            let _ = std::process::Command::new("kill").arg(pid.trim()).status();
        }
    };
    let headers: Vec<(String, String)> = std::fs::read_to_string(dir.join("headers.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<BTreeMap<String, String>>(&t).ok())
        .map(|m| m.into_iter().collect())
        .unwrap_or_default();
    // Ready when it answers a request (LiteLLM takes seconds to start).
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let client = reqwest::Client::new();
    for _ in 0..600 {
        if answers(&client, &url, &headers).await {
            let pid = std::fs::read_to_string(dir.join(format!("{name}.pid")))
                .ok()
                .and_then(|p| p.trim().parse().ok());
            return Ok(Running {
                url,
                headers,
                pid,
                stop: Box::new(stop),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop();
    Err(format!(
        "{name} did not answer within 120 s (see {}/)",
        dir.display()
    ))
}
