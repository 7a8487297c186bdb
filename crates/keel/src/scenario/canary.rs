//! `keel bench canary-rollback`: a candidate variant that fails 30 % of its requests goes
//! through a canary (steps 10 % → 25 % → 50 % → 100 %), and keel must roll it back by itself.
//!
//! The fleet: three stable servers and one candidate, all of one family (identical answers).
//! A population of users sends requests at a steady rate (each request from a user drawn at
//! random, carrying OpenAI's `user` field, the canary's identity). Figures:
//!
//! - **time to rollback**: from the first request to the first `/keel/health` that shows the
//!   canary `rolled_back` (polled every 10 ms);
//! - **users exposed**: users with a request that reached the candidate (served by it, or failed
//!   over from it: the stable servers have no faults, so a request with more than one attempt
//!   met the candidate), as a share of the users who sent a request before the rollback;
//! - **users who saw an error**: users with any answer other than 200 (failover should make
//!   it 0);
//! - requests on the candidate after the rollback (should be 0).

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use keel_core::canary::bucket;
use keel_core::rng::Rng;
use keel_sim::{Fleet, FleetConfig, ServerConfig};

use super::contenders::{pool_toml, start_gateway};

/// The scenario's name (`keel bench canary-rollback`).
pub const NAME: &str = "canary-rollback";
const USERS: u64 = 2_000;
const RPS: f64 = 25.0;
/// The canary's first step (the weight it rolls back from).
const FIRST_STEP_PERCENT: f64 = 10.0;
const CANARY: &str = "[pools.canary]\ncandidates = [\"candidate\"]\nidentity = \"user\"\nsteps = [10, 25, 50, 100]\ndwell_ms = 5000\nmin_requests = 10\nmax_error_rate = 0.05\n";

/// What one request saw.
struct Seen {
    user: u64,
    status: u16,
    variant: String,
    attempts: u32,
    /// Sent after the rollback was observed.
    after_rollback: bool,
}

/// Runs the scenario; returns its Markdown section (and writes `canary-rollback.json`).
pub async fn run(quick: bool, seed: u64, out: &Path) -> Result<String, String> {
    let server = |name: &str, i: u64| ServerConfig {
        name: name.into(),
        family: "bench".into(),
        seed: Some(seed + i),
        ttft_ms: 20.0,
        gap_ms: 2.0,
        ..Default::default()
    };
    let mut servers: Vec<ServerConfig> =
        (0..3).map(|i| server(&format!("stable-{i}"), i)).collect();
    let mut candidate = server("candidate", 3);
    candidate.faults =
        vec![
            serde_json::from_value(json!({"kind": "error", "status": 500, "rate": 0.3}))
                .map_err(|e| e.to_string())?,
        ];
    servers.push(candidate);
    let fleet = Fleet::start(&FleetConfig {
        generation: Default::default(),
        servers,
    })
    .await
    .map_err(|e| e.to_string())?;
    let pool = pool_toml(
        &fleet,
        "bench",
        "hedge = \"off\"\n[pools.health]\neject_after_ms = 600000",
    );
    let toml = format!("{pool}\n{CANARY}");
    let (addr, stop) = start_gateway(&toml, "canary-rollback").await?;
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let limit = Duration::from_secs_f64(if quick { 15.0 } else { 40.0 });

    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let rolled_back = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let start = tokio::time::Instant::now();
    let watcher = {
        let (client, base, rolled_back) = (client.clone(), base.clone(), rolled_back.clone());
        tokio::spawn(async move {
            loop {
                let phase = match client.get(format!("{base}/keel/health")).send().await {
                    Ok(r) => r
                        .json::<Value>()
                        .await
                        .ok()
                        .map(|d| d["pools"][0]["canary"]["phase"].clone()),
                    Err(_) => None,
                };
                if phase.as_ref().and_then(Value::as_str) == Some("rolled_back") {
                    rolled_back.store(true, std::sync::atomic::Ordering::SeqCst);
                    return Some(start.elapsed());
                }
                if start.elapsed() > limit {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let mut rng = Rng::new(seed);
    let mut tasks = Vec::new();
    let mut after = 0usize;
    for i in 0u64.. {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / RPS)).await;
        let done = rolled_back.load(std::sync::atomic::Ordering::SeqCst);
        // After the rollback, one more second of traffic shows where users go now.
        if done {
            after += 1;
        }
        if after as f64 >= RPS || start.elapsed() > limit {
            break;
        }
        let user = rng.next_u64() % USERS;
        let (client, url, seen) = (
            client.clone(),
            format!("{base}/v1/chat/completions"),
            seen.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": "bench", "user": format!("user-{user}"), "max_tokens": 16,
                "messages": [{"role": "user", "content": format!("question {i}")}]});
            let (status, variant, attempts) = match client.post(url).json(&body).send().await {
                Ok(r) => {
                    let h = |n: &str| {
                        r.headers()
                            .get(n)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_owned()
                    };
                    let (variant, attempts) = (
                        h("x-keel-variant"),
                        h("x-keel-attempts").parse().unwrap_or(0),
                    );
                    let status = r.status().as_u16();
                    let _ = r.bytes().await;
                    (status, variant, attempts)
                }
                Err(_) => (0, String::new(), 0),
            };
            seen.lock().unwrap_or_else(|e| e.into_inner()).push(Seen {
                user,
                status,
                variant,
                attempts,
                after_rollback: done,
            });
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let rollback = watcher.await.map_err(|e| e.to_string())?;
    let health: Value = client
        .get(format!("{base}/keel/health"))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    let _ = stop.send(());
    let canary = health["pools"][0]["canary"].clone();
    let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
    let figures = figures(&seen, rollback, &canary);
    std::fs::write(
        out.join("canary-rollback.json"),
        serde_json::to_string_pretty(&figures).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    Ok(markdown(&figures))
}

fn figures(seen: &[Seen], rollback: Option<Duration>, canary: &Value) -> Value {
    // Users who sent a request before the rollback was seen: the population at risk.
    let users: HashSet<u64> = seen
        .iter()
        .filter(|s| !s.after_rollback)
        .map(|s| s.user)
        .collect();
    let met_candidate = |s: &&Seen| s.variant == "candidate" || s.attempts > 1;
    let exposed: HashSet<u64> = seen.iter().filter(met_candidate).map(|s| s.user).collect();
    let errored: HashSet<u64> = seen
        .iter()
        .filter(|s| s.status != 200)
        .map(|s| s.user)
        .collect();
    let share = |n: usize| n as f64 / users.len().max(1) as f64;
    // The users the first step's weight put on the candidate side by hash, among those who sent
    // a request before the rollback: what the exposure should be.
    let first_bp = (FIRST_STEP_PERCENT * 100.0) as u32;
    let by_hash: HashSet<u64> = seen
        .iter()
        .filter(|s| !s.after_rollback)
        .map(|s| s.user)
        .filter(|u| bucket("bench", format!("user-{u}").as_bytes()) < first_bp)
        .collect();
    json!({
        "requests": seen.len(),
        "users": users.len(),
        "rolled_back": rollback.is_some(),
        "time_to_rollback_ms": rollback.map(|d| d.as_millis() as u64),
        "users_exposed": exposed.len(),
        "users_exposed_share": share(exposed.len()),
        "users_on_candidate_side_by_hash": by_hash.len(),
        "users_with_errors": errored.len(),
        "users_with_errors_share": share(errored.len()),
        "error_statuses": seen.iter().filter(|s| s.status != 200).fold(std::collections::BTreeMap::<u16, u64>::new(), |mut m, s| { *m.entry(s.status).or_default() += 1; m }),
        "requests_failed_over_from_candidate": seen.iter().filter(|s| s.attempts > 1).count(),
        "requests_on_candidate_after_rollback": seen.iter().filter(|s| s.after_rollback).filter(met_candidate).count(),
        "rollback_reason": canary["transitions"].as_array().and_then(|t| t.last()).map(|t| t["reason"].clone()),
        "phase": canary["phase"],
    })
}

fn markdown(f: &Value) -> String {
    let pct = |k: &str| format!("{:.2} %", f[k].as_f64().unwrap_or(0.0) * 100.0);
    format!(
        "### canary-rollback\n\nA candidate failing 30 % of its requests, canary steps 10/25/50/100 %, \
         `max_error_rate = 0.05`, `min_requests = 10`, {RPS} req/s from {USERS} users.\n\n\
         | figure | value |\n|---|---|\n\
         | rolled back | {} |\n| time to rollback | {} ms |\n| users who sent a request before the rollback | {} |\n\
         | users exposed to the candidate | {} ({}) |\n| of them on the candidate side by hash (first step) | {} |\n\
         | users who saw an error | {} ({}) |\n\
         | requests failed over from the candidate | {} |\n| requests on the candidate after the rollback | {} |\n\
         | reason | {} |\n",
        f["rolled_back"],
        f["time_to_rollback_ms"],
        f["users"],
        f["users_exposed"],
        pct("users_exposed_share"),
        f["users_on_candidate_side_by_hash"],
        f["users_with_errors"],
        pct("users_with_errors_share"),
        f["requests_failed_over_from_candidate"],
        f["requests_on_candidate_after_rollback"],
        f["rollback_reason"].as_str().unwrap_or("-"),
    )
}
