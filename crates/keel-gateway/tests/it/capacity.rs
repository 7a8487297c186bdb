//! Capacity: a variant that answers 429 while full gets a learned concurrency limit instead of
//! a cooldown, and requests beyond it wait in the pool's line (or are refused at once with the
//! expected wait as retry-after) instead of being sent to be refused upstream.

use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};

use crate::harness::*;

/// One server running at most 2 streams and queueing none: the third concurrent gets a 429.
async fn two_slot_fleet(retry_after_s: f64) -> Fleet {
    let cfg = ServerConfig {
        capacity: 2,
        max_waiting: Some(0),
        retry_after_s,
        gap_ms: 15.0,
        ..ServerConfig::fast("s")
    };
    Fleet::start_n(1, cfg).await.unwrap()
}

fn long_stream() -> Value {
    // At least 16 tokens (the simulator's shortest reply) 15 ms apart.
    json!({"model": "p", "stream": true, "max_tokens": 24,
           "messages": [{"role": "user", "content": "keep this slot busy for a while"}]})
}

/// `n` streams started 20 ms apart (each outlives the start of the others).
async fn run_concurrently(h: &Harness, n: usize) -> Vec<(u16, Option<String>)> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (client, url) = (reqwest::Client::new(), h.url("/v1/chat/completions"));
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_millis(20 * i as u64)).await;
                let resp = client.post(url).json(&long_stream()).send().await.unwrap();
                let status = resp.status().as_u16();
                let retry = resp
                    .headers()
                    .get("retry-after-ms")
                    .map(|v| v.to_str().unwrap().to_owned());
                let _ = resp.bytes().await;
                (status, retry)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

async fn learned_limit(h: &Harness) -> Option<u64> {
    let health = h.get_json("/keel/health").await;

    health["pools"][0]["variants"][0]["concurrency_limit"].as_u64()
}

#[tokio::test]
async fn a_full_variant_gets_a_limit_and_the_excess_waits_in_line() {
    let fleet = two_slot_fleet(1.0).await;
    let cfg = pool_over(&fleet, "p", "openai", 1, "hedge = \"off\"");
    let h = Harness::start(fleet, &cfg).await;
    // Three at once: the upstream refuses the third with 429 while two run.
    run_concurrently(&h, 3).await;
    assert_eq!(learned_limit(&h).await, Some(2));
    let errors_before = h.server(0).state.stats().errors;
    // Now five at once: two run, three wait in keel's line; all succeed. The upstream may still
    // refuse a request sent the instant keel saw a stream end (its slot is freed a moment
    // later), but fewer than the three it would refuse with nothing holding them back.
    let results = run_concurrently(&h, 5).await;
    assert!(results.iter().all(|(s, _)| *s == 200), "{results:?}");
    let refused = h.server(0).state.stats().errors - errors_before;
    assert!(refused < 3, "{refused} refused upstream");
    assert!(h.metrics().await.contains("keel_queue_wait_seconds"));
}

#[tokio::test]
async fn without_room_in_line_the_excess_is_refused_with_the_expected_wait() {
    let fleet = two_slot_fleet(1.0).await;
    let cfg = pool_over(&fleet, "p", "openai", 1, "hedge = \"off\"\nqueue_ms = 0");
    let h = Harness::start(fleet, &cfg).await;
    run_concurrently(&h, 3).await;
    assert_eq!(learned_limit(&h).await, Some(2));
    let results = run_concurrently(&h, 3).await;
    let refused: Vec<_> = results.iter().filter(|(s, _)| *s != 200).collect();
    assert_eq!(refused.len(), 1, "{results:?}");
    let (status, retry) = refused[0];
    assert_eq!(*status, 503);
    // Little's law over what was measured: about one stream's duration (16–24 tokens × 15 ms)
    // divided by the two slots, never zero or absent.
    let ms: u64 = retry.as_deref().expect("retry-after-ms").parse().unwrap();
    assert!((50..=2000).contains(&ms), "retry-after-ms {ms}");
}

#[tokio::test]
async fn a_429_asking_for_a_long_wait_is_a_quota_and_cools_the_variant_down() {
    let fleet = two_slot_fleet(30.0).await;
    let cfg = pool_over(&fleet, "p", "openai", 1, "hedge = \"off\"");
    let h = Harness::start(fleet, &cfg).await;
    run_concurrently(&h, 3).await;
    let health = h.get_json("/keel/health").await;
    let v = &health["pools"][0]["variants"][0];
    // A quota, not a full variant: no learned limit. Earned by a client's request, it holds
    // the variant out for a second at most until keel's own request confirms it (here the
    // server has room again by then: not confirmed).
    assert!(v["concurrency_limit"].is_null(), "{v}");
    let cooldown = v["cooldown_ms"].as_u64().unwrap();
    assert!(cooldown <= 1000, "{v}");
    wait_for!(
        "keel's own request to check the long retry-after",
        h.metric("keel_maintenance_requests_total", &[("kind", "confirm")])
            .await
            >= 1.0
    );
}
