//! Runtime state of pools and variants, and stage 1 (selection) as the gateway drives it: the
//! pure policy from `keel_core::selection` fed with live availability, concurrency limits and
//! context-window fit.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use keel_core::protocol::Protocol;
use keel_core::request::CanonicalRequest;
use keel_core::selection::{Availability, Candidate, Selector, WeightedRoundRobin};

use crate::config::{PoolConfig, VariantConfig};

/// One variant at run time.
#[derive(Debug)]
pub struct Variant {
    pub cfg: VariantConfig,
    pub in_flight: AtomicU32,
}

struct PoolState {
    selector: Box<dyn Selector>,
    availability: Vec<Availability>,
}

/// One pool at run time.
pub struct Pool {
    pub cfg: PoolConfig,
    pub protocol: Protocol,
    pub variants: Vec<Variant>,
    /// Upstream HTTP client (connection pool) with this pool's connect timeout.
    pub client: reqwest::Client,
    state: Mutex<PoolState>,
}

/// What selection produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Variant indexes in order: primary first.
    Plan(Vec<usize>),
    /// Every variant is cooling down (or at its concurrency limit); retry after this long.
    Unavailable { retry_after_ms: u64 },
    /// The request does not fit any variant's context window.
    TooLong { needed: u64, largest: u64 },
    /// `x-keel-force-variant` named no variant of this pool.
    NoSuchVariant(String),
}

/// Decrements a variant's in-flight count when dropped (also when a stream is cancelled).
pub struct InFlight {
    pool: Arc<Pool>,
    index: usize,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.pool.variants[self.index].in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Pool {
    pub fn new(cfg: PoolConfig, client: reqwest::Client) -> Self {
        let variants: Vec<Variant> = cfg.variants.iter().map(|v| Variant { cfg: v.clone(), in_flight: AtomicU32::new(0) }).collect();
        let protocol = cfg.variants[0].protocol;
        let n = variants.len();
        Pool {
            cfg,
            protocol,
            variants,
            client,
            state: Mutex::new(PoolState { selector: Box::new(WeightedRoundRobin::new()), availability: vec![Availability::default(); n] }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // The state is plain data updated in one step; a poisoned lock still holds valid data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stage 1: an ordered plan for this request.
    pub fn select(&self, now_ms: u64, req: &CanonicalRequest, force: Option<&str>) -> Selection {
        if let Some(name) = force {
            return match self.variants.iter().position(|v| v.cfg.name == name) {
                Some(i) => Selection::Plan(vec![i]),
                None => Selection::NoSuchVariant(name.to_owned()),
            };
        }
        let needed = req.estimated_input_tokens + req.max_tokens.unwrap_or(0);
        let fits = |v: &Variant| v.cfg.context_window.is_none_or(|w| needed <= w);
        if !self.variants.iter().any(fits) {
            let largest = self.variants.iter().filter_map(|v| v.cfg.context_window).max().unwrap_or(0);
            return Selection::TooLong { needed, largest };
        }
        let mut st = self.state();
        let candidates: Vec<Candidate> = self
            .variants
            .iter()
            .enumerate()
            .map(|(i, v)| Candidate {
                index: i,
                weight: v.cfg.weight,
                available: fits(v)
                    && st.availability[i].available(now_ms)
                    && v.cfg.max_concurrency.is_none_or(|m| v.in_flight.load(Ordering::Relaxed) < m),
            })
            .collect();
        let plan = st.selector.plan(&candidates);
        if plan.order.is_empty() {
            let wait = st.availability.iter().map(|a| a.available_in_ms(now_ms)).filter(|ms| *ms > 0).min().unwrap_or(1000);
            return Selection::Unavailable { retry_after_ms: wait };
        }
        Selection::Plan(plan.order)
    }

    /// Whether a variant may be tried now (re-checked before every attempt).
    pub fn available(&self, index: usize, now_ms: u64) -> bool {
        self.state().availability[index].available(now_ms)
    }

    pub fn cool_down(&self, index: usize, now_ms: u64, for_ms: u64) {
        self.state().availability[index].cool_down(now_ms, for_ms);
    }

    pub fn mark_credential_broken(&self, index: usize, now_ms: u64) {
        // Re-check a refused credential once a minute: keys get rotated back in.
        self.state().availability[index].mark_credential_broken(now_ms, 60_000);
    }

    pub fn record_success(&self, index: usize) {
        self.state().availability[index].record_success();
    }

    pub fn availability(&self, index: usize) -> Availability {
        self.state().availability[index]
    }

    /// Counts a request on a variant until the guard drops.
    pub fn enter(self: &Arc<Self>, index: usize) -> InFlight {
        self.variants[index].in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight { pool: self.clone(), index }
    }
}
