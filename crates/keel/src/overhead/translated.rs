//! `keel bench overhead --translated`: what cross-protocol translation adds to a stream, and
//! what each cloud dialect adds (Azure OpenAI, Gemini, Vertex AI's Gemini and Claude, Bedrock,
//! the Responses API: keel-sim answers each in its own wire format, from the same server).
//!
//! One `keel serve` process holds two pools over the same zero-latency simulated server: one
//! reaches it as an OpenAI-protocol variant, the other as an Anthropic-protocol variant. Each
//! client protocol is measured three ways in every round: straight to the upstream (`direct`),
//! through keel to a variant of its own protocol (`same`), and through keel to a variant of the
//! other protocol (`translated`: an OpenAI client served by Anthropic Messages, an Anthropic
//! client served by Chat Completions). All six runs of a round go one after the other at the same
//! rate against the same process, and keel's two paths swap order every round, so both see the
//! same load and machine state. Figures are medians across rounds of each round's percentiles;
//! "+" is path − direct, and the `translated − same` row is what translation adds.
//!
//! CPU per streamed token: keel's process CPU time (user + system, all threads, from
//! `/proc/<pid>/stat`) over one run ÷ the token events its client received in that run.

use keel_core::protocol::Protocol;
use keel_sim::load::LoadReport;
use serde_json::{json, Value};

use super::{
    cpu_plan, http_client, load, measure, median_or_null, pin, pinning, row, zero_latency_upstream,
    Options, Run, Target,
};
use crate::keel_process::KeelProcess;
use crate::scenario::pool_toml_of;

/// The paths measured for a client: `direct`, keel's two protocol paths, then each dialect.
const PATHS: [&str; 9] = [
    "direct",
    "same",
    "translated",
    "azure",
    "gemini",
    "vertex-gemini",
    "vertex-claude",
    "bedrock",
    "responses",
];

/// Each dialect's variant keys after its name (`{root}`: the server's root URL).
const DIALECTS: [(&str, &str); 6] = [
    ("azure", "protocol = \"azure\"\nurl = \"{root}\"\ndeployment = \"sim\"\napi_key = \"k\""),
    ("gemini", "protocol = \"gemini\"\nurl = \"{root}\"\nupstream_model = \"sim\"\napi_key = \"k\""),
    ("vertex-gemini", "protocol = \"vertex\"\nurl = \"{root}\"\nproject = \"p\"\nlocation = \"us-east5\"\nupstream_model = \"gemini-sim\"\naccess_token = \"t\""),
    ("vertex-claude", "protocol = \"vertex\"\nurl = \"{root}\"\nproject = \"p\"\nlocation = \"us-east5\"\nupstream_model = \"claude-sim\"\naccess_token = \"t\""),
    ("bedrock", "protocol = \"bedrock\"\nurl = \"{root}\"\nregion = \"us-east-1\"\nupstream_model = \"anthropic.claude-sim-v1:0\"\naws_access_key_id = \"AKIDBENCH\"\naws_secret_access_key = \"bench-secret\""),
    ("responses", "protocol = \"openai-responses\"\nurl = \"{root}/v1\"\nupstream_model = \"sim\"\napi_key = \"k\""),
];

/// One pool per dialect over `sim`, named `bench-<dialect>`.
fn dialect_pools(sim: &keel_sim::ServerHandle, extra: &str) -> String {
    DIALECTS
        .iter()
        .map(|(name, keys)| {
            let keys = keys.replace("{root}", &sim.anthropic_base());
            format!("[[pools]]\nname = \"bench-{name}\"\n{extra}\n[[pools.variants]]\nname = \"{name}\"\n{keys}\n")
        })
        .collect()
}

fn pool_name(p: Protocol) -> String {
    format!("bench-{}", p.as_str())
}

fn other(p: Protocol) -> Protocol {
    match p {
        Protocol::OpenAi => Protocol::Anthropic,
        Protocol::Anthropic => Protocol::OpenAi,
    }
}

/// The targets for a client speaking `client`'s protocol, in [`PATHS`] order.
fn targets(client: Protocol, sim: &keel_sim::ServerHandle, keel: &KeelProcess) -> Vec<Target> {
    let endpoint = match client {
        Protocol::OpenAi => keel_core::protocol::Endpoint::ChatCompletions,
        Protocol::Anthropic => keel_core::protocol::Endpoint::Messages,
    };
    let (direct_base, keel_base) = match client {
        Protocol::OpenAi => (
            sim.openai_base(),
            format!("http://127.0.0.1:{}/v1", keel.port),
        ),
        Protocol::Anthropic => (
            sim.anthropic_base(),
            format!("http://127.0.0.1:{}", keel.port),
        ),
    };
    let target = |name: &str, base: &str, model: String, pid: Option<u32>| Target {
        name: name.into(),
        base: base.to_owned(),
        model,
        endpoint,
        headers: Vec::new(),
        pid,
        stop: None,
    };
    let pid = Some(keel.pid());
    let mut out = vec![
        target("direct", &direct_base, "sim".into(), None),
        target("same", &keel_base, pool_name(client), pid),
        target("translated", &keel_base, pool_name(other(client)), pid),
    ];
    for (name, _) in DIALECTS {
        out.push(target(name, &keel_base, format!("bench-{name}"), pid));
    }
    out
}

/// [`row`] of the runs, with CPU per token and tokens per request.
fn summarize(runs: &[Run]) -> Value {
    let reports: Vec<LoadReport> = runs.iter().map(|r| r.report.clone()).collect();
    let mut v = row(&reports);
    let cpu: Vec<f64> = runs.iter().filter_map(Run::cpu_us_per_token).collect();
    v["cpu_us_per_token"] = median_or_null(cpu);
    v["tokens"] = json!(reports.iter().map(|r| r.tokens).sum::<u64>());
    v
}

fn ms(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(0.0)
}

/// One table line: `a − b` in µs for the latency columns, and `cpu` as given.
fn line(client: &str, rps: f64, label: &str, a: &Value, b: &Value, cpu: Option<f64>) -> String {
    let d = |k: &str| (ms(a, k) - ms(b, k)) * 1000.0;
    format!(
        "{client:<9} {rps:>6} {label:<24} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>11} {:>7} {:>8}\n",
        d("ttfb_p50_ms"),
        d("ttfb_p99_ms"),
        d("total_p50_ms"),
        d("total_p99_ms"),
        cpu.map_or("—".into(), |c| format!("{c:.2}")),
        a["errors"],
        a["requests"],
    )
}

/// Column heads: latency added in µs (medians of rounds), keel's CPU µs per streamed token.
const HEADER: &str = "client     req/s path                     +ttfb p50 +ttfb p99 +total p50 +total p99 cpu µs/tok  errors requests\n";

pub async fn run(o: Options) -> Result<(), String> {
    if o.contenders.iter().any(|c| c != "keel") {
        return Err(
            "--translated measures keel alone (no peer translates between protocols): drop --contenders"
                .into(),
        );
    }
    let fleet = zero_latency_upstream().await?;
    let (pinned, gw_cpu, bench_cpus) = cpu_plan(o.pin);
    if pinned {
        pin(std::process::id(), &bench_cpus);
    }
    let client = http_client()?;
    let threads = o
        .keel_threads
        .map(|n| format!("worker_threads = {n}\n"))
        .unwrap_or_default();
    let mut pools: String = [Protocol::OpenAi, Protocol::Anthropic]
        .map(|p| pool_toml_of(&fleet.servers, p, &pool_name(p), &o.keel_pool))
        .concat();
    pools.push_str(&dialect_pools(fleet.get(0), &o.keel_pool));
    let keel = KeelProcess::spawn(&format!("{threads}{pools}"), None).await?;
    if pinned {
        pin(keel.pid(), &gw_cpu);
    }
    let clients =
        [Protocol::OpenAi, Protocol::Anthropic].map(|p| (p, targets(p, fleet.get(0), &keel)));
    for (_, ts) in &clients {
        for t in ts {
            load(&client, t, 50.0, 1.0, true).await;
        }
    }
    let intro = format!(
        "keel bench overhead --translated: one zero-latency simulated upstream behind an OpenAI- and an Anthropic-protocol pool and one pool per cloud dialect; {}; streams of 16 tokens; rates {:?} req/s, {} s × {} rounds; keel worker threads: {}\n",
        pinning(pinned, &gw_cpu, "load generator and upstream", &bench_cpus),
        o.rates,
        o.duration,
        o.rounds,
        o.keel_threads.map_or_else(|| "one per core".into(), |n| n.to_string())
    );
    print!("{intro}{HEADER}");
    let mut lines = String::new();
    let mut report = Vec::new();
    for &rps in &o.rates {
        // runs[client][path]
        let mut runs: Vec<Vec<Vec<Run>>> = clients
            .iter()
            .map(|_| PATHS.iter().map(|_| Vec::new()).collect())
            .collect();
        for round in 0..o.rounds {
            for (ci, (_, ts)) in clients.iter().enumerate() {
                // keel's paths take turns going first, so no path always meets a warmer process.
                let keel_paths = ts.len() - 1;
                let order =
                    std::iter::once(0).chain((0..keel_paths).map(|k| 1 + (k + round) % keel_paths));
                for pi in order {
                    runs[ci][pi].push(measure(&client, &ts[pi], rps, o.duration, true).await);
                }
            }
        }
        for ((protocol, _), by_path) in clients.iter().zip(&runs) {
            let figures: Vec<Value> = by_path.iter().map(|r| summarize(r)).collect();
            let (direct, same) = (&figures[0], &figures[1]);
            let cpu = |v: &Value| v["cpu_us_per_token"].as_f64();
            let name = protocol.as_str();
            let mut text = line(name, rps, "same", same, direct, cpu(same));
            let mut added = serde_json::Map::new();
            for (path, f) in PATHS.iter().zip(&figures).skip(2) {
                text += &line(name, rps, path, f, direct, cpu(f));
                let cpu_added = cpu(f).zip(cpu(same)).map(|(t, s)| t - s);
                text += &line(name, rps, &format!("{path} − same"), f, same, cpu_added);
                added.insert((*path).to_owned(), json!(cpu_added));
            }
            print!("{text}");
            lines.push_str(&text);
            report.push(json!({"client": name, "rps": rps,
                "paths": PATHS.iter().zip(&figures).map(|(p, v)| json!({"path": p, "figures": v})).collect::<Vec<_>>(),
                "minus_same_cpu_us_per_token": added}));
        }
    }
    drop(keel);
    if let Some(dir) = &o.out {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let doc = json!({"rates": o.rates, "duration_s": o.duration, "rounds": o.rounds,
            "keel_worker_threads": o.keel_threads, "pinned": pinned, "rows": report});
        let path = dir.join("translated.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&doc).unwrap_or_default(),
        )
        .and_then(|_| {
            std::fs::write(
                dir.join("translated.txt"),
                format!("{intro}{HEADER}{lines}"),
            )
        })
        .map_err(|e| format!("{}: {e}", path.display()))?;
        println!("written {} and translated.txt", path.display());
    }
    Ok(())
}
