//! Admission's costly work on the prompt: normalization (`keel_core::normalize`), then the
//! token estimate by the pool's tokenizers and context fit (`context_fit`); which mode a client
//! may ask for, when in admission the work runs, and where.
//!
//! **When: after the key's request limits.** A client chooses how much work its request costs
//! (`x-keel-normalize: full`, a large prompt), so that work must be paid for by the key's
//! limits before it is done. Admission therefore runs in four phases:
//!
//! 1. cheap checks, linear in the body: the key, the bounded body read, parsing, the pool, the
//!    request's headers (`x-keel-normalize` among them): a bad request costs the key nothing;
//! 2. the key's limits that need no token count: a concurrency slot (`max_concurrency`) and one
//!    request (`rpm`), in `keys::limits::admit_request`; a request whose `max_tokens` alone
//!    exceeds a whole limit is a 400 here, before anything is taken;
//! 3. this module: normalization, the estimate and context fit;
//! 4. the key's limits that need the estimate: `tpm` and the budgets, in
//!    `keys::limits::admit_tokens`.
//!
//! A key at its rpm or concurrency limit is refused before any costly work, so a client gets no
//! more of it than its limits admit requests. A refusal gives back what was taken, except that
//! once phase 3 has run the request stays counted in `rpm` (keel's CPU was spent on it), so a
//! request refused in phase 4 cannot be retried for free. Without keys there are no limits to
//! order; the mode rules below still hold.
//!
//! (A measure of why: `full` on four 16 KB examples with two closers missing each, 4,160
//! candidate parses per example, took 71 ms of CPU without a bound and 2.2 ms within the
//! default budget, in `cargo bench -p keel-core --bench normalize -- json_repair_budget`; a
//! 10 MB body holds six hundred such examples.)
//!
//! **Which mode.** The request's `x-keel-normalize`, else the key's `normalize`, else the pool's.
//! The header may choose only a mode that the key's `client_normalize` (else the pool's) lists,
//! by default `off` and `syntax` (linear, cheap), or the mode that would apply anyway; another is
//! a 400 naming the allowed modes. `full` is an operator's choice: its JSON-example repair
//! searches for completions by parsing candidates.
//!
//! **Bounded.** `syntax`, the rules, intent completion and counting are linear in the body.
//! JSON-example repair gets a budget per request, [`RepairBudget::DEFAULT_BYTES`] of bytes
//! examined, counted and not timed (see `keel_core::normalize`): when it runs out, repair stops
//! and the examples not yet repaired stay as they were. The work done is counted in
//! `keel_prompt_repair_bytes_total{pool}`, requests that ran out of it in
//! `keel_prompt_repair_exhausted_total{pool}`.
//!
//! **Where.** Work linear in the body runs on the async worker up to
//! [`context_fit::blocking_bytes`] of body, and on tokio's blocking pool beyond, so that it
//! does not hold up other requests' IO. `full` may do its whole repair budget even on a small
//! body (a few hundred bytes can hold an example with 64 candidate positions), so a `full`
//! request's work always runs on the blocking pool. keel-core stays pure: the gateway decides
//! where its functions run.

use std::sync::Arc;

use http::request::Parts;
use keel_core::analyze;
use keel_core::cache_key;
use keel_core::normalize::{self, Edit, Edits, Mode, RepairBudget};
use keel_core::protocol::{Endpoint, ErrorKind};
use keel_core::request::CanonicalRequest;
use serde_json::{Map, Value};

use crate::config::KeyConfig;
use crate::pipeline::context_fit;
use crate::state::pools::Pool;
use crate::wire::errors::GatewayError;
use crate::Gateway;

/// How a request will be normalized, decided from its header, key and pool (phase 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub mode: Mode,
    /// Keep the edits for the decision record (`decision_prompt_edits`).
    keep_edits: bool,
}

/// What phase 3 made of a request.
pub struct Prepared {
    pub req: CanonicalRequest,
    /// The fix codes applied (middle-out's included), each counted in
    /// `keel_prompt_fixes_total{pool,fix}`.
    pub fixes: Vec<String>,
    pub edits: Vec<Edit>,
    /// Messages middle-out dropped.
    pub trimmed: usize,
    /// What JSON-example repair did of its budget.
    pub repair: RepairBudget,
    /// How many of `fixes` normalization applied (the rest are context fit's).
    normalized: usize,
    /// The request's fingerprint, where the pool takes them (`fingerprint = true`).
    pub fingerprint: Option<keel_core::analyze::Fingerprint>,
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Off => "off",
        Mode::Syntax => "syntax",
        Mode::Full => "full",
    }
}

/// The mode for a request: `x-keel-normalize` when the key's (else the pool's)
/// `client_normalize` allows it, else the key's `normalize`, else the pool's. 400 for a header
/// that names no mode or one the client may not choose.
pub fn plan(
    gw: &Gateway,
    pool: &Pool,
    key: Option<&KeyConfig>,
    parts: &Parts,
) -> Result<Plan, GatewayError> {
    let configured = key.and_then(|k| k.normalize).unwrap_or(pool.cfg.normalize);
    let keep_edits = gw.cfg.decision_prompt_edits;
    let Some(raw) = parts.headers.get(crate::wire::control::NORMALIZE) else {
        return Ok(Plan {
            mode: configured,
            keep_edits,
        });
    };
    let text = raw.to_str().unwrap_or("");
    let asked = Mode::parse(text.trim()).ok_or_else(|| {
        GatewayError::new(
            ErrorKind::InvalidRequest,
            format!("x-keel-normalize must be off, syntax or full, got `{text}`"),
        )
    })?;
    let listed = key
        .and_then(|k| k.client_normalize.as_deref())
        .unwrap_or(&pool.cfg.client_normalize);
    if asked != configured && !listed.contains(&asked) {
        let mut allowed: Vec<Mode> = listed.to_vec();
        if !allowed.contains(&configured) {
            allowed.push(configured);
        }
        allowed.sort_by_key(|m| *m as u8);
        let names: Vec<&str> = allowed.into_iter().map(mode_name).collect();
        let whose = match key.and_then(|k| k.client_normalize.as_ref().map(|_| k)) {
            Some(k) => format!("key `{}`", k.id),
            None => format!("model `{}`", pool.cfg.name),
        };
        return Err(GatewayError::new(
            ErrorKind::InvalidRequest,
            format!(
                "x-keel-normalize: {} is not allowed for {whose}; allowed: {} (client_normalize)",
                mode_name(asked),
                names.join(", ")
            ),
        ));
    }
    Ok(Plan {
        mode: asked,
        keep_edits,
    })
}

/// Phase 3: normalization, then the estimate and context fit, on the blocking pool where the
/// work may be large (see the module doc), and the fixes counted.
pub async fn prepare(
    pool: &Arc<Pool>,
    plan: Plan,
    endpoint: Endpoint,
    req: CanonicalRequest,
    body_bytes: usize,
    namespace: String,
) -> Result<Prepared, GatewayError> {
    let prepared = if plan.mode != Mode::Full && body_bytes <= context_fit::blocking_bytes(pool) {
        work(pool, plan, endpoint, req, &namespace)
    } else {
        let pool = pool.clone();
        tokio::task::spawn_blocking(move || work(&pool, plan, endpoint, req, &namespace))
            .await
            .map_err(|_| {
                GatewayError::new(ErrorKind::Internal, "keel: preparing the prompt failed")
            })?
    };
    let name = pool.cfg.name.as_str();
    if prepared.fingerprint.is_some() {
        pool.metrics
            .counter("keel_fingerprinted_requests_total", &[("pool", name)])
            .increment(1);
    }
    for code in &prepared.fixes[..prepared.normalized] {
        pool.metrics
            .counter("keel_prompt_fixes_total", &[("pool", name), ("fix", code)])
            .increment(1);
    }
    if prepared.repair.used_bytes() > 0 {
        pool.metrics
            .counter("keel_prompt_repair_bytes_total", &[("pool", name)])
            .increment(prepared.repair.used_bytes());
    }
    if prepared.repair.exhausted() {
        pool.metrics
            .counter("keel_prompt_repair_exhausted_total", &[("pool", name)])
            .increment(1);
    }
    Ok(prepared)
}

/// The work itself, wherever it runs. Normalization is skipped in safe mode and after the
/// `#keel-no-normalize` opt-out line (removed before forwarding; fix code `opt_out`).
/// `namespace`: the response cache's, for the fingerprint.
fn work(
    pool: &Pool,
    plan: Plan,
    endpoint: Endpoint,
    mut req: CanonicalRequest,
    namespace: &str,
) -> Prepared {
    let fingerprinted = pool.analysis.is_some()
        && cache_key::bypass_reason(endpoint, &Map::new(), analyze::DETERMINISTIC)
            != Some("endpoint");
    let key_raw = fingerprinted
        .then(|| cache_key::fingerprint(namespace, endpoint, &pool.cfg.name, &req.body));
    let mut edits = match plan.keep_edits {
        true => Edits::kept(),
        false => Edits::default(),
    };
    let mut repair = RepairBudget::default();
    let mut fixes: Vec<String> = if normalize::take_opt_out(endpoint, &mut req.body) {
        vec!["opt_out".to_owned()]
    } else if pool.safety.active() {
        Vec::new()
    } else {
        normalize::normalize_request_within(
            endpoint,
            &mut req.body,
            plan.mode,
            &pool.cfg.normalize_full,
            &mut edits,
            &mut repair,
        )
    };
    let normalized = fixes.len();
    let trimmed = context_fit::apply(pool, &mut req);
    if trimmed > 0 {
        fixes.push(context_fit::MIDDLE_OUT_FIX.to_owned());
    }
    // No fix at all (normalization's or context fit's): the body is the one the raw key hashed.
    let unchanged = fixes.is_empty();
    let fingerprint = key_raw.map(|k| {
        let keys = (k, unchanged);
        fingerprint(pool, plan.mode, endpoint, namespace, keys, &req.body)
    });
    Prepared {
        fingerprint,
        req,
        fixes,
        edits: edits.into_list(),
        trimmed,
        repair,
        normalized,
    }
}

/// The fingerprint of a request whose cache key before normalization is `key_raw` and whose
/// body is now `body`: the normalized key is the pool's (or, where it normalizes nothing,
/// `syntax`'s on a copy: what normalizing would merge).
fn fingerprint(
    pool: &Pool,
    mode: Mode,
    endpoint: Endpoint,
    namespace: &str,
    (key_raw, unchanged): (String, bool),
    body: &Map<String, Value>,
) -> analyze::Fingerprint {
    let syntax;
    let mut unchanged = unchanged;
    let normalized = if mode == Mode::Off {
        let mut copy = body.clone();
        let fixes = normalize::normalize_request_within(
            endpoint,
            &mut copy,
            Mode::Syntax,
            &pool.cfg.normalize_full,
            &mut Edits::default(),
            &mut RepairBudget::default(),
        );
        unchanged &= fixes.is_empty();
        syntax = copy;
        &syntax
    } else {
        body
    };
    let mut f = analyze::fingerprint(
        namespace,
        endpoint,
        &pool.cfg.name,
        (key_raw, unchanged),
        normalized,
        |t| match &pool.analysis {
            Some(a) => a.mine(t),
            None => analyze::template::id_of(t),
        },
    );
    f.normalizes = mode != Mode::Off;
    f
}
