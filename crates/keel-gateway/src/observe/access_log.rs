//! The accounting every accepted request gets exactly once, when it ends: the request metrics,
//! one access-log line, and the end of its trace span. A [`RequestLog`] is created at
//! admission and travels with the request (into the relay task for streams); dropping it
//! unfinished still counts the request, as `cancelled` (client gone, task aborted) or
//! `incomplete` (dropped while panicking).
//!
//! The line (see [`AccessLog`] for where it goes) holds what keel decided and measured, never
//! a secret: no header values, no key, no prompt or output, only the key's id and tenant.

use std::fs::OpenOptions;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{Map, Value};
use tokio::time::Instant;

use crate::config::{AccessLogTarget, LogConfig, LogFormat, VariantConfig};
use crate::observe::log_writer::{self, Dest};
use crate::observe::meter::{Meter, Totals};
use crate::observe::metrics::Metrics;
use crate::observe::telemetry::{RequestEnd, RequestSpan};

/// Where access lines are written, and how: by the log writer's thread ([`crate::observe::log_writer`]),
/// never by the request's task.
pub struct AccessLog {
    format: LogFormat,
    out: Option<Dest>,
}

impl AccessLog {
    /// Opens the configured destination (a file is created if needed and appended to).
    pub fn open(cfg: &LogConfig) -> std::io::Result<AccessLog> {
        let out = match &cfg.access {
            AccessLogTarget::Off => None,
            AccessLogTarget::Stdout => Some(Dest::Stdout),
            AccessLogTarget::Stderr => Some(Dest::Stderr),
            AccessLogTarget::File(path) => {
                let f = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| {
                        std::io::Error::new(e.kind(), format!("access log {}: {e}", path.display()))
                    })?;
                Some(Dest::File(Arc::new(f)))
            }
        };
        Ok(AccessLog {
            format: cfg.format,
            out,
        })
    }

    /// No access log.
    pub fn off() -> AccessLog {
        AccessLog {
            format: LogFormat::Json,
            out: None,
        }
    }

    fn enabled(&self) -> bool {
        self.out.is_some()
    }

    /// Queues one line (see [`crate::observe::log_writer`]: never blocks; a line the full queue cannot
    /// take is dropped and counted). A JSON line is serialized straight from the borrowed
    /// fields: built as a map of owned values first, a line would cost a sixth of a fast
    /// stream's instructions (a key and a value allocated per field, a hash per key, the map
    /// dropped).
    fn write(&self, line: &Line<'_>) {
        let Some(out) = &self.out else { return };
        let mut bytes = match self.format {
            LogFormat::Json => {
                let mut bytes = Vec::with_capacity(LINE_CAPACITY);
                if serde_json::to_writer(&mut bytes, line).is_err() {
                    return;
                }
                bytes
            }
            LogFormat::Text => match serde_json::to_value(line) {
                Ok(Value::Object(fields)) => text_line(&fields).into_bytes(),
                _ => return,
            },
        };
        bytes.push(b'\n');
        log_writer::write(out, bytes);
    }
}

/// Room for a typical JSON access line (about 450 bytes; a fingerprinted one, 700).
const LINE_CAPACITY: usize = 768;

/// One access line's fields, in their order on the line; absent values are written as `null`.
#[derive(Serialize)]
struct Line<'a> {
    ts: Timestamp,
    request_id: &'a str,
    tenant: Option<&'a str>,
    key_id: Option<&'a str>,
    api: &'a str,
    pool: &'a str,
    variant: &'a str,
    variants_tried: &'a [String],
    route: &'a str,
    attempts: usize,
    hedges: usize,
    migrations: u32,
    prompt_fixes: &'a [String],
    guard: Option<&'a str>,
    status: u16,
    outcome: &'a str,
    detail: Option<&'a str>,
    ttft_ms: Option<f64>,
    total_ms: f64,
    tokens_in: Option<u64>,
    tokens_out: Option<u64>,
    overhead_us: Option<u64>,
    cache: &'a str,
    cached_from: Option<&'a str>,
    trace_id: Option<String>,
    /// Only for a request its pool fingerprints.
    #[serde(flatten)]
    fingerprint: Option<FingerprintFields<'a>>,
}

/// A fingerprinted request's fields (see `keel_core::analyze`): the key the pool's cache
/// uses, the key before normalization and, where the pool does not normalize, the key
/// `syntax` would give; its template id, its policy facts and the price of what it used.
#[derive(Serialize)]
struct FingerprintFields<'a> {
    cache_key: &'a str,
    cache_key_raw: &'a str,
    cache_key_syntax: Option<&'a str>,
    template: String,
    deterministic: bool,
    temperature: Option<f64>,
    tools: bool,
    spend_usd: Option<f64>,
}

impl<'a> FingerprintFields<'a> {
    fn of(f: &'a keel_core::analyze::Fingerprint, tokens: Option<Totals>) -> Self {
        FingerprintFields {
            cache_key: f.cache_key(),
            cache_key_raw: &f.key_raw,
            cache_key_syntax: (!f.normalizes).then_some(f.key_norm.as_str()),
            template: keel_core::analyze::template_hex(f.template),
            deterministic: f.deterministic,
            temperature: f.temperature,
            tools: f.tools,
            spend_usd: tokens.map(|t| t.spend_micros as f64 / 1e6),
        }
    }
}

/// `request key=value …`: strings bare unless they hold spaces or quotes, lists comma-joined,
/// absent values left out.
fn text_line(fields: &Map<String, Value>) -> String {
    let mut s = String::from("request");
    for (k, v) in fields {
        let v = match v {
            Value::Null => continue,
            Value::String(t) => t.clone(),
            Value::Array(a) => a
                .iter()
                .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_owned))
                .collect::<Vec<_>>()
                .join(","),
            other => other.to_string(),
        };
        if v.contains([' ', '"', '=']) || v.is_empty() {
            s.push_str(&format!(" {k}={v:?}"));
        } else {
            s.push_str(&format!(" {k}={v}"));
        }
    }
    s
}

/// Where a finished request is counted beyond metrics and its line: its pool's health window
/// and, where the pool fingerprints requests, its live analysis (`state::pools::Pool`).
pub trait PoolRecords: Send + Sync {
    /// Counts the request in the pool's health window (see `state::safe_mode`).
    fn request_ended(&self, route: &'static str, outcome: &'static str);
    /// Whether the pool keeps a live analysis of its requests.
    fn analyses(&self) -> bool;
    /// Keeps a fingerprinted request's record in the pool's live analysis.
    fn analyse(&self, record: keel_core::analyze::report::Record);
}

/// What one request leaves in metrics, the log and its trace, recorded once by
/// [`RequestLog::finish`].
pub struct RequestLog {
    /// Where the line goes, and the registry the request is counted in.
    access_log: Arc<AccessLog>,
    pub(crate) metrics: Arc<Metrics>,
    pub id: String,
    pub pool: String,
    /// The API the client called (`chat_completions`, `messages`, `responses`, …).
    pub endpoint: &'static str,
    pub route: &'static str,
    pub variant: String,
    pub attempts: usize,
    /// The variants attempted, in order (hedges and continuations included).
    pub tried: Vec<String>,
    pub hedges: usize,
    /// Mid-stream moves to another variant.
    pub migrations: u32,
    /// `x-keel-prompt-fix` codes: what keel changed in the prompt.
    pub prompt_fixes: Vec<String>,
    /// `x-keel-guard`: what the PII and secret guard found and did, types and counts only.
    pub guard: Option<String>,
    pub started: Instant,
    pub status: u16,
    pub ttft: Option<Duration>,
    /// The client's virtual key id and tenant (`-` when keel runs open or before the key is
    /// known).
    pub key: String,
    pub tenant: String,
    /// The serving variant's model and API, for the trace.
    pub response_model: Option<String>,
    pub provider: Option<&'static str>,
    /// The tokens each attempt used, and keel's estimate of the prompt for attempts whose
    /// upstream reported none.
    pub usage: Option<(Arc<Meter>, u64)>,
    /// Time spent inside keel, upstream waits excluded, when it was measured.
    pub overhead_us: Option<u64>,
    /// The request's span, when tracing is on.
    pub trace: Option<RequestSpan>,
    /// The request's decision record, completed from this log when it finishes.
    pub decision: Option<Arc<crate::observe::decisions::Draft>>,
    /// The pool whose health window counts this request (see `safe_mode`), once known.
    pub health_of: Option<Arc<dyn PoolRecords>>,
    /// What the response cache did (`hit`, `miss`, `stored`, `bypass`; see `cache`).
    pub cache: &'static str,
    /// For a hit: the request whose answer was replayed.
    pub cached_from: Option<String>,
    /// What the line holds of the request's content, where its pool fingerprints: hashes and
    /// flags, never text (see `keel_core::analyze`).
    pub fingerprint: Option<keel_core::analyze::Fingerprint>,
    /// The client's connection or stream: a request it lost to the write timeout ends as
    /// `client_write_timeout` rather than `cancelled` (see `client_write`).
    client: Option<Arc<crate::wire::client_write::ClientWrites>>,
    done: bool,
}

impl RequestLog {
    pub fn new(
        access_log: Arc<AccessLog>,
        metrics: Arc<Metrics>,
        id: &str,
        started: Instant,
        endpoint: &'static str,
        pool: &str,
    ) -> Self {
        metrics.requests_in_flight().increment(1.0);
        RequestLog {
            access_log,
            metrics,
            id: id.to_owned(),
            pool: pool.to_owned(),
            endpoint,
            route: "direct",
            variant: "none".into(),
            attempts: 0,
            tried: Vec::new(),
            hedges: 0,
            migrations: 0,
            prompt_fixes: Vec::new(),
            guard: None,
            started,
            status: 0,
            ttft: None,
            key: "-".into(),
            tenant: "-".into(),
            response_model: None,
            provider: None,
            usage: None,
            overhead_us: None,
            trace: None,
            decision: None,
            health_of: None,
            cache: "bypass",
            cached_from: None,
            fingerprint: None,
            client: crate::wire::client_write::current(),
            done: false,
        }
    }

    /// The variant now serving the request (its name, model and API).
    pub fn serving(&mut self, variant: &VariantConfig) {
        self.variant = variant.name.clone();
        self.response_model = Some(variant.upstream_model.clone());
        self.provider = Some(variant.dialect.name());
    }

    /// Records the request's end: `outcome` is `ok`, `client_error`, `error`, `incomplete` or
    /// `cancelled` (`client_write_timeout` when the client was cut for taking no bytes);
    /// `detail` says why when it is not `ok`.
    pub fn finish(&mut self, outcome: &'static str, detail: Option<&str>) {
        if self.done {
            return;
        }
        self.done = true;
        let (outcome, detail) = match outcome {
            "cancelled" if self.client.as_ref().is_some_and(|c| c.timed_out()) => (
                "client_write_timeout",
                Some("the client took no response bytes for client_write_timeout_ms"),
            ),
            _ => (outcome, detail),
        };
        let elapsed = self.started.elapsed();
        self.count(outcome, elapsed);
        if let Some(p) = &self.health_of {
            p.request_ended(self.route, outcome);
        }
        if let Some(d) = self.decision.take() {
            if self.overhead_us.is_none() {
                // Stamped on the response head already, or (a whole answer assembled from a
                // stream, whose head is built after this) the same measure taken now.
                self.overhead_us = d
                    .overhead_us()
                    .or_else(|| Some(elapsed.saturating_sub(d.upstream_wait()).as_micros() as u64));
            }
            d.finish_request(self, outcome, elapsed);
        }
        let tokens = self
            .usage
            .as_ref()
            .filter(|(m, _)| !m.is_empty())
            .map(|(m, estimate)| m.totals(*estimate));
        // Read before the span ends below: the line ties the request to its trace.
        let trace_id = self
            .trace
            .as_ref()
            .filter(|_| self.access_log.enabled())
            .map(RequestSpan::trace_id);
        if let Some(span) = self.trace.take() {
            span.end(RequestEnd {
                pool: &self.pool,
                route: self.route,
                variant: &self.variant,
                response_model: self.response_model.as_deref(),
                provider: self.provider,
                status: self.status,
                outcome,
                detail,
                attempts: self.attempts,
                hedges: self.hedges,
                migrations: self.migrations,
                ttft: self.ttft,
                tokens: tokens.map(|t| (t.input, t.output)),
            });
        }
        if let (Some(f), Some(p)) = (
            &self.fingerprint,
            self.health_of.as_ref().filter(|p| p.analyses()),
        ) {
            p.analyse(self.record(f, outcome, elapsed, tokens));
        }
        if self.access_log.enabled() {
            self.access_log
                .write(&self.line(outcome, detail, elapsed, tokens, trace_id));
        }
    }

    fn count(&self, outcome: &'static str, elapsed: Duration) {
        let m = &self.metrics;
        // The dashboard's recent route mix and TTFT window.
        m.recent.record(&self.pool, self.route, self.ttft);
        m.requests_in_flight().decrement(1.0);
        let (pool, endpoint) = (self.pool.as_str(), self.endpoint);
        m.counter(
            "keel_requests_total",
            &[
                ("pool", pool),
                ("endpoint", endpoint),
                ("route", self.route),
                ("outcome", outcome),
            ],
        )
        .increment(1);
        m.histogram(
            "keel_request_duration_seconds",
            &[("pool", pool), ("endpoint", endpoint), ("outcome", outcome)],
        )
        .record(elapsed.as_secs_f64());
        if let Some(t) = self.ttft {
            m.histogram(
                "keel_ttft_seconds",
                &[("pool", pool), ("endpoint", endpoint)],
            )
            .record(t.as_secs_f64());
        }
    }

    /// What the live analysis keeps of a fingerprinted request (see `analysis`).
    fn record(
        &self,
        f: &keel_core::analyze::Fingerprint,
        outcome: &str,
        elapsed: Duration,
        tokens: Option<Totals>,
    ) -> keel_core::analyze::report::Record {
        let key64 = |hex: &str| u64::from_str_radix(hex.get(..16).unwrap_or("0"), 16).ok();
        let end_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as i64;
        keel_core::analyze::report::Record {
            pool: self.pool.clone(),
            end_ms,
            total_ms: elapsed.as_secs_f64() * 1000.0,
            ok: self.status == 200 && outcome == "ok",
            key_raw: key64(&f.key_raw),
            key_norm: key64(&f.key_norm),
            template: Some(f.template),
            deterministic: f.deterministic,
            temperature: f.temperature,
            tools: f.tools,
            tokens_in: tokens.map_or(0, |t| t.input),
            tokens_out: tokens.map_or(0, |t| t.output),
            spend_usd: tokens.map_or(0.0, |t| t.spend_micros as f64 / 1e6),
        }
    }

    /// The access line's fields.
    fn line<'a>(
        &'a self,
        outcome: &'a str,
        detail: Option<&'a str>,
        elapsed: Duration,
        tokens: Option<Totals>,
        trace_id: Option<String>,
    ) -> Line<'a> {
        let ms = |d: Duration| (d.as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0;
        let known = |s: &'a str| (s != "-").then_some(s);
        Line {
            ts: Timestamp::now(),
            request_id: &self.id,
            tenant: known(&self.tenant),
            key_id: known(&self.key),
            api: self.endpoint,
            pool: &self.pool,
            variant: &self.variant,
            variants_tried: &self.tried,
            route: self.route,
            attempts: self.attempts,
            hedges: self.hedges,
            migrations: self.migrations,
            prompt_fixes: &self.prompt_fixes,
            guard: self.guard.as_deref(),
            status: self.status,
            outcome,
            detail,
            ttft_ms: self.ttft.map(ms),
            total_ms: ms(elapsed),
            tokens_in: tokens.map(|t| t.input),
            tokens_out: tokens.map(|t| t.output),
            overhead_us: self.overhead_us,
            cache: self.cache,
            cached_from: self.cached_from.as_deref(),
            trace_id,
            fingerprint: self
                .fingerprint
                .as_ref()
                .map(|f| FingerprintFields::of(f, tokens)),
        }
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        // A response dropped before it finished is still counted: a panic that unwinds through
        // the request is keel's failure, anything else is the client going away.
        if std::thread::panicking() {
            self.finish(
                "incomplete",
                Some("internal error: the request's task panicked"),
            );
        } else {
            self.finish("cancelled", Some("response dropped before completion"));
        }
    }
}

/// A time as RFC 3339 UTC with milliseconds (`2025-01-31T12:00:00.123Z`), written digit by
/// digit: `format!` with six padded fields cost more than the rest of the line.
struct Timestamp([u8; 24]);

impl Timestamp {
    fn now() -> Timestamp {
        Timestamp::at(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default(),
        )
    }

    /// The time `since` the Unix epoch (years 0 to 9999).
    fn at(since: Duration) -> Timestamp {
        let secs = since.as_secs();
        let (days, rem) = (secs / 86_400, secs % 86_400);
        let (y, m, d) = keel_core::quota::budget::civil_from_days(days as i64);
        let mut b = *b"0000-00-00T00:00:00.000Z";
        let mut put = |at: usize, width: usize, mut n: u64| {
            for i in (at..at + width).rev() {
                b[i] = b'0' + (n % 10) as u8;
                n /= 10;
            }
        };
        put(0, 4, y.clamp(0, 9999) as u64);
        put(5, 2, m as u64);
        put(8, 2, d as u64);
        put(11, 2, rem / 3600);
        put(14, 2, rem % 3600 / 60);
        put(17, 2, rem % 60);
        put(20, 3, since.subsec_millis() as u64);
        Timestamp(b)
    }

    fn as_str(&self) -> &str {
        // Only ASCII digits and separators are ever written.
        std::str::from_utf8(&self.0).unwrap_or("")
    }
}

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_lines_quote_what_needs_it() {
        let m = match serde_json::json!({"a": "x", "b": "two words", "c": null, "d": ["p", "q"], "e": 3})
        {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        assert_eq!(text_line(&m), r#"request a=x b="two words" d=p,q e=3"#);
    }

    #[test]
    fn timestamps_are_rfc3339_utc_with_milliseconds() {
        let at = |secs: u64, ms: u32| {
            Timestamp::at(Duration::new(secs, ms * 1_000_000))
                .as_str()
                .to_owned()
        };
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(951_782_400 + 86_399, 7), "2000-02-29T23:59:59.007Z");
        assert_eq!(at(1_796_601_600 + 3_723, 450), "2026-12-07T01:02:03.450Z");
        assert_eq!(at(253_402_300_799, 999), "9999-12-31T23:59:59.999Z");
    }
}
