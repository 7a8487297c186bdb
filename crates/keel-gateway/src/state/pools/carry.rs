//! What a pool of a new config generation takes over from the pool of the same name it
//! replaces:
//!
//! * a pool whose definition did not change is the same pool (the same `Arc`): every piece of
//!   its live state, its wait line included, goes on as if nothing happened;
//! * a changed pool is built anew, and each variant whose definition did not change takes over
//!   the old one's live state: health (state, estimates, ejection), cooldown and credential
//!   state, readiness, the learned resume mode, and, shared rather than copied, its in-flight
//!   count and learned concurrency limit (so requests still running on the old generation
//!   count against the same limit). New or redefined variants start as at startup (warming,
//!   slow start). Health outcomes of requests that started before the reload land in the old
//!   generation's copy;
//! * a removed pool or variant is no longer chosen; the old generation keeps it for the
//!   requests already on it until they end.

use std::sync::Arc;

use crate::config::PoolConfig;

use super::{Pool, UpstreamLimits};

/// The run-time pool for `cfg`: `old` itself when nothing about it changed, else `fresh()`
/// with the live state of `old`'s unchanged variants.
pub(crate) fn carried(
    old: Option<&Arc<Pool>>,
    cfg: &PoolConfig,
    limits: UpstreamLimits,
    fresh: impl FnOnce() -> Pool,
) -> Arc<Pool> {
    match old {
        Some(old) if old.cfg == *cfg && old.limits == limits => old.clone(),
        Some(old) => {
            let mut pool = fresh();
            inherit(&mut pool, old);
            Arc::new(pool)
        }
        None => Arc::new(fresh()),
    }
}

/// Hands the live state of `old`'s unchanged variants to `new` (same pool name).
fn inherit(new: &mut Pool, old: &Pool) {
    if new.cfg.safe_mode == old.cfg.safe_mode {
        // Safe mode (an operator's order included) and the colour's signal window.
        new.safety = old.safety.clone();
    }
    // Pairs (new index, old index) of variants defined the same way (names are unique in a
    // pool, so an equal definition is the same variant).
    let same: Vec<(usize, usize)> = new
        .variants
        .iter()
        .enumerate()
        .filter_map(|(i, v)| {
            let j = old.variants.iter().position(|o| o.cfg == v.cfg)?;
            Some((i, j))
        })
        .collect();
    for &(i, j) in &same {
        let (v, o) = (&mut new.variants[i], &old.variants[j]);
        v.in_flight = o.in_flight.clone();
        v.limit = o.limit.clone();
        if o.resume_learned() {
            v.learn_instruction();
        }
    }
    // The pool's recent TTFTs: the hedge delay's fallback and the median of unmeasured variants.
    new.inherit_ttft(old);
    for (i, j) in same {
        let from = old.variant_state(j).clone();
        new.update(i, |to| {
            // A probe or warm-up of the old generation ends there: the new one starts its own.
            let busy = to.maintenance_busy;
            *to = from;
            to.maintenance_busy = busy;
        });
    }
}
