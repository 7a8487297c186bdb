//! `Store::Redis` against a real `redis-server` (one per test, on a free loopback port):
//! the scripts compute what `keel_core::quota` computes, several replicas together admit no
//! more than the limit, a dead server gives errors rather than hangs, and a vanished replica's
//! slots come back.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_core::quota::budget::Window;

use super::test_server::RedisServer;
use super::*;
use crate::state::quota::Store;

/// The config of a replica of `server` whose keys start with `prefix` (no signals).
fn config_for(server: &RedisServer, prefix: &str) -> RedisConfig {
    RedisConfig {
        url: server.url(),
        ca_pem: None,
        key_prefix: prefix.to_owned(),
        share_signals: false,
        signal_ttl_ms: 5_000,
    }
}

fn replica(server: &RedisServer) -> Redis {
    replica_with(server, Metrics::new())
}

fn replica_with(server: &RedisServer, metrics: Arc<Metrics>) -> Redis {
    let config = config_for(server, "test:");
    Redis::connect(&config, metrics).expect("a valid URL")
}

/// Polls `check` until it holds; fails (instead of hanging) after a generous deadline.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check().await {
        assert!(Instant::now() < deadline, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A decision in microseconds (how the scripts count) as the store reports it, in ns.
fn in_ns(d: Decision) -> Decision {
    match d {
        Decision::Allowed {
            tat,
            remaining,
            reset_after_ns,
        } => Decision::Allowed {
            tat: tat * 1_000,
            remaining,
            reset_after_ns: reset_after_ns * 1_000,
        },
        Decision::Denied {
            retry_after_ns,
            reset_after_ns,
        } => Decision::Denied {
            retry_after_ns: retry_after_ns * 1_000,
            reset_after_ns: reset_after_ns * 1_000,
        },
    }
}

const DAY: BudgetSpec = BudgetSpec {
    unit: BudgetUnit::Tokens,
    window: Window::Day,
    limit: 10_000,
};
/// Noon (UTC) of the day the test runs, in Unix seconds. Budgets expire on Redis's real clock
/// (`grace` after their window ends), so a fixed date would make every reservation vanish once
/// that day is over: the tests' "now" must be today.
fn noon() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_secs();
    now - now % 86_400 + 43_200
}

#[tokio::test]
async fn the_scripts_compute_what_keel_core_computes() {
    let server = RedisServer::start();
    let store = replica(&server);
    // 7 units per 3,000 s, walked with a fake clock through takes of 1–3 units, charges and
    // refunds; keel_core runs the same sequence in microsecond units. (Minutes would do as
    // well, but the stored state expires on Redis's real clock: long periods keep it alive
    // while the test runs, whatever the fake clock says.)
    let rate = Rate {
        limit: 7,
        period_ns: 3_000_000_000_000,
    };
    let in_us = micros(rate);
    let mut tat = 0;
    let mut now: u64 = 1_796_040_000_000_000;
    let (mut admitted, mut refused) = (0, 0);
    for i in 0..400u64 {
        now += (i * 7_919) % 900_000 * 1_000;
        let units = 1 + i % 3;
        match i % 6 {
            4 => {
                tat = gcra::charge(in_us, tat, now, units);
                store
                    .adjust_at(Some(now), "k", Limit::Tokens, rate, units as i64)
                    .await
                    .unwrap();
            }
            5 => {
                tat = gcra::refund(in_us, tat, units);
                store
                    .adjust_at(Some(now), "k", Limit::Tokens, rate, -(units as i64))
                    .await
                    .unwrap();
            }
            _ => {
                let want = gcra::check(in_us, tat, now, units);
                let got = store
                    .take_at(Some(now), "k", Limit::Tokens, rate, units)
                    .await
                    .unwrap();
                assert_eq!(got, in_ns(want), "step {i}");
                match want {
                    Decision::Allowed { tat: t, .. } => {
                        tat = t;
                        admitted += 1;
                    }
                    Decision::Denied { .. } => refused += 1,
                }
            }
        }
    }
    // The walk went through both answers many times.
    assert!(
        admitted > 30 && refused > 30,
        "{admitted} admitted, {refused} refused"
    );
}

#[tokio::test]
async fn the_same_answers_as_the_local_store() {
    let server = RedisServer::start();
    let config = config_for(&server, "keel:");
    let stores = [
        Store::from_config(None, Metrics::new()).unwrap(),
        Store::from_config(Some(&config), Metrics::new()).unwrap(),
    ];
    assert!(matches!(stores, [Store::Local(_), Store::Redis(_)]));
    // Intervals of seconds, so the few milliseconds this takes change no answer.
    let rpm = Rate::per_minute(5);
    let tph = Rate {
        limit: 1_000,
        period_ns: 3_600_000_000_000,
    };
    let mut answers: Vec<Vec<String>> = vec![Vec::new(), Vec::new()];
    for (store, out) in stores.iter().zip(&mut answers) {
        for i in 0..8u64 {
            let d = store
                .take("k", Limit::Requests, rpm, 1 + i % 2)
                .await
                .unwrap();
            let t = store
                .take("k", Limit::Tokens, tph, 150 + 40 * i)
                .await
                .unwrap();
            out.push(format!("{} {}", summary(d), summary(t)));
            if i % 3 == 0 {
                store.adjust("k", Limit::Tokens, tph, -100).await.unwrap();
            }
            let r = store
                .reserve("k", DAY, noon(), 900 + 300 * i)
                .await
                .unwrap();
            out.push(format!("{r:?}"));
            if r.is_ok() && i % 2 == 0 {
                store
                    .settle("k", DAY, noon(), 900 + 300 * i, 500)
                    .await
                    .unwrap();
            }
            let slot = store
                .acquire("k", 3, Duration::from_secs(60))
                .await
                .unwrap();
            out.push(format!("slot {}", slot.is_some()));
            if let Some(held) = slot.filter(|_| i % 4 == 0) {
                store.release(&held).await.unwrap();
            }
        }
        let u = store
            .usage(
                "k",
                &[(Limit::Requests, rpm), (Limit::Tokens, tph)],
                &[DAY],
                noon(),
            )
            .await
            .unwrap();
        let remaining: Vec<u64> = u.rates.iter().map(|r| r.1).collect();
        out.push(format!("{remaining:?} {:?} {}", u.budgets, u.in_flight));
        // The next day starts empty but for what is still in flight.
        let u = store
            .usage("k", &[], &[DAY], noon() + 86_400)
            .await
            .unwrap();
        out.push(format!("{:?}", u.budgets));
    }
    assert_eq!(answers[0], answers[1]);
}

/// Usage reported by an upstream may be absurd (2^64 − 1 tokens): both stores saturate, keep
/// answering, and the key is then out of tokens and budget.
#[tokio::test]
async fn absurd_usage_saturates_in_both_stores() {
    let server = RedisServer::start();
    let config = config_for(&server, "keel:");
    let stores = [
        Store::from_config(None, Metrics::new()).unwrap(),
        Store::from_config(Some(&config), Metrics::new()).unwrap(),
    ];
    let tph = Rate {
        limit: 1_000,
        period_ns: 3_600_000_000_000,
    };
    for store in &stores {
        assert!(matches!(
            store.take("k", Limit::Tokens, tph, 100).await.unwrap(),
            Decision::Allowed { .. }
        ));
        store
            .adjust("k", Limit::Tokens, tph, i64::MAX)
            .await
            .unwrap();
        assert!(matches!(
            store.take("k", Limit::Tokens, tph, 1).await.unwrap(),
            Decision::Denied { .. }
        ));
        store.reserve("k", DAY, noon(), 100).await.unwrap().unwrap();
        store.settle("k", DAY, noon(), 100, u64::MAX).await.unwrap();
        store.settle("k", DAY, noon(), 0, u64::MAX).await.unwrap();
        assert!(store.reserve("k", DAY, noon(), 1).await.unwrap().is_err());
        let u = store
            .usage("k", &[(Limit::Tokens, tph)], &[DAY], noon())
            .await
            .unwrap();
        assert_eq!(u.rates[0].1, 0, "no tokens left");
        assert_eq!((u.budgets[0].1, u.budgets[0].2), (DAY.limit, 0));
    }
}

/// A decision without its times (which depend on each store's clock).
fn summary(d: Decision) -> String {
    match d {
        Decision::Allowed { remaining, .. } => format!("allowed, {remaining} left"),
        Decision::Denied { .. } => "denied".to_owned(),
    }
}

/// Three replicas, twelve tasks each, racing for one key.
async fn race<F, Fut>(server: &RedisServer, attempt: F) -> (u64, u64)
where
    F: Fn(Arc<Redis>, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<u64, StoreError>> + Send,
{
    let admitted = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let r = Arc::new(replica(server));
        for task in 0..12u64 {
            let (r, attempt) = (r.clone(), attempt.clone());
            let (admitted, errors) = (admitted.clone(), errors.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..15 {
                    match attempt(r.clone(), task * 100 + i).await {
                        Ok(n) => admitted.fetch_add(n, Ordering::Relaxed),
                        Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                    };
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    (
        admitted.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_together_admit_no_more_than_the_limit() {
    let server = RedisServer::start();
    // Per hour, so that nothing comes back while the test runs. A call that timed out may
    // or may not have taken its units: it is counted apart.
    let rph = Rate {
        limit: 40,
        period_ns: 3_600_000_000_000,
    };
    let (requests, errors) = race(&server, move |r, _| async move {
        let d = r.take("shared", Limit::Requests, rph, 1).await?;
        Ok(u64::from(matches!(d, Decision::Allowed { .. })))
    })
    .await;
    assert!(requests <= 40 + 3, "{requests} requests admitted for 40");
    assert!(
        requests + errors >= 40,
        "{requests} admitted, {errors} errors"
    );

    let tph = Rate {
        limit: 5_000,
        period_ns: 3_600_000_000_000,
    };
    let (tokens, errors) = race(&server, move |r, i| async move {
        let cost = 1 + i * 37 % 300;
        let d = r.take("shared", Limit::Tokens, tph, cost).await?;
        Ok(if matches!(d, Decision::Allowed { .. }) {
            cost
        } else {
            0
        })
    })
    .await;
    // + one request's worth per replica at most.
    assert!(
        tokens <= 5_000 + 3 * 300,
        "{tokens} tokens admitted for 5,000"
    );
    assert!(
        tokens + errors * 300 >= 5_000 - 300,
        "{tokens} admitted, {errors} errors"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reservations_never_overspend_a_budget() {
    let server = RedisServer::start();
    // Each attempt reserves 100–500 and settles for a little less; what was settled is spent.
    let (spent, _errors) = race(&server, |r, i| async move {
        let amount = 100 + i * 53 % 400;
        if r.reserve("shared", DAY, noon(), amount).await?.is_err() {
            return Ok(0);
        }
        let actual = amount - amount % 7;
        r.settle("shared", DAY, noon(), amount, actual).await?;
        Ok(actual)
    })
    .await;
    assert!(spent <= DAY.limit, "{spent} spent of {}", DAY.limit);
    let u = replica(&server)
        .usage("shared", &[], &[DAY], noon())
        .await
        .unwrap();
    let (_, used, remaining) = u.budgets[0];
    assert!(
        used <= DAY.limit && used >= spent,
        "{used} used, {spent} settled"
    );
    assert_eq!(used + remaining, DAY.limit);
    // 540 attempts of ~300 on 10,000: the budget ran out.
    assert!(remaining < 500, "{remaining} left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_gives_errors_not_hangs_and_the_store_reconnects() {
    let mut server = RedisServer::start();
    let metrics = Metrics::new();
    let store = replica_with(&server, metrics.clone());
    let rpm = Rate::per_minute(1_000);
    store.take("k", Limit::Requests, rpm, 1).await.unwrap();
    let held = store
        .acquire("k", 5, Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();

    server.kill();
    // Every operation answers, with an error. (The outer bound only turns a hang into a
    // failure instead of a stuck test run; the store's own bound is STORE_TIMEOUT.)
    let every_op = async {
        assert!(store.take("k", Limit::Requests, rpm, 1).await.is_err());
        assert!(store.adjust("k", Limit::Requests, rpm, -1).await.is_err());
        assert!(store.reserve("k", DAY, noon(), 1).await.is_err());
        assert!(store.settle("k", DAY, noon(), 1, 1).await.is_err());
        assert!(store.acquire("k", 5, Duration::from_secs(1)).await.is_err());
        assert!(store.release(&held).await.is_err());
        assert!(store
            .usage("k", &[(Limit::Requests, rpm)], &[DAY], noon())
            .await
            .is_err());
    };
    tokio::time::timeout(Duration::from_secs(60), every_op)
        .await
        .expect("a store call hung while redis-server was down");
    let text = metrics.render();
    for op in [
        "take", "adjust", "reserve", "settle", "acquire", "release", "usage",
    ] {
        assert!(
            text.contains(&format!("keel_quota_store_errors_total{{op=\"{op}\"}} ")),
            "{op} not counted:\n{text}"
        );
    }

    // Back (empty: nothing was saved): the connection comes back by itself, scripts included.
    server.restart();
    eventually("the store works again", || async {
        store.take("k", Limit::Requests, rpm, 1).await.is_ok()
    })
    .await;
    assert_eq!(store.reserve("k", DAY, noon(), 1).await.unwrap(), Ok(()));
    assert!(store
        .acquire("k", 5, Duration::from_secs(1))
        .await
        .unwrap()
        .is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slots_of_a_vanished_replica_come_back_after_their_ttl() {
    let server = RedisServer::start();
    let ttl = Duration::from_millis(300);
    let gone = replica(&server);
    let stays = replica(&server);
    assert!(gone.acquire("k", 2, ttl).await.unwrap().is_some());
    assert!(gone.acquire("k", 2, ttl).await.unwrap().is_some());
    assert!(stays.acquire("k", 2, ttl).await.unwrap().is_none());
    // Dropped without releasing, as a crashed replica would.
    drop(gone);
    eventually("a slot came back", || async {
        stays.acquire("k", 2, ttl).await.unwrap().is_some()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_slot_is_renewed_until_released() {
    let server = RedisServer::start();
    let ttl = Duration::from_millis(600);
    let a = replica(&server);
    let b = replica(&server);
    let held = a.acquire("k", 1, ttl).await.unwrap().unwrap();
    // Several TTLs later the slot is still held (a long stream keeps it)…
    tokio::time::sleep(ttl * 4).await;
    assert!(b.acquire("k", 1, ttl).await.unwrap().is_none());
    assert_eq!(b.usage("k", &[], &[], noon()).await.unwrap().in_flight, 1);
    // …and free as soon as it is released.
    a.release(&held).await.unwrap();
    assert!(b.acquire("k", 1, ttl).await.unwrap().is_some());
}

#[tokio::test]
async fn replicas_share_a_keys_quota_through_redis_over_tls() {
    let server = RedisServer::start_tls();
    let config = RedisConfig {
        ca_pem: server.ca_pem(),
        ..config_for(&server, "keel:")
    };
    assert!(config.url.starts_with("rediss://"));
    let replicas = [
        Store::from_config(Some(&config), Metrics::new()).unwrap(),
        Store::from_config(Some(&config), Metrics::new()).unwrap(),
    ];
    // 5 requests an hour for one key, taken in turns by two replicas: 5 admitted in all.
    let rph = Rate {
        limit: 5,
        period_ns: 3_600_000_000_000,
    };
    // Connected first, on another key: a TLS connection (handshake, trust store) can take
    // longer than one call's 50 ms bound, and its first calls fail until it is up.
    for r in &replicas {
        eventually("the replica is connected", || async {
            r.take("warm-up", Limit::Requests, rph, 1).await.is_ok()
        })
        .await;
    }
    let mut answers = Vec::new();
    for i in 0..8 {
        let d = replicas[i % 2]
            .take("k", Limit::Requests, rph, 1)
            .await
            .unwrap_or_else(|e| panic!("the TLS server answers: {e:?}"));
        answers.push(summary(d));
    }
    assert_eq!(
        answers,
        [
            "allowed, 4 left",
            "allowed, 3 left",
            "allowed, 2 left",
            "allowed, 1 left",
            "allowed, 0 left",
            "denied",
            "denied",
            "denied"
        ]
    );
    // Without the CA, the server's certificate is not trusted (verification stays on).
    let untrusted = RedisConfig {
        ca_pem: None,
        ..config
    };
    let store = Store::from_config(Some(&untrusted), Metrics::new()).unwrap();
    assert!(store.take("k", Limit::Requests, rph, 1).await.is_err());
}
