//! A pool's shadow state: which requests are sampled, the bounds on copies in flight and per
//! minute, and each shadow variant's comparison summary (`GET /keel/shadow/{pool}`). Sending
//! the copies and comparing their answers is the pipeline's (`pipeline::shadow`).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};

use serde_json::{json, Value};

use keel_core::compare::Summary;
use keel_core::rng::hash_bytes;

use crate::config::ShadowConfig;

/// One pool's shadow variants, their bounds and their summaries.
pub struct Shadow {
    pub(crate) cfg: ShadowConfig,
    pub(crate) in_flight: AtomicU32,
    /// The current minute's start (`now_ms`) and the copies sent in it.
    minute: Mutex<(u64, u32)>,
    /// Per shadow variant, in config order.
    summaries: Mutex<Vec<Summary>>,
}

impl Shadow {
    pub fn new(cfg: Option<&ShadowConfig>) -> Option<Shadow> {
        let cfg = cfg?.clone();
        let n = cfg.variants.len();
        Some(Shadow {
            cfg,
            in_flight: AtomicU32::new(0),
            minute: Mutex::new((0, 0)),
            summaries: Mutex::new(vec![Summary::default(); n]),
        })
    }

    pub(crate) fn summaries(&self) -> MutexGuard<'_, Vec<Summary>> {
        self.summaries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether request `id` is in the sample.
    pub(crate) fn sampled(&self, id: &str) -> bool {
        let b = hash_bytes(0x7368_6164, id.as_bytes()) % 10_000;
        (b as f64) < self.cfg.sample * 10_000.0
    }

    /// Takes one copy's place under both bounds; false when either is reached.
    pub(crate) fn admit(&self, now_ms: u64) -> bool {
        let mut m = self.minute.lock().unwrap_or_else(|e| e.into_inner());
        if now_ms.saturating_sub(m.0) >= 60_000 {
            *m = (now_ms, 0);
        }
        if m.1 >= self.cfg.max_per_minute {
            return false;
        }
        let taken = self.in_flight.fetch_add(1, Ordering::AcqRel);
        if taken >= self.cfg.max_in_flight {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        m.1 += 1;
        true
    }

    /// `GET /keel/shadow/{pool}`.
    pub fn document(&self, pool: &str) -> Value {
        let summaries = self.summaries();
        let variants: Vec<Value> = self
            .cfg
            .variants
            .iter()
            .zip(summaries.iter())
            .map(|(v, s)| {
                json!({
                    "variant": v.name,
                    "compared": s.compared,
                    "failed": s.failed,
                    "skipped": s.skipped,
                    "exact_match_rate": s.exact_rate(),
                    "mean_similarity": s.mean_similarity(),
                    "json_compared": s.json_compared,
                    "mean_json_agreement": s.mean_json_agreement(),
                    "mean_latency_delta_ms": s.mean_latency_delta_ms(),
                    "mean_token_delta": s.mean_token_delta(),
                })
            })
            .collect();
        json!({
            "pool": pool,
            "sample": self.cfg.sample,
            "max_in_flight": self.cfg.max_in_flight,
            "max_per_minute": self.cfg.max_per_minute,
            "in_flight": self.in_flight.load(Ordering::Relaxed),
            "variants": variants,
        })
    }
}
