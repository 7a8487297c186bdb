//! One simulated model server: a real HTTP/1.1 + HTTP/2 server on loopback.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/messages`,
//! `POST /v1/messages/count_tokens`, `POST /v1/embeddings` (see [`crate::embeddings`]), `GET /v1/models`, `GET /metrics` (vLLM metric names),
//! `GET|POST|DELETE /sim/faults`, `GET /sim/stats`, `GET /health`; the clouds' dialects by
//! their own paths (see [`crate::dialects`]: Azure OpenAI, Gemini, Vertex AI, Bedrock Converse,
//! the Responses API) and `POST /token`, the OAuth token endpoint Vertex AI's credentials come
//! from.
//!
//! A generation request walks: auth → parse → faults resolved → queue for a slot → prefill
//! (KV cache) → tokens at drawn gaps, acting out any fault on the way. Streams send response
//! headers at once (as vLLM does) and the first event after the time to first token.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Semaphore};

use keel_core::protocol::{error_body, Endpoint, ErrorKind, Protocol};
use keel_core::rng::Rng;

use crate::config::{GenerationConfig, ServerConfig};
use crate::dialects::{self, Dialect, Renderer, Route, Shape};
use crate::embeddings;
use crate::faults::{FaultKind, FaultSet, FaultSpec, RequestFaults};
use crate::latency::{draw_gap_ms, draw_ttft_ms, KvCache};
use crate::text::{normalize, Generator};
use crate::wire::{count_tokens_body, parse_request, Reply, SimRequest};

type Body = BoxBody<Bytes, io::Error>;

/// TTFT histogram bucket bounds in seconds (vLLM's).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];

/// Counters and gauges, readable by tests through [`SimServer::stats`] and `GET /sim/stats`.
#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    completed: AtomicU64,
    cancelled: AtomicU64,
    errors: AtomicU64,
    running: AtomicI64,
    waiting: AtomicI64,
    cold_served: AtomicU64,
    tokens_sent: AtomicU64,
    prefill_tokens: AtomicU64,
    tokens_issued: AtomicU64,
    connections_open: AtomicI64,
    connections_peak: AtomicI64,
    connections_accepted: AtomicU64,
}

/// A snapshot of a server's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub requests: u64,
    pub completed: u64,
    /// Streams whose client went away before the end.
    pub cancelled: u64,
    pub errors: u64,
    pub running: i64,
    pub waiting: i64,
    /// Requests that paid the configured cold start.
    pub cold_served: u64,
    /// Generated tokens written to clients (streams and whole bodies).
    pub tokens_sent: u64,
    /// Prompt tokens computed because the KV cache did not hold them (prefill work).
    pub prefill_tokens: u64,
    /// OAuth access tokens issued by `POST /token` (service-account JWT grants, as a gateway
    /// calling Vertex AI makes them).
    pub tokens_issued: u64,
    /// Client connections open now.
    pub connections_open: i64,
    /// The most client connections open at once since the server started.
    pub connections_peak: i64,
    /// Client connections accepted since the server started.
    pub connections_accepted: u64,
}

/// One open client connection, counted in `connections_open` until dropped.
struct OpenConnection(Arc<SimServer>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0
            .counters
            .connections_open
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// Shared state of one server.
pub struct SimServer {
    pub cfg: ServerConfig,
    gen: Generator,
    faults: Mutex<FaultSet>,
    rng: Mutex<Rng>,
    kv: Mutex<KvCache>,
    slots: Semaphore,
    counters: Counters,
    cold_remaining: AtomicU32,
    ttft: Mutex<(Vec<u64>, f64, u64)>,
    last_headers: Mutex<Vec<(String, String)>>,
    last_body: Mutex<Value>,
    id_counter: AtomicU64,
    /// A `refuse` fault: connections are refused until then (see [`start`]).
    refuse_until: Mutex<Option<Instant>>,
    /// Wakes the listener when a refusal starts or is cleared.
    refuse_changed: tokio::sync::Notify,
    /// Access tokens `POST /token` issued (accepted as bearers by the Vertex AI routes).
    issued_tokens: Mutex<std::collections::HashSet<String>>,
}

impl SimServer {
    pub fn new(cfg: ServerConfig, generation: GenerationConfig) -> Arc<Self> {
        let mut faults = FaultSet::default();
        let mut refuse_until = None;
        for f in &cfg.faults {
            match f.kind {
                FaultKind::Refuse => {
                    refuse_until = Some(Instant::now() + Duration::from_millis(f.ms.unwrap_or(0)))
                }
                _ => faults.add(f.clone()),
            }
        }
        let refuse_changed = tokio::sync::Notify::new();
        if refuse_until.is_some() {
            refuse_changed.notify_one();
        }
        Arc::new(SimServer {
            refuse_until: Mutex::new(refuse_until),
            refuse_changed,
            issued_tokens: Mutex::new(std::collections::HashSet::new()),
            gen: Generator::new(&cfg.family, generation),
            faults: Mutex::new(faults),
            rng: Mutex::new(Rng::new(cfg.seed.unwrap_or(1))),
            kv: Mutex::new(KvCache::new(cfg.kv_cache_blocks, cfg.block_tokens)),
            slots: Semaphore::new(cfg.capacity as usize),
            counters: Counters::default(),
            cold_remaining: AtomicU32::new(cfg.cold_start_requests),
            ttft: Mutex::new((vec![0; TTFT_BUCKETS.len()], 0.0, 0)),
            last_headers: Mutex::new(Vec::new()),
            last_body: Mutex::new(Value::Null),
            id_counter: AtomicU64::new(cfg.seed.unwrap_or(1) << 32),
            cfg,
        })
    }

    pub fn stats(&self) -> Stats {
        let c = &self.counters;
        Stats {
            requests: c.requests.load(Ordering::Relaxed),
            completed: c.completed.load(Ordering::Relaxed),
            cancelled: c.cancelled.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            running: c.running.load(Ordering::Relaxed),
            waiting: c.waiting.load(Ordering::Relaxed),
            cold_served: c.cold_served.load(Ordering::Relaxed),
            tokens_sent: c.tokens_sent.load(Ordering::Relaxed),
            prefill_tokens: c.prefill_tokens.load(Ordering::Relaxed),
            tokens_issued: c.tokens_issued.load(Ordering::Relaxed),
            connections_open: c.connections_open.load(Ordering::Relaxed),
            connections_peak: c.connections_peak.load(Ordering::Relaxed),
            connections_accepted: c.connections_accepted.load(Ordering::Relaxed),
        }
    }

    /// Counts a client connection from its accept to its close (when the guard drops).
    fn connection_opened(self: &Arc<Self>) -> OpenConnection {
        let c = &self.counters;
        c.connections_accepted.fetch_add(1, Ordering::Relaxed);
        let open = c.connections_open.fetch_add(1, Ordering::Relaxed) + 1;
        c.connections_peak.fetch_max(open, Ordering::Relaxed);
        OpenConnection(self.clone())
    }

    pub fn add_fault(&self, f: FaultSpec) {
        if f.kind == FaultKind::Refuse {
            let until = Instant::now() + Duration::from_millis(f.ms.unwrap_or(0));
            let mut r = lock(&self.refuse_until);
            *r = Some(r.map_or(until, |t| t.max(until)));
            self.refuse_changed.notify_one();
            return;
        }
        lock(&self.faults).add(f);
    }

    /// Until when connections are refused (a `refuse` fault), if they are now.
    fn refusing(&self) -> Option<Instant> {
        lock(&self.refuse_until).filter(|t| *t > Instant::now())
    }

    /// Clears every fault (a refusal ends at once); a configured cold start re-arms, as after
    /// a restart.
    pub fn clear_faults(&self) {
        lock(&self.faults).clear();
        if lock(&self.refuse_until).take().is_some() {
            self.refuse_changed.notify_one();
        }
        self.cold_remaining
            .store(self.cfg.cold_start_requests, Ordering::Relaxed);
    }

    /// Headers of the last generation request received (tests check what a proxy forwarded).
    pub fn last_headers(&self) -> Vec<(String, String)> {
        lock(&self.last_headers).clone()
    }

    /// Body of the last generation request received.
    pub fn last_body(&self) -> Value {
        lock(&self.last_body).clone()
    }

    fn model_label(&self) -> &str {
        self.cfg.models.first().map(String::as_str).unwrap_or("sim")
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Result<Response<Body>, io::Error> {
        let path = req.uri().path().to_owned();
        let endpoint = Endpoint::from_path(&path);
        if req.method() == Method::POST {
            if path == "/token" {
                return Ok(self.token(req).await);
            }
            if let Some(route) = dialects::route(&path) {
                return self.generate_dialect(route, req).await;
            }
        }
        match (req.method(), endpoint, path.as_str()) {
            (&Method::POST, Some(ep), _) => self.generate(ep, req).await,
            (&Method::GET, _, "/v1/models") => Ok(json_response(StatusCode::OK, &self.models())),
            (&Method::GET, _, "/metrics") => Ok(text_response(self.metrics())),
            (&Method::GET, _, "/health") => {
                // As llama.cpp: 503 while the model loads, 200 once ready.
                if lock(&self.faults).health_loading() {
                    let body = json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}});
                    Ok(json_response(StatusCode::SERVICE_UNAVAILABLE, &body))
                } else {
                    Ok(json_response(StatusCode::OK, &json!({"status": "ok"})))
                }
            }
            (&Method::GET, _, "/sim/stats") => {
                Ok(json_response(StatusCode::OK, &self.stats_json()))
            }
            (&Method::GET, _, "/sim/faults") => {
                let list = lock(&self.faults).list();
                Ok(json_response(StatusCode::OK, &json!(list)))
            }
            (&Method::POST, _, "/sim/faults") => Ok(self.clone().post_faults(req).await),
            (&Method::DELETE, _, "/sim/faults") => {
                self.clear_faults();
                Ok(json_response(StatusCode::OK, &json!({"cleared": true})))
            }
            _ => Ok(json_response(
                StatusCode::NOT_FOUND,
                &error_body(
                    Protocol::OpenAi,
                    ErrorKind::NotFound,
                    &format!("no route for {} {path}", req.method()),
                ),
            )),
        }
    }

    async fn post_faults(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let bad = |m: String| json_response(StatusCode::BAD_REQUEST, &json!({"error": m}));
        let bytes = match Limited::new(req.into_body(), 1 << 20).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return bad(format!("cannot read body: {e}")),
        };
        let specs: Vec<FaultSpec> = match serde_json::from_slice::<Value>(&bytes) {
            Ok(Value::Array(_)) => match serde_json::from_slice(&bytes) {
                Ok(v) => v,
                Err(e) => return bad(format!("invalid fault list: {e}")),
            },
            Ok(_) => match serde_json::from_slice(&bytes) {
                Ok(v) => vec![v],
                Err(e) => return bad(format!("invalid fault: {e}")),
            },
            Err(e) => return bad(format!("invalid JSON: {e}")),
        };
        for (i, s) in specs.iter().enumerate() {
            if let Err(e) = s.validate() {
                return bad(format!("fault {i}: {e}"));
            }
        }
        let n = specs.len();
        for s in specs {
            if s.kind == FaultKind::Refuse {
                // After this answer has left: a refusal drops every open connection.
                let server = self.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    server.add_fault(s);
                });
            } else {
                self.add_fault(s);
            }
        }
        json_response(
            StatusCode::OK,
            &json!({"added": n, "active": lock(&self.faults).list()}),
        )
    }

    fn models(&self) -> Value {
        let names: Vec<&str> = if self.cfg.models.is_empty() {
            vec!["sim"]
        } else {
            self.cfg.models.iter().map(String::as_str).collect()
        };
        json!({"object": "list", "data": names.iter().map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "keel-sim"})).collect::<Vec<_>>()})
    }

    fn stats_json(&self) -> Value {
        let mut v = serde_json::to_value(self.stats()).unwrap_or(json!({}));
        v["name"] = json!(self.cfg.name);
        v["kv_cache_usage"] = json!(lock(&self.kv).usage());
        v
    }

    fn metrics(&self) -> String {
        let s = self.stats();
        let m = self.model_label();
        let kv = lock(&self.kv).usage();
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, v: String| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{model_name=\"{m}\"}} {v}\n"
            ));
        };
        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.running.to_string(),
        );
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.waiting.to_string(),
        );
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            format!("{kv}"),
        );
        let (buckets, sum, count) = lock(&self.ttft).clone();
        out.push_str("# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n");
        out.push_str("# TYPE vllm:time_to_first_token_seconds histogram\n");
        let mut cum = 0;
        for (le, n) in TTFT_BUCKETS.iter().zip(buckets.iter()) {
            cum += n;
            out.push_str(&format!(
                "vllm:time_to_first_token_seconds_bucket{{le=\"{le}\",model_name=\"{m}\"}} {cum}\n"
            ));
        }
        out.push_str(&format!(
            "vllm:time_to_first_token_seconds_bucket{{le=\"+Inf\",model_name=\"{m}\"}} {count}\n"
        ));
        out.push_str(&format!(
            "vllm:time_to_first_token_seconds_sum{{model_name=\"{m}\"}} {sum}\n"
        ));
        out.push_str(&format!(
            "vllm:time_to_first_token_seconds_count{{model_name=\"{m}\"}} {count}\n"
        ));
        out.push_str(&format!(
            "# TYPE sim_requests_total counter\nsim_requests_total {}\n",
            s.requests
        ));
        out.push_str(&format!(
            "# TYPE sim_requests_cancelled_total counter\nsim_requests_cancelled_total {}\n",
            s.cancelled
        ));
        out
    }

    fn record_ttft(&self, secs: f64) {
        let mut t = lock(&self.ttft);
        if let Some(i) = TTFT_BUCKETS.iter().position(|le| secs <= *le) {
            t.0[i] += 1;
        }
        t.1 += secs;
        t.2 += 1;
    }

    fn protocol_error(&self, protocol: Protocol, status: u16, message: &str) -> Response<Body> {
        let kind = match status {
            400 => ErrorKind::InvalidRequest,
            401 => ErrorKind::Authentication,
            403 => ErrorKind::Permission,
            404 => ErrorKind::NotFound,
            413 => ErrorKind::TooLarge,
            429 => ErrorKind::RateLimited,
            502 => ErrorKind::BadGateway,
            503 | 529 => ErrorKind::Overloaded,
            504 => ErrorKind::Timeout,
            _ => ErrorKind::Internal,
        };
        let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        json_response(code, &error_body(protocol, kind, message))
    }

    /// An error in the answer's shape: the hub protocol's, or the dialect's (its body and
    /// headers, e.g. Bedrock's `x-amzn-ErrorType`).
    fn error(&self, shape: Shape, status: u16, message: &str) -> Response<Body> {
        match shape {
            Shape::Hub(p) => self.protocol_error(p, status, message),
            Shape::Dialect(d) => {
                let (status, headers, body) = dialects::error_response(d, status, message);
                let code =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                let mut resp = json_response(code, &body);
                for (k, v) in headers {
                    resp.headers_mut().insert(k, header_value(&v));
                }
                resp
            }
        }
    }

    /// The 400 a real server gives a prompt longer than its context window, in its protocol's
    /// words (see `ServerConfig::context_window`).
    fn context_exceeded(
        &self,
        shape: Shape,
        endpoint: Endpoint,
        sreq: &SimRequest,
    ) -> Option<Response<Body>> {
        let window = self.cfg.context_window?;
        let output = if endpoint == Endpoint::CountTokens {
            0
        } else {
            sreq.max_tokens.unwrap_or(0)
        };
        let needed = sreq.prompt_tokens + output;
        if needed <= window {
            return None;
        }
        let protocol = match shape {
            Shape::Hub(p) => p,
            Shape::Dialect(Dialect::VertexClaude) => Protocol::Anthropic,
            Shape::Dialect(Dialect::Azure) => Protocol::OpenAi,
            Shape::Dialect(_) => {
                // The clouds' own words (Gemini's), in each dialect's error shape.
                return Some(self.error(
                    shape,
                    400,
                    &format!("The input token count ({}) exceeds the maximum number of tokens allowed ({window}).", sreq.prompt_tokens),
                ));
            }
        };
        let body = match protocol {
            Protocol::OpenAi => json!({"error": {
                "message": format!("This model's maximum context length is {window} tokens. However, you requested {needed} tokens ({} in the messages, {output} in the completion). Please reduce the length of the messages or completion.", sreq.prompt_tokens),
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded"}}),
            Protocol::Anthropic => json!({"type": "error", "error": {
                "type": "invalid_request_error",
                "message": format!("prompt is too long: {} tokens > {window} maximum", sreq.prompt_tokens)}}),
        };
        Some(json_response(StatusCode::BAD_REQUEST, &body))
    }

    /// Waits for a capacity slot (counted as waiting meanwhile, then running while held).
    async fn acquire(&self) -> Option<Slot<'_>> {
        self.counters.waiting.fetch_add(1, Ordering::Relaxed);
        let permit = self.slots.acquire().await.ok();
        self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        self.counters.running.fetch_add(1, Ordering::Relaxed);
        permit.map(|p| Slot {
            _permit: p,
            server: self,
        })
    }

    /// A time to first token (or, for embeddings, to the answer) in ms, for a request with
    /// `uncached` prompt tokens to compute.
    fn draw_ttft_ms(&self, uncached: usize, faults: &RequestFaults) -> f64 {
        let mut rng = lock(&self.rng);
        draw_ttft_ms(&self.cfg, &mut rng, uncached, faults.ttft_factor)
            + faults.extra_ttft_ms as f64
    }

    /// A 404 when the server is configured with model names and `model` is not one of them.
    fn unknown_model(&self, shape: Shape, model: &str) -> Option<Response<Body>> {
        if self.cfg.models.is_empty() || self.cfg.models.iter().any(|m| m == model) {
            return None;
        }
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        Some(self.error(shape, 404, &format!("The model `{model}` does not exist.")))
    }

    /// `POST /v1/embeddings`: validated as OpenAI does, subject to the same faults, capacity and
    /// latency as a generation (the whole answer arrives after one time to first token).
    async fn embed(&self, body: &Value, arrived: Instant) -> Result<Response<Body>, io::Error> {
        let protocol = Protocol::OpenAi;
        let bad = |m: &str| {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            Ok(self.protocol_error(protocol, 400, m))
        };
        let Some(obj) = body.as_object() else {
            return bad("request body must be a JSON object");
        };
        let Some(model) = obj.get("model").and_then(Value::as_str) else {
            return bad("missing required field `model`");
        };
        let req = match keel_core::embeddings::parse(obj) {
            Ok(r) => r,
            Err(e) => return bad(&e.message),
        };
        if let Some(resp) = self.unknown_model(Shape::Hub(protocol), model) {
            return Ok(resp);
        }
        let mut faults = self.resolve_faults();
        if let Some(answer) = self.fault_answer(Shape::Hub(protocol), &mut faults).await {
            return answer;
        }
        let slot = self.acquire().await;
        let ms = self.draw_ttft_ms(req.tokens() as usize, &faults);
        sleep_unless_zero(Duration::from_secs_f64(ms / 1000.0)).await;
        self.record_ttft(arrived.elapsed().as_secs_f64());
        drop(slot);
        let body =
            embeddings::response_body(&req, model, self.cfg.embedding_dimensions).to_string();
        if faults.close_after.is_some() {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "sim fault: close",
            ));
        }
        if faults.malformed_after.is_some() {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            let cut = body.len() / 2;
            return Ok(bytes_response(
                StatusCode::OK,
                "application/json",
                Bytes::from(body[..cut].to_owned()),
            ));
        }
        self.counters.completed.fetch_add(1, Ordering::Relaxed);
        Ok(bytes_response(
            StatusCode::OK,
            "application/json",
            Bytes::from(body),
        ))
    }

    /// This request's faults, resolved under one short lock each (nothing awaits while
    /// locked), with a pending cold start and a full wait line applied.
    fn resolve_faults(&self) -> RequestFaults {
        let mut faults = {
            let mut rng = lock(&self.rng);
            lock(&self.faults).resolve(&mut rng)
        };
        let cold = self
            .cold_remaining
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if cold {
            faults.extra_ttft_ms += self.cfg.cold_start_extra_ms;
            self.counters.cold_served.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(max) = self.cfg.max_waiting {
            let busy = self.counters.running.load(Ordering::Relaxed) >= self.cfg.capacity as i64;
            if busy && self.counters.waiting.load(Ordering::Relaxed) >= max as i64 {
                faults.error = Some((429, Some(self.cfg.retry_after_s)));
            }
        }
        faults
    }

    /// Acts out the faults that answer a request instead of the model (loading, a reset, a
    /// hang, an error status, a raw body); `None` when the request is to be served.
    async fn fault_answer(
        &self,
        shape: Shape,
        faults: &mut RequestFaults,
    ) -> Option<Result<Response<Body>, io::Error>> {
        if faults.loading {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            if shape == Shape::Dialect(Dialect::Bedrock) {
                // Bedrock's word for a model still loading (its cold start).
                let mut resp = json_response(
                    StatusCode::TOO_MANY_REQUESTS,
                    &json!({"message": "Model is not ready for inference. Wait and try your request again."}),
                );
                resp.headers_mut().insert(
                    "x-amzn-errortype",
                    header_value("ModelNotReadyException:http://internal.amazon.com/coral/com.amazon.bedrock/"),
                );
                return Some(Ok(resp));
            }
            return Some(Ok(self.error(shape, 503, "Loading model")));
        }
        if faults.reset {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return Some(Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "sim fault: reset",
            )));
        }
        if let Some(hang) = faults.hang_ms {
            tokio::time::sleep(Duration::from_millis(hang.unwrap_or(24 * 3600 * 1000))).await;
        }
        if let Some((status, retry_after)) = faults.error {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            let mut resp = self.error(shape, status, &format!("sim fault: HTTP {status}"));
            if let Some(s) = retry_after {
                let h = resp.headers_mut();
                h.insert(
                    header::RETRY_AFTER,
                    header_value(&format!("{}", s.ceil() as u64)),
                );
                h.insert(
                    "retry-after-ms",
                    header_value(&format!("{}", (s * 1000.0).round() as u64)),
                );
            }
            return Some(Ok(resp));
        }
        if let Some((status, content_type, body)) = faults.raw.take() {
            return Some(Ok(bytes_response(
                StatusCode::from_u16(status).unwrap_or(StatusCode::OK),
                &content_type,
                Bytes::from(body),
            )));
        }
        None
    }

    async fn generate(
        self: Arc<Self>,
        endpoint: Endpoint,
        req: Request<Incoming>,
    ) -> Result<Response<Body>, io::Error> {
        let arrived = Instant::now();
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let protocol = endpoint.protocol();
        if endpoint == Endpoint::Embeddings && req.headers().contains_key("anthropic-version") {
            // Addressed to Anthropic's API (as its SDKs do), which has no embeddings.
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return Ok(self.protocol_error(
                Protocol::Anthropic,
                404,
                "Not found: the Anthropic API has no /v1/embeddings endpoint",
            ));
        }
        *lock(&self.last_headers) = req
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();

        if let Some(key) = &self.cfg.api_key {
            let h = req.headers();
            let bearer = h
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            let xkey = h.get("x-api-key").and_then(|v| v.to_str().ok());
            if bearer != Some(key.as_str()) && xkey != Some(key.as_str()) {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                return Ok(self.protocol_error(protocol, 401, "invalid api key"));
            }
        }
        let bytes = match Limited::new(req.into_body(), 32 << 20).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                return Ok(self.protocol_error(protocol, 400, &format!("cannot read body: {e}")))
            }
        };
        let body: Value = match serde_json::from_slice(&bytes) {
            Ok(v) => v,
            Err(e) => return Ok(self.protocol_error(protocol, 400, &format!("invalid JSON: {e}"))),
        };
        *lock(&self.last_body) = body.clone();
        if endpoint == Endpoint::Embeddings {
            return self.embed(&body, arrived).await;
        }
        self.serve(Shape::Hub(protocol), endpoint, &body, None, arrived)
            .await
    }

    /// A request in a dialect's words (see [`crate::dialects`]): checked as its cloud checks
    /// it, read as its hub request, and served as that request is, answering in the dialect.
    async fn generate_dialect(
        self: Arc<Self>,
        route: Route,
        req: Request<Incoming>,
    ) -> Result<Response<Body>, io::Error> {
        let arrived = Instant::now();
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let shape = Shape::Dialect(route.dialect);
        *lock(&self.last_headers) = req
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let query = req.uri().query().map(str::to_owned);
        if route.dialect == Dialect::Azure
            && route.model.is_some()
            && dialects::query_param(query.as_deref().unwrap_or(""), "api-version").is_none()
        {
            // Azure answers a deployment path without `api-version` as an unknown resource.
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return Ok(json_response(
                StatusCode::NOT_FOUND,
                &json!({"error": {"code": "404", "message": "Resource not found"}}),
            ));
        }
        let authorized = {
            let issued = |t: &str| lock(&self.issued_tokens).contains(t);
            dialects::authorize(
                route.dialect,
                &dialects::Credentials {
                    headers: req.headers(),
                    query: query.as_deref(),
                    api_key: self.cfg.api_key.as_deref(),
                    issued: &issued,
                },
            )
        };
        if let Err((status, message)) = authorized {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return Ok(self.error(shape, status, &message));
        }
        let bytes = match Limited::new(req.into_body(), 32 << 20).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return Ok(self.error(shape, 400, &format!("cannot read body: {e}"))),
        };
        let body: Value = match serde_json::from_slice(&bytes) {
            Ok(v) => v,
            Err(e) => return Ok(self.error(shape, 400, &format!("invalid JSON: {e}"))),
        };
        *lock(&self.last_body) = body.clone();
        let hub = match dialects::to_hub(&route, &body) {
            Ok(h) => h,
            Err(m) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                return Ok(self.error(shape, 400, &m));
            }
        };
        self.serve(shape, route.dialect.hub(), &hub.body, hub.schema, arrived)
            .await
    }

    /// `POST /token`: the OAuth token endpoint of a service account's JWT grant (see
    /// [`dialects::vertex::check_grant`]); the tokens it issues are accepted as bearers by the
    /// Vertex AI routes, and counted (`tokens_issued`).
    async fn token(&self, req: Request<Incoming>) -> Response<Body> {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let token_url = format!("http://{host}/token");
        let form = match Limited::new(req.into_body(), 1 << 20).collect().await {
            Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
            Err(e) => String::from_utf8_lossy(e.to_string().as_bytes()).into_owned(),
        };
        let now_s = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        match dialects::vertex::check_grant(&form, &token_url, now_s) {
            Ok(()) => {
                let n = self.counters.tokens_issued.fetch_add(1, Ordering::Relaxed);
                let token = format!("ya29.sim-{}-{n:08x}", self.cfg.name);
                lock(&self.issued_tokens).insert(token.clone());
                json_response(StatusCode::OK, &dialects::vertex::token_body(&token))
            }
            Err((error, description)) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                json_response(
                    StatusCode::BAD_REQUEST,
                    &json!({"error": error, "error_description": description}),
                )
            }
        }
    }

    /// Serves a hub request (`body`, for `endpoint`), answering in `shape`. `schema`: a JSON
    /// schema the answer follows (a dialect's JSON mode, where the hub has none).
    async fn serve(
        self: Arc<Self>,
        shape: Shape,
        endpoint: Endpoint,
        body: &Value,
        schema: Option<Value>,
        arrived: Instant,
    ) -> Result<Response<Body>, io::Error> {
        let mut sreq = match parse_request(endpoint, body, self.cfg.assistant_prefill) {
            Ok(r) => r,
            Err(m) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                return Ok(self.error(shape, 400, &m));
            }
        };
        if let (Some(schema), None) = (&schema, &sreq.tool_call) {
            let key = keel_core::rng::hash_bytes(11, sreq.context.as_bytes());
            sreq.structured = Some(crate::schema::value_for(schema, key).to_string());
        }
        if let Some(resp) = self.unknown_model(shape, &sreq.model) {
            return Ok(resp);
        }
        if self.cfg.refuse_prefill && sreq.ends_with_assistant {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return Ok(self.error(shape, 400, keel_core::continuation::PREFILL_REFUSAL));
        }
        if let Some(resp) = self.context_exceeded(shape, endpoint, &sreq) {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return Ok(resp);
        }
        if endpoint == Endpoint::CountTokens {
            self.counters.completed.fetch_add(1, Ordering::Relaxed);
            return Ok(json_response(StatusCode::OK, &count_tokens_body(&sreq)));
        }

        let mut faults = self.resolve_faults();
        if let Some(answer) = self.fault_answer(shape, &mut faults).await {
            return answer;
        }
        let asked_json = sreq.structured.is_some();
        let answer = faults.answer.as_ref().or(self.cfg.answer.as_ref());
        if let (Some(answer), None) = (answer, &sreq.tool_call) {
            // A fixed answer is served as a structured reply is: its text after the prefill.
            sreq.structured = Some(answer.clone());
        }
        if let (true, Some(json)) = (faults.invalid_json && asked_json, &mut sreq.structured) {
            json.pop();
        }

        let mut out = self.gen.generate(
            sreq.mode,
            &sreq.context,
            &sreq.prefill,
            sreq.max_tokens,
            &sreq.stop,
        );
        if sreq.instruction {
            instruction_reply(&mut out, &sreq.prefill, self.cfg.instruction_echo_tokens);
        }
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut reply = Reply::new(
            &sreq,
            out,
            self.id_counter.fetch_add(1, Ordering::Relaxed),
            created,
        );
        let (cached, _) = lock(&self.kv).admit(&format!(
            "{}{}{}",
            sreq.tools_text,
            normalize(&sreq.context),
            sreq.prefill
        ));
        // Tool definitions count toward what the cache holds, not toward `prompt_tokens`.
        let cached = cached.min(sreq.prompt_tokens as usize);
        reply.cached_tokens = cached as u64;
        if let Some(n) = faults.truncate_after {
            reply.truncate(n);
        }
        if let Some(n) = faults.refuse_after {
            reply.refuse(n);
        }
        let uncached = (sreq.prompt_tokens as usize).saturating_sub(cached);
        self.counters
            .prefill_tokens
            .fetch_add(uncached as u64, Ordering::Relaxed);

        let run = Generation {
            server: self.clone(),
            renderer: Renderer::new(shape),
            reply,
            faults,
            uncached,
            arrived,
        };
        if sreq.stream && !run.faults.ignore_stream {
            Ok(run.stream())
        } else {
            run.whole().await
        }
    }
}

/// One generation being acted out.
struct Generation {
    server: Arc<SimServer>,
    /// Writes the reply in the request's protocol or dialect.
    renderer: Renderer,
    reply: Reply,
    faults: RequestFaults,
    uncached: usize,
    arrived: Instant,
}

/// Holds a capacity slot and the running gauge for the life of a generation.
struct Slot<'a> {
    _permit: tokio::sync::SemaphorePermit<'a>,
    server: &'a SimServer,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.server.counters.running.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Generation {
    async fn acquire(&self) -> Option<Slot<'_>> {
        self.server.acquire().await
    }

    /// Time to first token from now (the slot is held), in ms.
    fn ttft_ms(&self) -> f64 {
        self.server.draw_ttft_ms(self.uncached, &self.faults)
    }

    fn gap(&self) -> Duration {
        let running = self.server.counters.running.load(Ordering::Relaxed).max(0) as u32;
        let mut rng = lock(&self.server.rng);
        Duration::from_secs_f64(
            draw_gap_ms(&self.server.cfg, &mut rng, running, self.faults.gap_factor) / 1000.0,
        )
    }

    /// Non-streaming: the whole body after the whole generation time.
    async fn whole(self) -> Result<Response<Body>, io::Error> {
        let slot = self.acquire().await;
        let ttft = Duration::from_secs_f64(self.ttft_ms() / 1000.0);
        sleep_unless_zero(ttft).await;
        self.server
            .record_ttft(self.arrived.elapsed().as_secs_f64());
        let mut total = Duration::ZERO;
        for i in 0..self.reply.pieces.len() {
            if let Some((after, ms)) = self.faults.stall {
                if after == i as u64 {
                    total += Duration::from_millis(ms.unwrap_or(24 * 3600 * 1000));
                }
            }
            if self.faults.close_after == Some(i as u64) {
                tokio::time::sleep(total).await;
                self.server.counters.errors.fetch_add(1, Ordering::Relaxed);
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "sim fault: close",
                ));
            }
            total += self.gap();
        }
        sleep_unless_zero(total).await;
        drop(slot);
        let body = self.renderer.whole(&self.reply);
        if self.faults.malformed_after.is_some() {
            self.server.counters.errors.fetch_add(1, Ordering::Relaxed);
            let cut = body.len() / 2;
            return Ok(bytes_response(
                StatusCode::OK,
                "application/json",
                Bytes::from(body[..cut].to_vec()),
            ));
        }
        self.server
            .counters
            .completed
            .fetch_add(1, Ordering::Relaxed);
        self.server
            .counters
            .tokens_sent
            .fetch_add(self.reply.completion_tokens, Ordering::Relaxed);
        Ok(bytes_response(
            StatusCode::OK,
            "application/json",
            Bytes::from(body),
        ))
    }

    /// Streaming: headers now, events from a task that notices when the client goes away.
    fn stream(self) -> Response<Body> {
        let content_type = self.renderer.stream_content_type();
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, io::Error>>(16);
        tokio::spawn(async move {
            let server = self.server.clone();
            let finished = self.pump(&tx).await;
            if !finished {
                server.counters.cancelled.fetch_add(1, Ordering::Relaxed);
            }
        });
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        let mut resp = Response::new(StreamBody::new(stream).boxed());
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, header_value(content_type));
        h.insert(header::CACHE_CONTROL, header_value("no-cache"));
        resp
    }

    /// Sends the stream; false when the client went away first.
    async fn pump(mut self, tx: &mpsc::Sender<Result<Frame<Bytes>, io::Error>>) -> bool {
        let send = |bytes: Vec<u8>| async move {
            tx.send(Ok(Frame::data(Bytes::from(bytes)))).await.is_ok()
        };
        let wait = |d: Duration| async move {
            if d.is_zero() {
                // tokio's timer has millisecond resolution: a zero sleep would still cost ~1 ms.
                return !tx.is_closed();
            }
            tokio::select! {
                _ = tokio::time::sleep(d) => true,
                _ = tx.closed() => false,
            }
        };
        let slot = tokio::select! {
            s = self.server.acquire() => s,
            _ = tx.closed() => return false,
        };
        if !wait(Duration::from_secs_f64(self.ttft_ms() / 1000.0)).await {
            return false;
        }
        self.server
            .record_ttft(self.arrived.elapsed().as_secs_f64());
        let mut head: Vec<u8> = self.renderer.head(&self.reply);
        for (index, piece) in self.reply.pieces.iter().enumerate() {
            let i = index as u64;
            if i > 0 && !wait(self.gap()).await {
                return false;
            }
            if let Some((after, ms)) = self.faults.stall {
                if after == i && !wait(Duration::from_millis(ms.unwrap_or(24 * 3600 * 1000))).await
                {
                    return false;
                }
            }
            if self.faults.close_after == Some(i) {
                self.server.counters.errors.fetch_add(1, Ordering::Relaxed);
                let _ = tx
                    .send(Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "sim fault: close",
                    )))
                    .await;
                return true;
            }
            if self.faults.malformed_after == Some(i) && !send(self.renderer.malformed()).await {
                return false;
            }
            if let Some((after, status)) = self.faults.stream_error {
                if after == i {
                    self.server.counters.errors.fetch_add(1, Ordering::Relaxed);
                    let mut bytes = std::mem::take(&mut head);
                    bytes.extend(self.renderer.stream_error(status));
                    return send(bytes).await;
                }
            }
            let mut bytes = std::mem::take(&mut head);
            bytes.extend(self.renderer.piece(&self.reply, index, piece));
            if !bytes.is_empty() && !send(bytes).await {
                return false;
            }
            self.server
                .counters
                .tokens_sent
                .fetch_add(1, Ordering::Relaxed);
        }
        if self.reply.pieces.is_empty()
            && !head.is_empty()
            && !send(std::mem::take(&mut head)).await
        {
            return false;
        }
        if let Some((after, ms)) = self.faults.stall {
            if after >= self.reply.pieces.len() as u64
                && !wait(Duration::from_millis(ms.unwrap_or(24 * 3600 * 1000))).await
            {
                return false;
            }
        }
        if let Some((after, status)) = self.faults.stream_error {
            if after >= self.reply.pieces.len() as u64 {
                self.server.counters.errors.fetch_add(1, Ordering::Relaxed);
                return send(self.renderer.stream_error(status)).await;
            }
        }
        drop(slot);
        let tail: Vec<u8> = self.renderer.tail(&self.reply);
        if !send(tail).await {
            return false;
        }
        self.server
            .counters
            .completed
            .fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Sleeps, except for zero durations (tokio's timer would round them up to a millisecond).
async fn sleep_unless_zero(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these short locks cannot leave the data inconsistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn header_value(s: &str) -> http::HeaderValue {
    http::HeaderValue::from_str(s).unwrap_or_else(|_| http::HeaderValue::from_static("invalid"))
}

fn bytes_response(status: StatusCode, content_type: &str, body: Bytes) -> Response<Body> {
    let mut resp = Response::new(
        Full::new(body)
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, header_value(content_type));
    resp
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    bytes_response(status, "application/json", Bytes::from(v.to_string()))
}

fn text_response(s: String) -> Response<Body> {
    bytes_response(StatusCode::OK, "text/plain; version=0.0.4", Bytes::from(s))
}

/// A running server.
pub struct ServerHandle {
    pub name: String,
    pub addr: SocketAddr,
    pub state: Arc<SimServer>,
    shutdown: watch::Sender<bool>,
}

impl ServerHandle {
    /// Base URL as the OpenAI SDK takes it (`…/v1`).
    pub fn openai_base(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Base URL as the Anthropic SDK takes it (no `/v1`).
    pub fn anthropic_base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting and drops every open connection at once (a crash, as seen by clients).
    pub fn kill(&self) {
        let _ = self.shutdown.send(true);
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

/// Connections a simulated server's kernel queue holds before it accepts them: uvicorn's
/// default, which vLLM and SGLang serve with. The runtime's own `bind` gives 128, which a
/// burst of new connections from a gateway overflowed (dropped SYNs, retried a second later).
const BACKLOG: u32 = 2048;

/// Listens on `addr` with [`BACKLOG`].
fn listen(addr: std::net::SocketAddr) -> io::Result<TcpListener> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Starts one server on 127.0.0.1 (`cfg.port`, 0 for any free port).
///
/// A `refuse` fault acts out a process restart: the listener closes and every open connection
/// is dropped (so connecting gets ECONNREFUSED), and when it ends the server listens again on
/// the same address.
pub async fn start(cfg: ServerConfig, generation: GenerationConfig) -> io::Result<ServerHandle> {
    let listener = listen(std::net::SocketAddr::from(([127, 0, 0, 1], cfg.port)))?;
    let addr = listener.local_addr()?;
    let name = cfg.name.clone();
    let state = SimServer::new(cfg, generation);
    let (shutdown, mut stop) = watch::channel(false);
    // Bumped to drop every open connection (a restart).
    let (restarts, _) = watch::channel(0u64);
    let served = state.clone();
    tokio::spawn(async move {
        let mut listener = Some(listener);
        loop {
            let Some(l) = listener.as_ref() else {
                // Refusing: wait until the refusal ends (or is extended or cleared).
                match served.refusing() {
                    Some(until) => {
                        tokio::select! {
                            _ = tokio::time::sleep_until(until.into()) => {}
                            _ = served.refuse_changed.notified() => {}
                            _ = stop.changed() => return,
                        }
                    }
                    None => match listen(addr) {
                        Ok(l) => listener = Some(l),
                        Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                    },
                }
                continue;
            };
            let accepted = tokio::select! {
                a = l.accept() => a,
                _ = served.refuse_changed.notified() => {
                    if served.refusing().is_some() {
                        listener = None;
                        restarts.send_modify(|n| *n += 1);
                    }
                    continue;
                }
                _ = stop.changed() => return,
            };
            let Ok((tcp, _)) = accepted else { continue };
            let _ = tcp.set_nodelay(true);
            let server = served.clone();
            let mut stop_conn = stop.clone();
            let mut restart_conn = restarts.subscribe();
            let open = served.connection_opened();
            tokio::spawn(async move {
                let _open = open;
                let svc = hyper::service::service_fn(move |req| server.clone().handle(req));
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                let conn = builder.serve_connection(TokioIo::new(tcp), svc);
                tokio::select! {
                    _ = conn => {}
                    _ = stop_conn.changed() => {}
                    _ = restart_conn.changed() => {}
                }
            });
        }
    });
    Ok(ServerHandle {
        name,
        addr,
        state,
        shutdown,
    })
}

/// Shapes the continuation of a cut-off answer (`prefill`) that a request in keel's
/// `instruction` mode asked for, as a real model tends to write it: a new message, so its first
/// word has no leading space, and it repeats the answer's last few tokens (0 to `max_echo`,
/// drawn from the answer's text) before going on.
pub fn instruction_reply(out: &mut crate::text::Output, prefill: &str, max_echo: u32) {
    let toks = keel_core::tokens::split(prefill);
    let k = (keel_core::rng::hash_bytes(0x6563_686f, prefill.as_bytes()) % (max_echo as u64 + 1))
        as usize;
    let k = k.min(toks.len());
    let mut pieces: Vec<String> = toks[toks.len() - k..]
        .iter()
        .map(|t| t.to_string())
        .collect();
    pieces.append(&mut out.pieces);
    if let Some(first) = pieces.first_mut() {
        *first = first.trim_start().to_owned();
    }
    out.pieces = pieces;
}
