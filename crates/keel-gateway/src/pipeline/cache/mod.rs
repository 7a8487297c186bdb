//! The response cache: repeated deterministic requests answered without going upstream.
//!
//! The path through it, called from `pipeline::phases` between admission and selection:
//!
//! 1. [`ResponseCache::lookup`]: is the pool's cache on, is the request cacheable by policy
//!    (`keel_core::cache_key::bypass_reason`), do the client's headers allow it
//!    ([`Control`])? Then the key: a fingerprint of the normalized request within the
//!    tenant's namespace (a key without a tenant is its own namespace; no key: `open`).
//! 2. A stored answer is a **hit**: [`replay::respond`] answers it whole or as a stream in the
//!    client's protocol (route `cached`, the original request id in the decision record).
//! 3. Otherwise, when an identical request is already being generated, this one **waits** for
//!    it (see [`flight`]) and replays its answer — or, a streaming request behind a streaming
//!    one, **follows** its stream live ([`replay::follow`]); if that one ends without an answer
//!    (before its first byte, for a follower), this one goes upstream.
//! 4. Otherwise it is a **miss**: the request runs through stages 1–3 carrying a [`Capture`],
//!    which delivery completes with the whole answer the client was given (assembled from the
//!    stream for a streaming client). Only complete answers are stored: the relay reached the
//!    upstream's terminal event (a successful migration included), no error event was sent, the
//!    client was still there, the answer has a finish reason and, for a structured output,
//!    fits the request's schema (`keel_core::cache_key::unstorable`).
//!
//! `x-keel-cache` on every generation response: `hit` (answered from the cache, or from an
//! identical request in flight), `stored` (a whole answer stored before it was sent), `miss`
//! (went upstream; a streamed answer may still be stored at its end, the access log's `cache`
//! says so), `bypass` (not cacheable, or the cache is off).

pub mod replay;
pub mod semantic;

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use serde_json::{Map, Value};

use keel_core::cache_key::{self, Policy};
use keel_core::protocol::{Endpoint, ErrorKind};
use keel_core::request::CanonicalRequest;

use crate::pipeline::context::RequestCtx;
pub use crate::state::cache::{flight, store, Entry, ResponseCache};
use crate::state::pools::Pool;
use crate::wire::errors::GatewayError;
use crate::Gateway;
use flight::{Flight, Follower, Joined, LeaderWriter};

/// The response header that says what the cache did.
pub const HEADER: http::HeaderName = http::HeaderName::from_static("x-keel-cache");

/// What the client's headers allow: `cache-control: no-cache` (do not answer from the cache;
/// the fresh answer is stored), `cache-control: no-store` (do not store this answer), and
/// `x-keel-cache: off` (neither; `no-cache` and `no-store` are accepted there too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Control {
    pub read: bool,
    pub write: bool,
}

impl Control {
    pub fn from_headers(h: &HeaderMap) -> Result<Control, GatewayError> {
        let mut c = Control {
            read: true,
            write: true,
        };
        let mut apply = |directive: &str| match directive {
            "no-cache" => c.read = false,
            "no-store" => c.write = false,
            "off" => {
                c.read = false;
                c.write = false;
            }
            _ => {}
        };
        for v in h.get_all(http::header::CACHE_CONTROL) {
            for d in v.to_str().unwrap_or("").split(',') {
                apply(d.trim().to_ascii_lowercase().as_str());
            }
        }
        if let Some(v) = h.get(HEADER) {
            let v = v.to_str().unwrap_or("").trim().to_ascii_lowercase();
            if !matches!(v.as_str(), "off" | "no-cache" | "no-store" | "on") {
                return Err(GatewayError::new(
                    ErrorKind::InvalidRequest,
                    format!("{HEADER} must be off, no-cache, no-store or on, got `{v}`"),
                ));
            }
            apply(&v);
        }
        Ok(c)
    }
}

/// What the cache made of a request.
pub enum Lookup {
    /// Not cacheable (`reason`), or the cache is off for the pool.
    Bypass(&'static str),
    /// Answered from the cache; `coalesced` when the answer came from an identical request
    /// that was in flight.
    Hit { entry: Arc<Entry>, coalesced: bool },
    /// Follows an identical streaming request's stream live.
    Follow(Follower),
    /// Goes upstream; the capture stores its answer.
    Miss(Box<Capture>),
}

impl ResponseCache {
    /// Stage 0's last step (see the module doc).
    pub async fn lookup(
        self: &Arc<Self>,
        gw: &Arc<Gateway>,
        pool: &Arc<Pool>,
        req: &CanonicalRequest,
        ctx: &RequestCtx,
        control: Control,
    ) -> Lookup {
        let cfg = &pool.cfg.cache;
        if !cfg.enabled {
            return Lookup::Bypass("disabled");
        }
        let name = pool.cfg.name.as_str();
        let policy = Policy {
            max_temperature: cfg.max_temperature,
            allow_tools: cfg.allow_tools,
        };
        let reason = cache_key::bypass_reason(ctx.endpoint, &req.body, policy).or(
            match (control.read, control.write) {
                (false, false) => Some("off"),
                _ => None,
            },
        );
        if let Some(reason) = reason {
            self.count(name, "bypass");
            return Lookup::Bypass(reason);
        }
        let namespace = namespace(ctx);
        let key = cache_key::fingerprint(&namespace, ctx.endpoint, name, &req.body);
        let ttl = Duration::from_millis(cfg.ttl_ms);
        let mut probe = None;
        if control.read {
            if let Some(entry) = self.stores.get(&key, ttl).await {
                self.count(name, "hit");
                return Lookup::Hit {
                    entry,
                    coalesced: false,
                };
            }
            if let Some(s) = &cfg.semantic {
                let asked = semantic::Asked {
                    namespace: &namespace,
                    pool: name,
                    ctx,
                    req,
                };
                match semantic::nearest(gw, s, asked, &self.stores, ttl).await {
                    semantic::Found::Hit(entry) => {
                        self.count(name, "semantic_hit");
                        return Lookup::Hit {
                            entry,
                            coalesced: false,
                        };
                    }
                    semantic::Found::Miss(p) => probe = p,
                }
            }
        }
        if !control.write {
            self.count(name, "bypass");
            return Lookup::Bypass("no-store");
        }
        let mut flight = None;
        if control.read && cfg.coalesce {
            let shape = ctx
                .client_stream
                .then(|| flight::stream_shape(&req.model, &req.body));
            let stream = shape.clone().map(|s| (s, ctx.id.clone()));
            match self.flights.join(&key, stream) {
                Joined::Leader(f) => flight = Some(f),
                Joined::Waiter(_, Some(live)) if shape.as_deref().is_some_and(|s| live.fits(s)) => {
                    let followed = tokio::time::timeout_at(ctx.deadline, live.follow()).await;
                    if let Ok(Some(follower)) = followed {
                        self.count(name, "coalesced");
                        return Lookup::Follow(follower);
                    }
                    // The leader failed before its first byte: this request goes upstream.
                }
                Joined::Waiter(rx, _) => {
                    let waited = tokio::time::timeout_at(ctx.deadline, flight::wait(rx)).await;
                    if let Ok(Some(entry)) = waited {
                        self.count(name, "coalesced");
                        return Lookup::Hit {
                            entry,
                            coalesced: true,
                        };
                    }
                    // The leader ended without an answer: this request goes upstream itself.
                }
            }
        }
        self.count(name, "miss");
        Lookup::Miss(Box::new(Capture {
            cache: self.clone(),
            key,
            pool: pool.cfg.name.clone(),
            endpoint: ctx.endpoint,
            request: structured_fields(&req.body),
            ttl,
            flight,
            probe: probe.unwrap_or_default(),
        }))
    }
}

/// The tenant's namespace: its tenant, or the key's id when it has none; `open` without keys.
fn namespace(ctx: &RequestCtx) -> String {
    namespace_of(ctx.grant.as_ref().map(|g| &*g.key))
}

/// The namespace of a key's requests (see [`namespace`]).
pub fn namespace_of(key: Option<&crate::config::KeyConfig>) -> String {
    match key {
        Some(k) if !k.tenant.is_empty() => format!("tenant:{}", k.tenant),
        Some(k) => format!("key:{}", k.id),
        None => "open".to_owned(),
    }
}

/// The request fields an answer is validated against (see `cache_key::unstorable`).
fn structured_fields(body: &Map<String, Value>) -> Map<String, Value> {
    ["response_format", "output_format"]
        .into_iter()
        .filter_map(|k| Some((k.to_owned(), body.get(k)?.clone())))
        .collect()
}

/// A miss on its way upstream: stores the answer when the request completes. Dropping it
/// without storing ends its flight (waiters go upstream).
pub struct Capture {
    cache: Arc<ResponseCache>,
    key: String,
    pool: String,
    endpoint: Endpoint,
    request: Map<String, Value>,
    ttl: Duration,
    flight: Option<Flight>,
    /// The prompt's embedding (semantic mode only).
    probe: semantic::Probe,
}

impl Capture {
    /// Stores `answer` (the whole response the client was given, in its endpoint's shape) if it
    /// is storable; true when it was stored. `generation` is first token to end.
    pub fn store(
        self,
        answer: &Value,
        variant: &str,
        request_id: &str,
        generation: Duration,
    ) -> bool {
        if let Some(why) = cache_key::unstorable(self.endpoint, &self.request, answer) {
            tracing::debug!(request_id, pool = %self.pool, why, "answer not cached");
            self.skipped("invalid");
            return false;
        }
        let output_tokens = answer
            .pointer("/usage/completion_tokens")
            .or_else(|| answer.pointer("/usage/output_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let entry = Arc::new(Entry {
            request_id: request_id.to_owned(),
            variant: variant.to_owned(),
            body: answer.clone(),
            output_tokens,
            generation_ms: generation.as_millis() as u64,
            embedding: self.probe.embedding.clone(),
            parameters: self.probe.parameters.clone(),
        });
        let stored = self.cache.stores.put(&self.key, entry.clone(), self.ttl);
        if stored {
            self.cache
                .metrics
                .counter("keel_cache_stored_total", &[("pool", &self.pool)])
                .increment(1);
        }
        if let Some(f) = &self.flight {
            // Waiters get the answer even when it was too large to keep.
            f.publish(entry);
        }
        stored
    }

    /// The live log's writing end when this request leads a streaming flight (the relay appends
    /// what its client is sent, for followers).
    pub fn take_live(&mut self) -> Option<LeaderWriter> {
        self.flight.as_mut()?.take_live()
    }

    /// The answer was not complete (an error, a truncated stream, a client gone).
    pub fn incomplete(self) {
        self.skipped("incomplete");
    }

    fn skipped(&self, reason: &'static str) {
        self.cache
            .metrics
            .counter("keel_cache_skipped_total", &[("reason", reason)])
            .increment(1);
    }
}

/// Sets `x-keel-cache` unless something already did.
pub fn stamp(h: &mut HeaderMap, state: &'static str) {
    h.entry(HEADER).or_insert(HeaderValue::from_static(state));
}
