//! The signals task: publishes this replica's findings and applies the others' (see the module
//! above for what and why). Two tasks: the subscription (connect, subscribe, forward parsed
//! messages; reconnect with backoff when the connection is lost), and the main loop (every
//! [`TICK`]: publish what changed, lift lapsed caps; on each message: apply it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ::redis::aio::ConnectionManager;
use ::redis::Client;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{news, pool_named, Caps, Kind, Said, Signal, TICK};
use crate::config::{redact_url, RedisConfig};
use crate::observe::metrics::Metrics;
use crate::state::pools::Pool;
use crate::state::quota::redis::connect_lazily;

/// Waits between subscription attempts: doubled after each failure, from the first to the last.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));
/// A connection or a publish must finish within this.
const REDIS_TIMEOUT: Duration = Duration::from_secs(1);
/// At most one warning per this, however many failures.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// What the signals task reads of one generation of the config.
pub struct Generation {
    pub pools: Vec<Arc<Pool>>,
    pub redis: Option<RedisConfig>,
    pub metrics: Arc<Metrics>,
    /// The generation's clock (see `Gateway::now_ms`).
    pub epoch: Instant,
}

impl Generation {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

/// Starts sharing signals when `[redis]` is configured with `share_signals` (else `None`).
/// Aborting the handle ends the subscription too.
pub fn spawn(gen: Generation) -> Option<JoinHandle<()>> {
    let cfg = gen.redis.clone().filter(|r| r.share_signals)?;
    let (client, conn) = match connect_lazily(&cfg) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "[redis] unusable: signals are not shared");
            return None;
        }
    };
    let link = Link {
        channel: format!("{}signals", cfg.key_prefix),
        replica: replica_id(),
        ttl_ms: cfg.signal_ttl_ms,
        conn,
        metrics: gen.metrics.clone(),
    };
    tracing::info!(channel = %link.channel, replica = %link.replica, ttl_ms = link.ttl_ms, "sharing variant signals through Redis");
    let (tx, rx) = mpsc::channel(1024);
    let subscription = tokio::spawn(subscribe(client, cfg, link.channel.clone(), tx));
    Some(tokio::spawn(async move {
        let _subscription = AbortOnDrop(subscription);
        link.run(gen, rx).await
    }))
}

/// Ends a task when dropped (the main loop's end, or its abort, ends the subscription).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A random id for this process: what a replica recognises its own messages by. One per
/// process, not per task: the task restarts with each config generation (see `live`), and a
/// new id would make this replica take its own earlier messages for another's.
fn replica_id() -> String {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let mut bytes = [0u8; 8];
        if getrandom::fill(&mut bytes).is_err() {
            // No randomness: the pid and the clock still tell replicas apart in practice.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            bytes = (t ^ u64::from(std::process::id()) << 32).to_le_bytes();
        }
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    })
    .clone()
}

struct Link {
    channel: String,
    replica: String,
    ttl_ms: u64,
    conn: ConnectionManager,
    metrics: Arc<Metrics>,
}

impl Link {
    async fn run(self, gen: Generation, mut rx: mpsc::Receiver<Signal>) {
        let mut said: HashMap<(String, String), Said> = HashMap::new();
        let mut caps = Caps::default();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    self.publish_news(&gen, &mut said);
                    lift_lapsed(&gen, &mut caps);
                }
                Some(s) = rx.recv() => self.apply(&gen, &mut caps, s),
            }
        }
    }

    /// Publishes what changed in this replica's own findings since the last tick.
    fn publish_news(&self, gen: &Generation, said: &mut HashMap<(String, String), Said>) {
        for pool in &gen.pools {
            let now = pool.now_ms();
            for (i, v) in pool.variants.iter().enumerate() {
                let key = (pool.cfg.name.clone(), v.cfg.name.clone());
                let found = pool.findings(i);
                for (kind, for_ms, limit) in
                    news(said.entry(key).or_default(), found, now, self.ttl_ms)
                {
                    let s = Signal {
                        replica: self.replica.clone(),
                        pool: pool.cfg.name.clone(),
                        variant: v.cfg.name.clone(),
                        kind,
                        for_ms,
                        limit,
                        ttl_ms: self.ttl_ms,
                    };
                    tracing::debug!(pool = %s.pool, variant = %s.variant, kind = kind.as_str(), "publishing signal");
                    tokio::spawn(publish(
                        self.conn.clone(),
                        self.channel.clone(),
                        s,
                        self.metrics.clone(),
                    ));
                }
            }
        }
    }

    /// Applies another replica's signal (see the merge rule in the module docs).
    fn apply(&self, gen: &Generation, caps: &mut Caps, s: Signal) {
        if s.replica == self.replica {
            return;
        }
        let Some((pool, i)) =
            pool_named(&gen.pools, &s.pool).and_then(|p| Some((p, p.variant_index(&s.variant)?)))
        else {
            // Another config (a rollout in progress): nothing here to apply it to.
            tracing::debug!(pool = %s.pool, variant = %s.variant, "signal for an unknown variant ignored");
            return;
        };
        match s.kind {
            Kind::Limit => {
                let Some(cap) = caps.merge(&s, gen.now_ms(), self.ttl_ms) else {
                    return;
                };
                pool.variants[i].limit.set_shared(Some(cap));
            }
            _ => pool.apply_shared(i, &s, self.ttl_ms),
        }
        tracing::debug!(pool = %s.pool, variant = %s.variant, kind = s.kind.as_str(), from = %s.replica, "applied another replica's signal");
        self.metrics
            .counter("keel_signals_applied_total", &[("kind", s.kind.as_str())])
            .increment(1);
    }
}

/// Lifts the shared concurrency caps whose signal lapsed.
fn lift_lapsed(gen: &Generation, caps: &mut Caps) {
    for (pool, variant) in caps.lapsed(gen.now_ms()) {
        if let Some((p, i)) =
            pool_named(&gen.pools, &pool).and_then(|p| Some((p, p.variant_index(&variant)?)))
        {
            p.variants[i].limit.set_shared(None);
        }
    }
}

/// Sends one signal; a failure is logged (Redis down only means the others learn for
/// themselves).
async fn publish(mut conn: ConnectionManager, channel: String, s: Signal, metrics: Arc<Metrics>) {
    let Ok(payload) = serde_json::to_string(&s) else {
        return;
    };
    let sent = tokio::time::timeout(
        REDIS_TIMEOUT,
        ::redis::cmd("PUBLISH")
            .arg(&channel)
            .arg(payload)
            .query_async::<i64>(&mut conn),
    )
    .await;
    match sent {
        Ok(Ok(_)) => metrics
            .counter("keel_signals_published_total", &[("kind", s.kind.as_str())])
            .increment(1),
        Ok(Err(e)) => tracing::debug!(error = %e, "signal not published"),
        Err(_) => tracing::debug!("signal not published: Redis did not answer within 1 s"),
    }
}

/// Subscribes to the channel and forwards every valid signal; reconnects with backoff until
/// aborted.
async fn subscribe(client: Client, cfg: RedisConfig, channel: String, tx: mpsc::Sender<Signal>) {
    let mut wait = BACKOFF.0;
    let mut warned: Option<Instant> = None;
    loop {
        let subscribed = tokio::time::timeout(REDIS_TIMEOUT, async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, ::redis::RedisError>(pubsub.into_on_message())
        })
        .await;
        let problem = match subscribed {
            Ok(Ok(mut messages)) => {
                tracing::info!(channel = %channel, "subscribed to variant signals");
                wait = BACKOFF.0;
                while let Some(msg) = messages.next().await {
                    match serde_json::from_slice::<Signal>(msg.get_payload_bytes()) {
                        Ok(s) => {
                            if tx.send(s).await.is_err() {
                                return;
                            }
                        }
                        // Another version's message, or something else on the channel.
                        Err(e) => tracing::debug!(error = %e, "unreadable signal ignored"),
                    }
                }
                "connection lost".to_owned()
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer within 1 s".to_owned(),
        };
        if warned.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            warned = Some(Instant::now());
            tracing::warn!(redis = %redact_url(&cfg.url), problem = %problem, "variant signals: subscription down, retrying (each replica learns alone meanwhile)");
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(BACKOFF.1);
    }
}
