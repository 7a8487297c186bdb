//! `keel bench cache`: repeated deterministic requests through the response cache.
//!
//! A sequence of streamed `temperature: 0` chat requests in which a share (default 40%) repeat
//! an earlier question, written with a trivial formatting difference most of the time (doubled
//! spaces, curly quotes, a zero-width space, CRLF line ends, trailing blanks) or verbatim. The
//! same sequence runs against three fresh gateways over identical simulated fleets: no cache,
//! the cache with normalization `off`, and the cache with normalization `syntax`. Reported:
//! upstream requests (and the share saved against no cache), the hit rate among the repeats,
//! and the client-side time to first token of hits and of misses (P50/P99).

use std::time::Instant;

use futures_util::StreamExt;
use serde_json::json;

use keel_core::rng::Rng;
use keel_sim::{Fleet, ServerConfig};

/// What one run measured.
struct Run {
    label: &'static str,
    upstream: u64,
    hits: usize,
    repeats: usize,
    ttft_hit_ms: Vec<f64>,
    ttft_miss_ms: Vec<f64>,
}

/// The trivial rewrites a repeated question may get (index 0: verbatim).
fn reformat(text: &str, how: usize) -> String {
    match how {
        0 => text.to_owned(),
        1 => text.replacen(' ', "  ", 2),
        2 => text
            .replacen('"', "\u{201c}", 1)
            .replacen('"', "\u{201d}", 1),
        3 => format!("{}\u{200b}", text.replacen(' ', " \u{200b}", 1)),
        4 => format!("{}   \r\n", text.replace('\n', "\r\n")),
        _ => format!("  {text}\n\n\n"),
    }
}

/// The request sequence: (prompt, index of the question it repeats, if any).
fn sequence(n: usize, repeat_share: f64, seed: u64) -> Vec<(String, Option<usize>)> {
    let mut rng = Rng::new(seed);
    let topics = [
        "rivers",
        "volcanoes",
        "the moon",
        "bread",
        "glaciers",
        "bees",
        "tides",
        "salt",
    ];
    let mut asked: Vec<String> = Vec::new();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if !asked.is_empty() && rng.next_f64() < repeat_share {
            let q = (rng.next_f64() * asked.len() as f64) as usize % asked.len();
            let how = (rng.next_f64() * 6.0) as usize;
            out.push((reformat(&asked[q], how), Some(q)));
        } else {
            let topic = topics[i % topics.len()];
            let q = format!("Question {i}: tell me three facts about \"{topic}\".\nKeep it short.");
            asked.push(q.clone());
            out.push((q, None));
        }
    }
    out
}

/// One streamed request: time to the first content and the `x-keel-cache` answer.
async fn one(client: &reqwest::Client, url: &str, prompt: &str) -> Result<(f64, bool), String> {
    let body = json!({"model": "p", "stream": true, "temperature": 0, "max_tokens": 32,
        "messages": [{"role": "user", "content": prompt}]});
    let started = Instant::now();
    let resp = client
        .post(url)
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    if resp.status() != 200 {
        return Err(format!("status {}", resp.status()));
    }
    let hit = resp
        .headers()
        .get("x-keel-cache")
        .is_some_and(|v| v.as_bytes() == b"hit");
    let mut ttft = None;
    let mut stream = resp.bytes_stream();
    while let Some(c) = stream.next().await {
        let c = c.map_err(|e| format!("broken: {e}"))?;
        if ttft.is_none() && String::from_utf8_lossy(&c).contains("\"content\"") {
            ttft = Some(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    Ok((
        ttft.unwrap_or_else(|| started.elapsed().as_secs_f64() * 1000.0),
        hit,
    ))
}

async fn run_one(
    label: &'static str,
    pool_extra: &str,
    seq: &[(String, Option<usize>)],
    concurrency: usize,
) -> Result<Run, String> {
    let servers = (0..2)
        .map(|i| ServerConfig {
            name: format!("v{i}"),
            ttft_ms: 80.0,
            ttft_sigma: 0.0,
            gap_ms: 8.0,
            gap_sigma: 0.0,
            seed: Some(1 + i as u64),
            ..Default::default()
        })
        .collect();
    let fleet = Fleet::start(&keel_sim::FleetConfig {
        servers,
        ..Default::default()
    })
    .await
    .map_err(|e| e.to_string())?;
    let extra = format!(
        "hedge = \"off\"\n{pool_extra}\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n"
    );
    let toml = super::pool_toml(&fleet, "p", &extra);
    let (addr, stop) = super::start_gateway(&toml, "<bench cache>").await?;
    let url = format!("http://{addr}/v1/chat/completions");
    let client = keel_sim::http_client();
    let mut run = Run {
        label,
        upstream: 0,
        hits: 0,
        repeats: seq.iter().filter(|s| s.1.is_some()).count(),
        ttft_hit_ms: Vec::new(),
        ttft_miss_ms: Vec::new(),
    };
    // In order, `concurrency` at a time: a repeat usually finds its original finished.
    for chunk in seq.chunks(concurrency.max(1)) {
        let tasks: Vec<_> = chunk
            .iter()
            .map(|(prompt, _)| {
                let (client, url, prompt) = (client.clone(), url.clone(), prompt.clone());
                tokio::spawn(async move { one(&client, &url, &prompt).await })
            })
            .collect();
        for t in tasks {
            let (ttft, hit) = t.await.map_err(|e| e.to_string())??;
            if hit {
                run.hits += 1;
                run.ttft_hit_ms.push(ttft);
            } else {
                run.ttft_miss_ms.push(ttft);
            }
        }
    }
    run.upstream = fleet.servers.iter().map(|s| s.state.stats().requests).sum();
    drop(stop);
    Ok(run)
}

fn pct(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[((v.len() - 1) as f64 * q).round() as usize])
}

fn ms(v: Option<f64>) -> String {
    v.map_or("–".into(), |x| format!("{x:.1}"))
}

/// `keel bench cache`.
pub async fn run(
    requests: usize,
    repeat_share: f64,
    concurrency: usize,
    seed: u64,
) -> Result<(), String> {
    let seq = sequence(requests, repeat_share, seed);
    let repeats = seq.iter().filter(|s| s.1.is_some()).count();
    println!(
        "keel bench cache: {requests} streamed temperature-0 requests ({repeats} repeat an earlier question, most with a trivial formatting difference), {concurrency} at a time, 2 simulated variants (TTFT 80 ms, 8 ms/token, 32 tokens)\n"
    );
    let mut runs = Vec::new();
    for (label, extra) in [
        ("no cache", ""),
        (
            "cache, normalize off",
            "normalize = \"off\"\n[pools.cache]\n",
        ),
        (
            "cache, normalize syntax",
            "normalize = \"syntax\"\n[pools.cache]\n",
        ),
    ] {
        runs.push(run_one(label, extra, &seq, concurrency).await?);
    }
    let base = runs[0].upstream.max(1) as f64;
    println!("| run | upstream requests | saved | hit rate of repeats | TTFT hit P50 / P99 ms | TTFT miss P50 / P99 ms |");
    println!("|---|---|---|---|---|---|");
    for r in &mut runs {
        let saved = 100.0 * (1.0 - r.upstream as f64 / base);
        let rate = 100.0 * r.hits as f64 / r.repeats.max(1) as f64;
        println!(
            "| {} | {} | {saved:.0}% | {rate:.0}% ({}/{}) | {} / {} | {} / {} |",
            r.label,
            r.upstream,
            r.hits,
            r.repeats,
            ms(pct(&mut r.ttft_hit_ms, 0.5)),
            ms(pct(&mut r.ttft_hit_ms, 0.99)),
            ms(pct(&mut r.ttft_miss_ms, 0.5)),
            ms(pct(&mut r.ttft_miss_ms, 0.99)),
        );
    }
    // A cache that saves nothing on verbatim repeats is broken: say so in the exit status.
    if runs[2].hits == 0 && repeats > 0 {
        return Err("the cache answered no repeat".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_repeats_the_asked_share_and_the_rewrites_are_trivial() {
        let seq = sequence(1000, 0.4, 7);
        let repeats = seq.iter().filter(|s| s.1.is_some()).count();
        assert!((330..470).contains(&repeats), "{repeats}");
        let original = "Question 1: tell me \"x\".\nKeep it short.";
        let canon = |s: &str| {
            let mut body = serde_json::Map::new();
            body.insert("messages".into(), json!([{"role": "user", "content": s}]));
            keel_core::normalize::normalize_request(
                keel_core::protocol::Endpoint::ChatCompletions,
                &mut body,
                keel_core::normalize::Mode::Syntax,
                &keel_core::normalize::FullConfig::default(),
            );
            body["messages"][0]["content"].as_str().unwrap().to_owned()
        };
        for how in 0..6 {
            let r = reformat(original, how);
            assert_eq!(canon(&r), canon(original), "rewrite {how}: {r:?}");
        }
    }
}
