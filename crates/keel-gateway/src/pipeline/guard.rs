//! The PII and secret guard in the request's path (detectors and masking: `keel_core::guard`;
//! config: `[pools.guard]`, a key's `guard`, see `config::guard`).
//!
//! **Request direction**, in admission after normalization (so a value obfuscated with
//! zero-width characters is found) and before the key's token limits and the cache lookup:
//! every text of the body is scanned and the policy applied: `detect` counts, `mask` puts
//! stable placeholders (`<EMAIL_1>`) in place of values, `redact` writes `[REDACTED_EMAIL]`,
//! `block` refuses the request with a 400 in the client's protocol that names entity types and
//! counts, never values. The placeholder map lives in the request's memory only ([`Guarded`],
//! held by the request context): it is never logged, cached, recorded or sent anywhere, so the
//! response cache, shadow copies and continuations all carry the masked form.
//!
//! **Answers**: a whole answer's placeholders are put back before the client reads it
//! ([`restore_whole`]); streamed answers are restored event by event with a bounded hold-back
//! (see `guard_stream`).
//!
//! **Visibility without exposure**: `x-keel-guard: masked=email:2;blocked=secret:1` (types and
//! counts), the same string in the access log (`guard`) and the decision record, and
//! `keel_guard_findings_total{pool,entity,action,direction}`.

use std::sync::Arc;

use keel_core::guard::body::apply_body;
use keel_core::guard::mask::{Counts, Masker};
use keel_core::guard::policy::{Action, Policy};
use keel_core::protocol::ErrorKind;

use crate::config::guard::KeyGuard;
use crate::config::KeyConfig;
use crate::state::pools::Pool;
use crate::wire::errors::GatewayError;

pub use crate::wire::GUARD_HEADER as HEADER;

/// What the guard did to one request, and the placeholder map its answer is restored with.
#[derive(Debug)]
pub struct Guarded {
    pub masker: Masker,
    pub counts: Counts,
    /// The answer direction's policy (pool's, with the key's over it).
    pub answer: Policy,
    pub guard: keel_core::guard::Guard,
    /// For the answer direction's counts (`keel_guard_findings_total`).
    pool: String,
    metrics: Arc<crate::observe::metrics::Metrics>,
}

impl Guarded {
    /// The `x-keel-guard` value (empty when nothing was found).
    pub fn summary(&self) -> String {
        self.counts.header()
    }
}

/// Applies the pool's (and the key's) request policy to a request body. `Ok(None)` when the
/// pool has no guard; a 400 when a `block` entity was found.
pub fn apply_request(
    pool: &Pool,
    key: Option<&KeyConfig>,
    body: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<Option<Arc<Guarded>>, GatewayError> {
    let Some(cfg) = &pool.cfg.guard else {
        return Ok(None);
    };
    let key_guard = key.and_then(|k| k.guard.as_ref());
    let policy = overlay(&cfg.request, key_guard.map(|k| &k.request[..]), &cfg.guard);
    let answer = overlay(&cfg.answer, key_guard.map(|k| &k.answer[..]), &cfg.guard);
    let mut masker = Masker::default();
    let mut counts = Counts::default();
    apply_body(&cfg.guard, &policy, body, &mut masker, &mut counts);
    count(pool, &counts, "request");
    let blocked = counts.of(Action::Block);
    if !blocked.is_empty() {
        let list: Vec<String> = blocked.iter().map(|(e, n)| format!("{e}: {n}")).collect();
        return Err(GatewayError::new(
            ErrorKind::InvalidRequest,
            format!(
                "the request was blocked by keel's guard for model `{}`: it contains {} (values are not shown)",
                pool.cfg.name,
                list.join(", ")
            ),
        ));
    }
    Ok(Some(Arc::new(Guarded {
        masker,
        counts,
        answer,
        guard: cfg.guard.clone(),
        pool: pool.cfg.name.clone(),
        metrics: pool.metrics.clone(),
    })))
}

fn overlay(
    pool: &Policy,
    key: Option<&[(String, Action)]>,
    guard: &keel_core::guard::Guard,
) -> Policy {
    match key {
        Some(pairs) if !pairs.is_empty() => pool.overlaid(&KeyGuard::policy(pairs, guard)),
        _ => pool.clone(),
    }
}

/// Counts findings in `keel_guard_findings_total{pool,entity,action,direction}`.
pub fn count(pool: &Pool, counts: &Counts, direction: &str) {
    count_in(&pool.metrics, &pool.cfg.name, counts, direction);
}

fn count_in(
    metrics: &crate::observe::metrics::Metrics,
    pool: &str,
    counts: &Counts,
    direction: &str,
) {
    for (action, entity, n) in counts.iter() {
        metrics
            .counter(
                "keel_guard_findings_total",
                &[
                    ("pool", pool),
                    ("entity", entity),
                    ("action", action.name()),
                    ("direction", direction),
                ],
            )
            .increment(u64::from(n));
    }
}

impl Guarded {
    /// Counts the answer direction's findings of one answer.
    pub fn count_answer(&self, counts: &Counts) {
        count_in(&self.metrics, &self.pool, counts, "answer");
    }
}

/// A whole answer's body with the answer policy applied to its texts (on the upstream's,
/// masked form) and the request's placeholders put back.
pub fn restore_whole(guarded: Option<&Guarded>, body: bytes::Bytes) -> bytes::Bytes {
    let Some(g) = guarded.filter(|g| !g.masker.is_empty() || !g.answer.is_empty()) else {
        return body;
    };
    let mut body = body;
    if !g.answer.is_empty() {
        if let Ok(serde_json::Value::Object(mut answer)) = serde_json::from_slice(&body) {
            let mut counts = Counts::default();
            let mut unused = Masker::default();
            apply_body(&g.guard, &g.answer, &mut answer, &mut unused, &mut counts);
            g.count_answer(&counts);
            if !counts.is_empty() {
                body = bytes::Bytes::from(serde_json::Value::Object(answer).to_string());
            }
        }
    }
    let Ok(text) = std::str::from_utf8(&body) else {
        return body;
    };
    match g.masker.restore_json(text) {
        std::borrow::Cow::Borrowed(_) => body,
        std::borrow::Cow::Owned(s) => bytes::Bytes::from(s),
    }
}

/// Sets `x-keel-guard` when the guard found anything.
pub fn header(h: &mut http::HeaderMap, guarded: Option<&Guarded>) {
    let Some(g) = guarded else { return };
    let s = g.summary();
    if s.is_empty() {
        return;
    }
    if let Ok(v) = http::HeaderValue::from_str(&s) {
        h.insert(HEADER, v);
    }
}

/// Admission's guard step on a prepared request: the request policy applied on the async
/// worker for small bodies, on the blocking pool beyond `context_fit::BLOCKING_BYTES` (as
/// normalization is). A guarded pool's decision records keep no normalization edits: they
/// quote prompt text, values included.
pub async fn admit(
    pool: &Arc<Pool>,
    key: Option<Arc<KeyConfig>>,
    prepared: &mut crate::pipeline::prompt_work::Prepared,
    body_bytes: usize,
) -> Result<Option<Arc<Guarded>>, GatewayError> {
    if pool.cfg.guard.is_none() {
        return Ok(None);
    }
    prepared.edits.clear();
    if body_bytes <= crate::pipeline::context_fit::BLOCKING_BYTES {
        return apply_request(pool, key.as_deref(), &mut prepared.req.body);
    }
    let pool = pool.clone();
    let mut body = std::mem::take(&mut prepared.req.body);
    let (result, body) = tokio::task::spawn_blocking(move || {
        let out = apply_request(&pool, key.as_deref(), &mut body);
        (out, body)
    })
    .await
    .map_err(|_| GatewayError::new(ErrorKind::Internal, "keel: guarding the prompt failed"))?;
    prepared.req.body = body;
    result
}
