//! What a new config generation takes over from the one it replaces.
//!
//! Process-wide state is always carried (metrics, test hooks, the events hub, the drain state);
//! state tied to a section of the config is carried while that section is unchanged (the quota
//! store with `[redis]`, the access log with `[log]`, the trace exporter with `[telemetry]`,
//! the decision ring with `decisions_kept`). Pools:
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

use serde_json::{json, Value};

use crate::config::{Config, PoolConfig};
use crate::observe::access_log::AccessLog;
use crate::observe::decisions::DecisionLog;
use crate::state::pools::{Pool, UpstreamLimits};
use crate::{admin::events, hooks, observe::telemetry, state::quota, Gateway};

use super::Process;

/// The gateway-wide state a generation takes over (`None`: build it from the new config).
pub(crate) struct Lasting {
    pub(crate) quota: Option<Arc<quota::Store>>,
    pub(crate) access_log: Option<Arc<AccessLog>>,
    pub(crate) telemetry: Option<Arc<telemetry::Telemetry>>,
    pub(crate) decisions: Option<Arc<DecisionLog>>,
    pub(crate) hooks: Arc<hooks::TestHooks>,
    pub(crate) events: Arc<events::Hub>,
    pub(crate) process: Arc<Process>,
}

impl Lasting {
    pub(crate) fn from(prev: Option<&Gateway>, cfg: &Config) -> Lasting {
        let Some(g) = prev else {
            return Lasting {
                quota: None,
                access_log: None,
                telemetry: None,
                decisions: None,
                hooks: Arc::default(),
                events: Arc::default(),
                process: Arc::default(),
            };
        };
        let keep = |unchanged: bool| unchanged.then_some(());
        Lasting {
            quota: keep(g.cfg.redis == cfg.redis).map(|_| g.quota.clone()),
            access_log: keep(g.cfg.log == cfg.log).map(|_| g.access_log.clone()),
            telemetry: keep(g.cfg.telemetry == cfg.telemetry).map(|_| g.telemetry.clone()),
            decisions: keep(g.cfg.decisions_kept == cfg.decisions_kept)
                .map(|_| g.decisions.clone()),
            hooks: g.hooks.clone(),
            events: g.events.clone(),
            process: g.process.clone(),
        }
    }
}

/// The run-time pool for `cfg`: `old` itself when nothing about it changed, else `fresh()`
/// with the live state of `old`'s unchanged variants.
pub(crate) fn pool(
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

/// What a reload changes, pool by pool, for the admin answer and the log: `unchanged`,
/// `added`, `removed`, or `changed` with the variants `kept` (live state carried), `added`,
/// `redefined` (started afresh) and `removed`.
pub fn changes(old: &Config, new: &Config) -> Vec<Value> {
    let mut out = Vec::new();
    for p in &new.pools {
        let Some(o) = old.pools.iter().find(|o| o.name == p.name) else {
            out.push(json!({"pool": p.name, "change": "added"}));
            continue;
        };
        if o == p {
            out.push(json!({"pool": p.name, "change": "unchanged"}));
            continue;
        }
        let (mut kept, mut added, mut redefined) = (Vec::new(), Vec::new(), Vec::new());
        for v in &p.variants {
            match o.variants.iter().find(|ov| ov.name == v.name) {
                Some(ov) if ov == v => kept.push(&v.name),
                Some(_) => redefined.push(&v.name),
                None => added.push(&v.name),
            }
        }
        let removed: Vec<&String> = o
            .variants
            .iter()
            .filter(|ov| !p.variants.iter().any(|v| v.name == ov.name))
            .map(|ov| &ov.name)
            .collect();
        out.push(json!({"pool": p.name, "change": "changed", "kept": kept, "added": added, "redefined": redefined, "removed": removed}));
    }
    for o in &old.pools {
        if !new.pools.iter().any(|p| p.name == o.name) {
            out.push(json!({"pool": o.name, "change": "removed"}));
        }
    }
    out
}
