//! keel-gateway: the IO shell around keel-core. It reads requests, drives the four stages in
//! order, and performs what they decide:
//!
//! ```text
//! client ─▶ admission ─▶ selection ─▶ execution ─▶ delivery ─▶ client
//!           (admission)  (pools)      (execution)  (delivery)
//! ```
//!
//! [`server`] accepts connections and routes each request to [`server::handle_generation`],
//! which calls the stages in that order; each stage is one module named for it.
#![forbid(unsafe_code)]

pub mod admission;
pub mod capacity;
pub mod config;
pub mod delivery;
pub mod errors;
pub mod execution;
#[doc(hidden)]
pub mod fuzzing;
pub mod metrics;
pub mod monitor;
pub mod pools;
pub mod relay;
pub mod server;
pub mod upstream;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use tokio::sync::mpsc;

use keel_core::budget::RetryBudget;

pub use config::Config;
use pools::Pool;

/// The response body type of every keel response.
pub type Body = BoxBody<Bytes, io::Error>;

/// The running gateway's shared state.
pub struct Gateway {
    pub cfg: Config,
    pools: Vec<Arc<Pool>>,
    by_name: HashMap<String, usize>,
    budget: Mutex<RetryBudget>,
    /// Origin of `now_ms`: the core's clock is milliseconds since the gateway started.
    epoch: Instant,
    /// The most recent decision records (`GET /keel/decisions`).
    decisions: Mutex<VecDeque<pools::DecisionRecord>>,
}

/// Decision records kept for `/keel/decisions`.
const DECISIONS_KEPT: usize = 256;

impl Gateway {
    pub fn new(cfg: Config) -> Arc<Gateway> {
        let epoch = Instant::now();
        let mut by_name = HashMap::new();
        let mut pools = Vec::new();
        for (i, p) in cfg.pools.iter().enumerate() {
            by_name.insert(p.name.clone(), i);
            for a in &p.aliases {
                by_name.insert(a.clone(), i);
            }
            pools.push(Arc::new(Pool::new(
                p.clone(),
                upstream::client(p.timeouts.connect_ms),
                epoch,
            )));
        }
        let _ = metrics::handle();
        Arc::new(Gateway {
            budget: Mutex::new(RetryBudget::new(cfg.retry_budget)),
            cfg,
            pools,
            by_name,
            epoch,
            decisions: Mutex::new(VecDeque::with_capacity(DECISIONS_KEPT)),
        })
    }

    /// Milliseconds since the gateway started: the time passed into the pure core.
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub fn pool(&self, model: &str) -> Option<&Arc<Pool>> {
        self.by_name.get(model).map(|i| &self.pools[*i])
    }

    pub fn pools(&self) -> &[Arc<Pool>] {
        &self.pools
    }

    /// Public model names (pool names; aliases are accepted but not listed).
    pub fn model_names(&self) -> Vec<&str> {
        self.pools.iter().map(|p| p.cfg.name.as_str()).collect()
    }

    pub(crate) fn record_decision(&self, d: pools::DecisionRecord) {
        let mut q = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() == DECISIONS_KEPT {
            q.pop_front();
        }
        q.push_back(d);
    }

    /// The most recent decision records, oldest first.
    pub fn decisions(&self) -> Vec<pools::DecisionRecord> {
        self.decisions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    fn budget(&self) -> std::sync::MutexGuard<'_, RetryBudget> {
        self.budget.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn record_request(&self) {
        let now = self.now_ms();
        self.budget().record_request(now);
    }

    pub(crate) fn try_retry(&self) -> bool {
        let now = self.now_ms();
        self.budget().try_retry(now)
    }
}

/// Installs the process-wide TLS crypto provider (ring) once.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A complete response body.
pub fn full_body(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<Body> {
    let mut resp = Response::new(Full::new(body).map_err(|never| match never {}).boxed());
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// A streamed body fed through a channel; the sender sees `closed()` when the client is gone.
pub fn channel_body() -> (mpsc::Sender<Bytes>, Body) {
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, io::Error>(Frame::data(b)), rx))
    });
    (tx, StreamBody::new(stream).boxed())
}
