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

use serde_json::{json, Map, Value};
use tokio::time::Instant;

use crate::config::{AccessLogTarget, LogConfig, LogFormat, VariantConfig};
use crate::keys::meter::Meter;
use crate::log_writer::{self, Dest};
use crate::settlement::{AttemptKind, Attempts};
use crate::telemetry::{RequestEnd, RequestSpan};
use crate::Gateway;

/// Where access lines are written, and how: by the log writer's thread ([`crate::log_writer`]),
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

    /// Queues one line (see [`crate::log_writer`]: never blocks; a line the full queue cannot
    /// take is dropped and counted).
    fn write(&self, fields: &Map<String, Value>) {
        let Some(out) = &self.out else { return };
        let mut line = match self.format {
            LogFormat::Json => serde_json::to_string(fields).unwrap_or_default(),
            LogFormat::Text => text_line(fields),
        };
        line.push('\n');
        log_writer::write(out, line.into_bytes());
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

/// What one request leaves in metrics, the log and its trace, recorded once by
/// [`RequestLog::finish`].
pub struct RequestLog {
    pub(crate) gw: Arc<Gateway>,
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
    pub decision: Option<Arc<crate::decisions::Draft>>,
    /// The pool whose health window counts this request (see `safe_mode`), once known.
    pub health_of: Option<Arc<crate::pools::Pool>>,
    /// What the response cache did (`hit`, `miss`, `stored`, `bypass`; see `cache`).
    pub cache: &'static str,
    /// For a hit: the request whose answer was replayed.
    pub cached_from: Option<String>,
    /// The client's connection or stream: a request it lost to the write timeout ends as
    /// `client_write_timeout` rather than `cancelled` (see `client_write`).
    client: Option<Arc<crate::client_write::ClientWrites>>,
    done: bool,
}

impl RequestLog {
    pub fn new(
        gw: &Arc<Gateway>,
        id: &str,
        started: Instant,
        endpoint: &'static str,
        pool: &str,
    ) -> Self {
        gw.metrics
            .gauge("keel_requests_in_flight", &[])
            .increment(1.0);
        RequestLog {
            gw: gw.clone(),
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
            client: crate::client_write::current(),
            done: false,
        }
    }

    /// The variant now serving the request (its name, model and API).
    pub fn serving(&mut self, variant: &VariantConfig) {
        self.variant = variant.name.clone();
        self.response_model = Some(variant.upstream_model.clone());
        self.provider = Some(variant.dialect.name());
    }

    /// Takes the attempts' count, order and hedges from the request's ledger.
    pub fn note_attempts(&mut self, attempts: &Attempts) {
        let records = attempts.records();
        self.attempts = records.len();
        self.tried = records.iter().map(|r| r.variant.clone()).collect();
        self.hedges = records
            .iter()
            .filter(|r| r.kind == AttemptKind::Hedge)
            .count();
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
            p.safety.record_request(p.now_ms(), self.route, outcome);
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
            .map(|(m, estimate)| {
                let t = m.totals(*estimate);
                (t.input, t.output)
            });
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
                tokens,
            });
        }
        if self.gw.access_log.enabled() {
            let fields = self.fields(outcome, detail, elapsed, tokens);
            self.gw.access_log.write(&fields);
        }
    }

    fn count(&self, outcome: &'static str, elapsed: Duration) {
        let m = &self.gw.metrics;
        // The dashboard's recent route mix and TTFT window.
        m.recent.record(&self.pool, self.route, self.ttft);
        m.gauge("keel_requests_in_flight", &[]).decrement(1.0);
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

    /// The access line's fields, in a fixed order.
    fn fields(
        &self,
        outcome: &'static str,
        detail: Option<&str>,
        elapsed: Duration,
        tokens: Option<(u64, u64)>,
    ) -> Map<String, Value> {
        let ms = |d: Duration| (d.as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0;
        let known = |s: &str| (s != "-").then(|| s.to_owned());
        let trace_id = self.trace.as_ref().map(RequestSpan::trace_id);
        let v = json!({
            "ts": rfc3339_now(),
            "request_id": self.id,
            "tenant": known(&self.tenant),
            "key_id": known(&self.key),
            "api": self.endpoint,
            "pool": self.pool,
            "variant": self.variant,
            "variants_tried": self.tried,
            "route": self.route,
            "attempts": self.attempts,
            "hedges": self.hedges,
            "migrations": self.migrations,
            "prompt_fixes": self.prompt_fixes,
            "guard": self.guard,
            "status": self.status,
            "outcome": outcome,
            "detail": detail,
            "ttft_ms": self.ttft.map(ms),
            "total_ms": ms(elapsed),
            "tokens_in": tokens.map(|t| t.0),
            "tokens_out": tokens.map(|t| t.1),
            "overhead_us": self.overhead_us,
            "cache": self.cache,
            "cached_from": self.cached_from,
            "trace_id": trace_id,
        });
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
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

/// Now as RFC 3339 UTC with milliseconds (`2025-01-31T12:00:00.123Z`).
fn rfc3339_now() -> String {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_date(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01: count in 400-year eras (146,097 days
/// each), then years of the era from a March-based year (so the leap day ends the year).
fn civil_date(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of era
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the March-based year
    let mp = (5 * doy + 2) / 153; // month from March = 0
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), (1970, 1, 1));
        assert_eq!(civil_date(59), (1970, 3, 1));
        assert_eq!(civil_date(11_016), (2000, 2, 29));
        assert_eq!(civil_date(19_782), (2024, 2, 29));
        assert_eq!(civil_date(20_089), (2025, 1, 1));
    }

    #[test]
    fn text_lines_quote_what_needs_it() {
        let m = match json!({"a": "x", "b": "two words", "c": null, "d": ["p", "q"], "e": 3}) {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        assert_eq!(text_line(&m), r#"request a=x b="two words" d=p,q e=3"#);
    }
}
