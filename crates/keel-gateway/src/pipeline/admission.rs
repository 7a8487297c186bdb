//! The admit phase: bounded body read (size and time), parsing and validation (a precise 4xx in the client's
//! protocol for every kind of bad input), resolution of the public model name to a pool, and the
//! request controls (`x-keel-timeout-ms`, `x-keel-session`, `x-keel-force-variant`).
//!
//! The order matters: every cheap check first (a bad request costs the key nothing), then the
//! key's request limits (concurrency slot, rpm), then the costly work on the prompt
//! (normalization, token estimate, context fit: `prompt_work`, which explains the phases), then
//! the key's token limits (tpm, budgets), which need the estimate.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

use keel_core::protocol::{Endpoint, ErrorKind, Protocol};
use keel_core::request::{self, CanonicalRequest};
use keel_core::selection::Preference;

use crate::config::KeyConfig;
use crate::pipeline::context::{ClientApi, Priority, RequestCtx};
use crate::state::pools::Pool;
use crate::wire::control;
use crate::wire::errors::GatewayError;
use crate::{upstream, Gateway};

/// A request that passed admission.
pub struct Admitted {
    pub req: CanonicalRequest,
    pub pool: Arc<Pool>,
    pub ctx: RequestCtx,
    /// The request's fingerprint, for the access log (pools with `fingerprint = true`).
    pub fingerprint: Option<keel_core::analyze::Fingerprint>,
}

fn header(parts: &Parts, name: http::HeaderName) -> Option<&str> {
    parts.headers.get(name).and_then(|v| v.to_str().ok())
}

/// Reads the body within the size limit and before `timeout` (a client that trickles its body
/// cannot hold a connection and a task: 408).
pub async fn read_body(
    parts: &Parts,
    body: Incoming,
    limit: usize,
    timeout: Duration,
) -> Result<bytes::Bytes, GatewayError> {
    if let Some(ct) = header(parts, http::header::CONTENT_TYPE) {
        if !is_json(ct) {
            return Err(GatewayError::new(
                ErrorKind::UnsupportedMediaType,
                format!("unsupported content-type `{ct}`; send `application/json`"),
            ));
        }
    }
    let declared = header(parts, http::header::CONTENT_LENGTH).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64 + DRAIN_MAX_BYTES) {
        // Far too large to be worth reading: refuse at once (the connection closes).
        return Err(too_large(limit));
    }
    let mut seen = 0u64;
    let mut kept = Kept::default();
    let read = tokio::time::timeout(timeout, read_within(body, limit, &mut seen, &mut kept)).await;
    if seen > limit as u64 || declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large(limit));
    }
    match read {
        Ok(Ok(())) => Ok(kept.into_bytes()),
        Ok(Err(e)) => Err(GatewayError::new(
            ErrorKind::InvalidRequest,
            format!("could not read the request body: {e}"),
        )),
        Err(_) => Err(GatewayError::new(
            ErrorKind::RequestTimeout,
            format!(
                "the request body did not arrive within {} ms (body_read_timeout_ms)",
                timeout.as_millis()
            ),
        )),
    }
}

/// Whether a `content-type` names JSON: `application/json` or a `+json` type, in any case,
/// with any parameters.
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .as_bytes();
    let suffix = essence.len() >= 5 && essence[essence.len() - 5..].eq_ignore_ascii_case(b"+json");
    suffix || essence.eq_ignore_ascii_case(b"application/json")
}

/// How much more than the limit keel still reads, and discards, before answering 413. A client
/// still uploading when the connection closes under it gets a broken pipe instead of the 413
/// (Node's fetch, and with it both JavaScript SDKs, does), so a moderately oversized body is
/// read to its end first; a larger one is refused at once.
pub const DRAIN_MAX_BYTES: u64 = 64 << 20;

/// Reads the body to its end, keeping it in `kept` while it fits in `limit`; `seen` counts
/// every byte, so the caller knows, even after a timeout, whether the body was too large.
/// Past `limit + DRAIN_MAX_BYTES` it stops reading.
/// A body as it is read: its first frame as it came (most bodies arrive in one), copied into
/// one buffer only when another follows.
#[derive(Default)]
struct Kept {
    first: Option<bytes::Bytes>,
    joined: bytes::BytesMut,
}

impl Kept {
    fn push(&mut self, data: bytes::Bytes) {
        match self.first.take() {
            None if self.joined.is_empty() => self.first = Some(data),
            first => {
                if let Some(first) = first {
                    self.joined.extend_from_slice(&first);
                }
                self.joined.extend_from_slice(&data);
            }
        }
    }

    fn clear(&mut self) {
        self.first = None;
        self.joined.clear();
    }

    fn into_bytes(self) -> bytes::Bytes {
        self.first.unwrap_or_else(|| self.joined.freeze())
    }
}

async fn read_within(
    mut body: Incoming,
    limit: usize,
    seen: &mut u64,
    kept: &mut Kept,
) -> Result<(), hyper::Error> {
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        *seen += data.len() as u64;
        if *seen <= limit as u64 {
            kept.push(data);
        } else {
            kept.clear();
            if *seen > limit as u64 + DRAIN_MAX_BYTES {
                break;
            }
        }
    }
    Ok(())
}

fn too_large(limit: usize) -> GatewayError {
    GatewayError::new(
        ErrorKind::TooLarge,
        format!("request body exceeds the limit of {limit} bytes"),
    )
}

/// Stage 0 for a generation endpoint.
pub async fn admit(
    gw: &Gateway,
    api: ClientApi,
    parts: &Parts,
    body: Incoming,
    id: &str,
    started: Instant,
) -> Result<Admitted, GatewayError> {
    // The key first: a client without one is refused before its body is read.
    let key = gw.keys.authenticate(&parts.headers)?;
    let bytes = read_body(
        parts,
        body,
        gw.cfg.max_body_bytes,
        Duration::from_millis(gw.cfg.body_read_timeout_ms),
    )
    .await?;
    let endpoint = api.endpoint();
    let (mut req, responses) = match api {
        ClientApi::Responses => {
            let (req, front) = crate::wire::responses::admit(&bytes)?;
            (req, Some(front))
        }
        // The prompt is estimated once, by the pool's tokenizers (`prompt_work`).
        ClientApi::Endpoint(e) => (
            request::from_object(e, request::parse_object(&bytes)?)?,
            None,
        ),
    };
    req.received_bytes = bytes.len();
    if let Some(s) = header(parts, control::SESSION) {
        req.session = Some(s.to_owned());
    }
    let pool = resolve(gw, &req, key.as_deref())?;
    if pool.cfg.canonical_tools {
        keel_core::request::canonicalize_tools(&mut req.body);
    }
    served_here(pool, endpoint, &req)?;
    // Every header is read before the key's limits: a bad request costs the key nothing.
    let plan = crate::pipeline::prompt_work::plan(gw, pool, key.as_deref(), parts)?;
    let controls = HeaderControls::read(gw, pool, key.as_deref(), parts)?;
    let consensus = crate::pipeline::consensus::requested(&parts.headers, pool, endpoint, &req)?;
    // A consensus asks `n` variants for an answer each: the key's limits reserve every one.
    if let Some(n) = consensus {
        req.answers = req.answers.saturating_mul(n as u64);
    }
    // The key's request limits (a slot, one request) before the costly work on the prompt,
    // its token limits after, once the estimate is known (see `prompt_work`).
    let protocol = endpoint.protocol();
    let pending = match &key {
        Some(key) => Some(
            crate::state::keys::limits::admit_request(&gw.quotas(), key, pool, &req, protocol)
                .await?,
        ),
        None => None,
    };
    let namespace = match pool.analysis {
        Some(_) => crate::pipeline::cache::namespace_of(key.as_deref()),
        None => String::new(),
    };
    let mut prepared =
        crate::pipeline::prompt_work::prepare(pool, plan, endpoint, req, bytes.len(), namespace)
            .await?;
    // After normalization, before the token limits and the cache: see `guard`.
    let guard =
        crate::pipeline::guard::admit(pool, key.clone(), &mut prepared, bytes.len()).await?;
    let req = prepared.req;
    let grant = match pending {
        Some(p) => Some(Arc::new(
            crate::state::keys::limits::admit_tokens(&gw.quotas(), p, pool, &req, protocol).await?,
        )),
        None => None,
    };
    let meter = grant
        .as_ref()
        .map_or_else(Default::default, |g| g.meter.clone());
    let ctx = RequestCtx {
        meter,
        trace: None,
        grant,
        preference: controls.preference,
        priority: controls.priority,
        min_tier: controls.min_tier,
        id: id.to_owned(),
        started,
        endpoint,
        forwarded: upstream::forwarded_headers(&parts.headers),
        deadline: started + controls.total,
        client_stream: req.stream,
        assembled: !req.stream,
        force_variant: controls.force_variant,
        responses,
        prompt_fixes: prepared.fixes,
        prompt_edits: prepared.edits,
        trimmed_messages: prepared.trimmed,
        consensus,
        guard,
    };
    Ok(Admitted {
        req,
        pool: pool.clone(),
        ctx,
        fingerprint: prepared.fingerprint,
    })
}

/// The pool serving the request's model, or a 404 naming the models this caller may use
/// (the others' names are not its business).
fn resolve<'g>(
    gw: &'g Gateway,
    req: &CanonicalRequest,
    key: Option<&KeyConfig>,
) -> Result<&'g Arc<Pool>, GatewayError> {
    let pool = gw.pool(&req.model).ok_or_else(|| {
        let usable: Vec<&str> = gw
            .model_names()
            .into_iter()
            .filter(|m| key.is_none_or(|k| k.allows(m)))
            .collect();
        GatewayError::new(
            ErrorKind::NotFound,
            format!(
                "model `{}` is not served here; models you may use: {}",
                req.model,
                if usable.is_empty() {
                    "none".to_owned()
                } else {
                    usable.join(", ")
                }
            ),
        )
    })?;
    if let Some(key) = key {
        crate::state::keys::check_pool(key, &pool.cfg.name)?;
    }
    Ok(pool)
}

/// Chat Completions and Messages reach a variant of either protocol (translated at the
/// attempt); /v1/completions and /v1/embeddings only an OpenAI-protocol one. count_tokens is
/// answered locally when no variant speaks Anthropic (see server).
fn served_here(
    pool: &Pool,
    endpoint: Endpoint,
    req: &CanonicalRequest,
) -> Result<(), GatewayError> {
    if endpoint == Endpoint::Embeddings && !pool.speaks(Protocol::OpenAi) {
        return Err(GatewayError::new(
            ErrorKind::InvalidRequest,
            format!(
                "model `{}` (pool `{}`) has no OpenAI-protocol variant, and only those serve /v1/embeddings (the Anthropic API has no embeddings)",
                req.model, pool.cfg.name
            ),
        ));
    }
    if endpoint == Endpoint::Completions && !pool.speaks(Protocol::OpenAi) {
        return Err(GatewayError::new(
            ErrorKind::InvalidRequest,
            format!(
                "model `{}` is served over the anthropic protocol, which has no /v1/completions; call it through /v1/messages or /v1/chat/completions",
                req.model
            ),
        ));
    }
    Ok(())
}

/// The request's controls from its `x-keel-*` headers, narrowed by its key's.
struct HeaderControls {
    /// The request's total time (`timeouts.total_ms`, or less by `x-keel-timeout-ms`).
    total: Duration,
    force_variant: Option<String>,
    preference: Preference,
    min_tier: Option<u8>,
    priority: Priority,
}

impl HeaderControls {
    fn read(
        gw: &Gateway,
        pool: &Pool,
        key: Option<&KeyConfig>,
        parts: &Parts,
    ) -> Result<HeaderControls, GatewayError> {
        let invalid = |message: String| GatewayError::new(ErrorKind::InvalidRequest, message);
        let mut total = Duration::from_millis(pool.cfg.timeouts.total_ms);
        if let Some(v) = header(parts, control::TIMEOUT_MS) {
            let ms: u64 = v.trim().parse().ok().filter(|ms| *ms > 0).ok_or_else(|| {
                invalid(format!(
                    "x-keel-timeout-ms must be a positive integer of milliseconds, got `{v}`"
                ))
            })?;
            total = total.min(Duration::from_millis(ms));
        }
        let force_variant = match header(parts, control::FORCE_VARIANT) {
            Some(_) if !gw.cfg.allow_force_variant => {
                return Err(invalid(
                    "x-keel-force-variant is disabled on this gateway (set allow_force_variant = true to enable it)".into(),
                ))
            }
            Some(v) => Some(v.to_owned()),
            None => None,
        };
        let preference = match header(parts, control::PREFERENCE) {
            None => Preference::default(),
            Some(v) => Preference::parse(v.trim()).ok_or_else(|| {
                invalid(format!(
                    "x-keel-preference must be low-latency, high-fidelity or low-cost, got `{v}`"
                ))
            })?,
        };
        let min_tier =
            match header(parts, control::MIN_TIER) {
                None => None,
                Some(v) => Some(v.trim().parse::<u8>().ok().filter(|t| *t >= 1).ok_or_else(
                    || {
                        invalid(format!(
                            "x-keel-min-tier must be a tier number (1 = best fidelity), got `{v}`"
                        ))
                    },
                )?),
            };
        // A key's tier floor narrows the client's (1 is the best tier).
        let min_tier = match (min_tier, key.and_then(|k| k.min_tier)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // `x-keel-priority` may lower a request's rank, never raise it above its key's (without
        // keys it is taken as sent).
        let asked = match header(parts, control::PRIORITY) {
            None => None,
            Some(v) => Some(Priority::parse(v).ok_or_else(|| {
                invalid(format!(
                    "x-keel-priority must be high, normal or low, got `{v}`"
                ))
            })?),
        };
        let priority = match (asked, key.map(|k| k.priority)) {
            // `Ord` ranks High first: the larger is the lower priority.
            (Some(a), Some(k)) => a.max(k),
            (a, k) => a.or(k).unwrap_or_default(),
        };
        Ok(HeaderControls {
            total,
            force_variant,
            preference,
            min_tier,
            priority,
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_body_in_one_frame_is_kept_as_it_came_and_frames_after_it_are_joined() {
        use bytes::Bytes;
        let one = Bytes::from_static(b"{\"model\":\"m\"}");
        let mut kept = super::Kept::default();
        kept.push(one.clone());
        let body = kept.into_bytes();
        assert_eq!(body, one);
        assert_eq!(body.as_ptr(), one.as_ptr(), "one frame is not copied");
        let mut kept = super::Kept::default();
        for part in ["{\"model\"", "", ":\"m\"}"] {
            kept.push(Bytes::from_static(part.as_bytes()));
        }
        assert_eq!(kept.into_bytes(), one);
        let mut kept = super::Kept::default();
        kept.push(Bytes::from_static(b"{"));
        kept.clear();
        assert!(kept.into_bytes().is_empty());
    }

    use super::is_json;

    #[test]
    fn json_is_told_by_its_essence_in_any_case() {
        for json in [
            "application/json",
            "Application/JSON; charset=utf-8",
            " application/json ;charset=UTF-8",
            "application/vnd.api+json",
            "application/problem+JSON",
        ] {
            assert!(is_json(json), "{json}");
        }
        for other in [
            "text/plain",
            "",
            "json",
            "application/jsonx",
            "+jso",
            "é+jsoné",
            "application/json5",
        ] {
            assert!(!is_json(other), "{other}");
        }
    }
}
