//! The optional semantic mode (`[pools.cache] semantic = { embeddings_pool, max_distance }`):
//! a request whose prompt embeds within `max_distance` (cosine) of a cached one's, with the
//! same namespace, endpoint, pool and every other parameter, gets that answer.
//!
//! The embedding is an ordinary request to the named embeddings pool, run through selection
//! and execution like any other (so it is settled, counted and failed over); it is not billed
//! to the client's key. This process's entries with the same parameters are compared (a linear
//! scan), and, with `[redis]`, those every replica indexed (see `semantic_index`); the nearer
//! wins. When no embedding can be had, the request is an exact-key miss as without the mode.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use keel_core::cache_key;
use keel_core::protocol::Endpoint;
use keel_core::request::CanonicalRequest;

use crate::config::cache::SemanticConfig;
use crate::pipeline::attempt::Served;
use crate::pipeline::context::RequestCtx;
use crate::pipeline::execution::{self, Outcome};
use crate::pipeline::selection::{select_or_wait, Controls, Selection};
use crate::pipeline::settlement::Attempts;
use crate::Gateway;

use super::store::{Entry, Stores};

/// What the semantic scan found.
pub enum Found {
    /// A cached answer close enough.
    Hit(Arc<Entry>),
    /// None: the prompt's embedding and parameters key, to store with the answer (`None` when
    /// no embedding could be had).
    Miss(Option<Probe>),
}

/// A prompt's embedding and the key of its other parameters.
#[derive(Debug, Clone, Default)]
pub struct Probe {
    pub embedding: Vec<f32>,
    pub parameters: String,
}

/// The request a scan is for.
pub struct Asked<'a> {
    /// Its cache namespace (see `namespace_of`).
    pub namespace: &'a str,
    /// Its pool's name.
    pub pool: &'a str,
    pub ctx: &'a RequestCtx,
    pub req: &'a CanonicalRequest,
}

/// The closest cached answer within `cfg.max_distance`, if any, among `stores`' entries not
/// older than `ttl`.
pub async fn nearest(
    gw: &Arc<Gateway>,
    cfg: &SemanticConfig,
    asked: Asked<'_>,
    stores: &Stores,
    ttl: Duration,
) -> Found {
    let Asked {
        namespace,
        pool,
        ctx,
        req,
    } = asked;
    let parameters = cache_key::parameters_fingerprint(namespace, ctx.endpoint, pool, &req.body);
    let text = cache_key::prompt_text(&req.body);
    let Some(embedding) = embed(gw, cfg, ctx, &text).await else {
        return Found::Miss(None);
    };
    let mut best = stores
        .local_entries()
        .into_iter()
        .filter(|e| e.parameters == parameters)
        .map(|e| (cache_key::cosine_distance(&embedding, &e.embedding), e))
        .filter(|(d, _)| *d <= cfg.max_distance)
        .min_by(|a, b| a.0.total_cmp(&b.0));
    // Another replica's entry, when it is nearer than any here.
    let within = best.as_ref().map_or(cfg.max_distance, |(d, _)| *d);
    if let Some((d, key)) = stores
        .shared_nearest(&parameters, &embedding, within)
        .await
        .filter(|(d, _)| best.as_ref().is_none_or(|(b, _)| d < b))
    {
        if let Some(e) = stores.get(&key, ttl).await {
            best = Some((d, e));
        }
    }
    match best {
        Some((distance, e)) => {
            gw.metrics
                .histogram("keel_cache_semantic_distance", &[("pool", pool)])
                .record(distance);
            Found::Hit(e)
        }
        None => Found::Miss(Some(Probe {
            embedding,
            parameters,
        })),
    }
}

/// The embedding of `text` from the embeddings pool, or `None` (logged) when it cannot be had.
async fn embed(
    gw: &Arc<Gateway>,
    cfg: &SemanticConfig,
    ctx: &RequestCtx,
    text: &str,
) -> Option<Vec<f32>> {
    let pool = gw.pool(&cfg.embeddings_pool)?.clone();
    let body = json!({"model": pool.cfg.name, "input": text});
    let Value::Object(body) = body else {
        return None;
    };
    let req = keel_core::request::from_object(Endpoint::Embeddings, body).ok()?;
    let mut ectx = ctx.clone();
    ectx.endpoint = Endpoint::Embeddings;
    ectx.client_stream = false;
    ectx.responses = None;
    ectx.grant = None;
    ectx.force_variant = None;
    ectx.meter = Default::default();
    let controls = Controls {
        force_variant: None,
        preference: ctx.preference,
        min_tier: None,
        priority: ctx.priority,
    };
    let (selection, _) = select_or_wait(&pool, &req, controls, &ctx.id, ctx.deadline).await;
    let Selection::Plan(order) = selection else {
        tracing::debug!(request_id = %ctx.id, "semantic cache: the embeddings pool cannot serve now");
        return None;
    };
    let attempts = Attempts::new(gw, &pool, None);
    let executed = execution::execute(&pool, &req, &ectx, &order, attempts).await;
    let Outcome::Served(committed, Served::Whole { body, .. }) = executed.outcome else {
        tracing::debug!(request_id = %ctx.id, "semantic cache: no embedding");
        return None;
    };
    drop(committed);
    let v: Value = serde_json::from_slice(&body).ok()?;
    let vector: Vec<f32> = v
        .pointer("/data/0/embedding")?
        .as_array()?
        .iter()
        .map(|x| x.as_f64().map(|f| f as f32))
        .collect::<Option<_>>()?;
    (!vector.is_empty()).then_some(vector)
}
