//! The accounting every accepted request gets exactly once, when it ends: the request metrics
//! and one access-log line. A [`RequestLog`] is created at admission and travels with the
//! request (into the relay task for streams); dropping it unfinished still counts the request,
//! as `cancelled` (client gone, task aborted) or `incomplete` (dropped while panicking).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::metrics::Metrics;

/// What one request leaves in metrics and the log, recorded once by [`RequestLog::finish`].
pub struct RequestLog {
    metrics: Arc<Metrics>,
    pub id: String,
    pub pool: String,
    /// The API the client called (`chat_completions`, `messages`, `responses`, …).
    pub endpoint: &'static str,
    pub route: &'static str,
    pub variant: String,
    pub attempts: usize,
    pub started: Instant,
    pub status: u16,
    pub ttft: Option<Duration>,
    /// The client's virtual key id and tenant (`-` when keel runs open or before the key is
    /// known).
    pub key: String,
    pub tenant: String,
    done: bool,
}

impl RequestLog {
    pub fn new(
        metrics: &Arc<Metrics>,
        id: &str,
        started: Instant,
        endpoint: &'static str,
        pool: &str,
    ) -> Self {
        metrics.gauge("keel_requests_in_flight", &[]).increment(1.0);
        RequestLog {
            metrics: metrics.clone(),
            id: id.to_owned(),
            pool: pool.to_owned(),
            endpoint,
            route: "direct",
            variant: "none".into(),
            attempts: 0,
            started,
            status: 0,
            ttft: None,
            key: "-".into(),
            tenant: "-".into(),
            done: false,
        }
    }

    /// Records the request's end: `outcome` is `ok`, `client_error`, `error`, `incomplete` or
    /// `cancelled`; `detail` says why when it is not `ok`.
    pub fn finish(&mut self, outcome: &'static str, detail: Option<&str>) {
        if self.done {
            return;
        }
        self.done = true;
        let m = &self.metrics;
        m.gauge("keel_requests_in_flight", &[]).decrement(1.0);
        let elapsed = self.started.elapsed();
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
        m.recent.record(pool, self.route, self.ttft);
        let ttft_ms = self.ttft.map(|t| t.as_secs_f64() * 1000.0);
        let level_warn = matches!(outcome, "error" | "incomplete");
        macro_rules! log {
            ($lvl:ident) => {
                tracing::$lvl!(
                    request_id = %self.id, tenant = %self.tenant, key = %self.key, pool = %self.pool, endpoint, route = self.route, variant = %self.variant,
                    attempts = self.attempts, status = self.status, outcome, duration_ms = elapsed.as_secs_f64() * 1000.0,
                    ttft_ms, detail = detail.unwrap_or(""), "request"
                )
            };
        }
        if level_warn {
            log!(warn);
        } else {
            log!(info);
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
