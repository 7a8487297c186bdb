//! One simulated model server: a real HTTP/1.1 + HTTP/2 server on loopback.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/messages`,
//! `POST /v1/messages/count_tokens`, `POST /v1/embeddings` (see [`crate::embeddings`]), `GET /v1/models`, `GET /metrics` (vLLM metric names),
//! `GET|POST|DELETE /sim/faults`, `GET /sim/stats`, `GET /health`.
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
        }
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

    /// The 400 a real server gives a prompt longer than its context window, in its protocol's
    /// words (see `ServerConfig::context_window`).
    fn context_exceeded(
        &self,
        protocol: Protocol,
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
    fn unknown_model(&self, protocol: Protocol, model: &str) -> Option<Response<Body>> {
        if self.cfg.models.is_empty() || self.cfg.models.iter().any(|m| m == model) {
            return None;
        }
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        Some(self.protocol_error(
            protocol,
            404,
            &format!("The model `{model}` does not exist."),
        ))
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
        if let Some(resp) = self.unknown_model(protocol, model) {
            return Ok(resp);
        }
        let mut faults = self.resolve_faults();
        if let Some(answer) = self.fault_answer(protocol, &mut faults).await {
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
        protocol: Protocol,
        faults: &mut RequestFaults,
    ) -> Option<Result<Response<Body>, io::Error>> {
        if faults.loading {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return Some(Ok(self.protocol_error(protocol, 503, "Loading model")));
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
            let mut resp =
                self.protocol_error(protocol, status, &format!("sim fault: HTTP {status}"));
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
        let mut sreq = match parse_request(endpoint, &body, self.cfg.assistant_prefill) {
            Ok(r) => r,
            Err(m) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                return Ok(self.protocol_error(protocol, 400, &m));
            }
        };
        if let Some(resp) = self.unknown_model(protocol, &sreq.model) {
            return Ok(resp);
        }
        if self.cfg.refuse_prefill && sreq.ends_with_assistant {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return Ok(self.protocol_error(
                protocol,
                400,
                keel_core::continuation::PREFILL_REFUSAL,
            ));
        }
        if let Some(resp) = self.context_exceeded(protocol, endpoint, &sreq) {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            return Ok(resp);
        }
        if endpoint == Endpoint::CountTokens {
            self.counters.completed.fetch_add(1, Ordering::Relaxed);
            return Ok(json_response(StatusCode::OK, &count_tokens_body(&sreq)));
        }

        let mut faults = self.resolve_faults();
        if let Some(answer) = self.fault_answer(protocol, &mut faults).await {
            return answer;
        }
        let asked_json = sreq.structured.is_some();
        if let (Some(answer), None) = (&self.cfg.answer, &sreq.tool_call) {
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
        let uncached = (sreq.prompt_tokens as usize).saturating_sub(cached);
        self.counters
            .prefill_tokens
            .fetch_add(uncached as u64, Ordering::Relaxed);

        let run = Generation {
            server: self.clone(),
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
        let body = self.reply.body().to_string();
        if self.faults.malformed_after.is_some() {
            self.server.counters.errors.fetch_add(1, Ordering::Relaxed);
            let cut = body.len() / 2;
            return Ok(bytes_response(
                StatusCode::OK,
                "application/json",
                Bytes::from(body[..cut].to_owned()),
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
        h.insert(
            header::CONTENT_TYPE,
            header_value("text/event-stream; charset=utf-8"),
        );
        h.insert(header::CACHE_CONTROL, header_value("no-cache"));
        resp
    }

    /// Sends the stream; false when the client went away first.
    async fn pump(self, tx: &mpsc::Sender<Result<Frame<Bytes>, io::Error>>) -> bool {
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
            s = self.acquire() => s,
            _ = tx.closed() => return false,
        };
        if !wait(Duration::from_secs_f64(self.ttft_ms() / 1000.0)).await {
            return false;
        }
        self.server
            .record_ttft(self.arrived.elapsed().as_secs_f64());
        let mut head: Vec<u8> = self
            .reply
            .stream_head()
            .into_iter()
            .flat_map(|e| e.raw)
            .collect();
        for (i, piece) in self.reply.pieces.iter().enumerate() {
            let i = i as u64;
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
            if self.faults.malformed_after == Some(i)
                && !send(b"data: {\"choices\": [{\"delta\": \n\n".to_vec()).await
            {
                return false;
            }
            let mut bytes = std::mem::take(&mut head);
            bytes.extend_from_slice(&self.reply.stream_piece(piece).raw);
            if !send(bytes).await {
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
        drop(slot);
        let tail: Vec<u8> = self
            .reply
            .stream_tail()
            .into_iter()
            .flat_map(|e| e.raw)
            .collect();
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
            tokio::spawn(async move {
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
