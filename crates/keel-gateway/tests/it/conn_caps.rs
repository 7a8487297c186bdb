//! Connection caps (`max_connections`, `max_pending`): a burst of requests at a slow server
//! never opens more connections to it than its variant's cap; the rest wait for one of those
//! connections, fail over to another variant, or wait in the pool's line, and none is lost.

use keel_sim::{Fleet, ServerConfig};
use serde_json::{json, Value};

use crate::harness::*;

/// `n` servers, each taking about `ttft_ms` to answer and running any number at once.
async fn slow_fleet(n: usize, ttft_ms: f64) -> Fleet {
    let cfg = ServerConfig {
        ttft_ms,
        ..ServerConfig::fast("s")
    };
    Fleet::start_n(n, cfg).await.unwrap()
}

/// `n` whole requests sent at once; their statuses.
async fn burst(h: &Harness, n: usize) -> Vec<u16> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (client, url) = (keel_sim::http_client(), h.url("/v1/chat/completions"));
            tokio::spawn(async move {
                let body = json!({"model": "p", "max_tokens": 16,
                                  "messages": [{"role": "user", "content": format!("burst {i}")}]});
                let r = client.post(url).json(&body).send().await.unwrap();
                let status = r.status().as_u16();
                let _: Value = r.json().await.unwrap();
                status
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// `config` with `line` added to the table of its variant `i`.
fn with_variant_line(config: &str, i: usize, line: &str) -> String {
    let mut out = String::new();
    for (k, part) in config.split("[[pools.variants]]").enumerate() {
        if k > 0 {
            out.push_str("[[pools.variants]]");
        }
        out.push_str(part);
        if k == i + 1 {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[tokio::test]
async fn a_burst_at_a_slow_server_opens_no_more_connections_than_the_cap() {
    let fleet = slow_fleet(1, 150.0).await;
    let config = pool_over(
        &fleet,
        "p",
        "openai",
        1,
        "hedge = \"off\"\nqueue_ms = 60000\n",
    );
    let config = with_variant_line(&config, 0, "max_connections = 4");
    let h = Harness::start(fleet, &config).await;
    let statuses = burst(&h, 40).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let stats = h.server(0).state.stats();
    assert_eq!(stats.completed, 40, "{stats:?}");
    assert!(stats.connections_peak <= 4, "{stats:?}");
    // keel's own count: the connections it holds open under the cap (kept for reuse).
    let held = h
        .metric("keel_upstream_connections", &[("variant", "sim-0")])
        .await;
    assert!((1.0..=4.0).contains(&held), "{held}");
}

#[tokio::test]
async fn pending_requests_wait_for_a_connection_and_no_more_are_opened() {
    let fleet = slow_fleet(1, 150.0).await;
    let config = pool_over(
        &fleet,
        "p",
        "openai",
        1,
        "hedge = \"off\"\nqueue_ms = 60000\n",
    );
    // Two connections, and up to six requests admitted to wait for one of them.
    let config = with_variant_line(&config, 0, "max_connections = 2\nmax_pending = 6");
    let h = Harness::start(fleet, &config).await;
    let health = h.get_json("/keel/health").await;
    assert_eq!(health["pools"][0]["variants"][0]["concurrency_limit"], 8);
    let statuses = burst(&h, 24).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let stats = h.server(0).state.stats();
    assert_eq!(stats.completed, 24, "{stats:?}");
    assert!(stats.connections_peak <= 2, "{stats:?}");
}

#[tokio::test]
async fn past_its_cap_a_variant_is_full_and_requests_fail_over() {
    let fleet = slow_fleet(2, 150.0).await;
    // The pool's default caps both; the second raises its own.
    let config = pool_over(
        &fleet,
        "p",
        "openai",
        1,
        "hedge = \"off\"\nqueue_ms = 60000\nmax_connections = 2\n",
    );
    let config = with_variant_line(&config, 1, "max_connections = 6");
    let h = Harness::start(fleet, &config).await;
    let statuses = burst(&h, 32).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let (a, b) = (h.server(0).state.stats(), h.server(1).state.stats());
    assert_eq!(a.completed + b.completed, 32, "{a:?} {b:?}");
    assert!(a.connections_peak <= 2, "{a:?}");
    assert!(b.connections_peak <= 6, "{b:?}");
    // Both served: the burst did not all wait for one variant.
    assert!(a.completed > 0 && b.completed > 0, "{a:?} {b:?}");
}
