//! Prometheus metrics. Names and labels:
//!
//! | metric | labels | meaning |
//! |---|---|---|
//! | `keel_requests_total` | pool, endpoint, route, outcome | every accepted request, once, when it ends |
//! | `keel_request_duration_seconds` | pool, endpoint, outcome | entry to last byte |
//! | `keel_ttft_seconds` | pool, endpoint | entry to the first byte of a successful response |
//! | `keel_attempts_total` | pool, variant, outcome | every upstream attempt (`ok`, `status_503`, `connect_error`, …) |
//! | `keel_retry_budget_exhausted_total` | pool | retries refused by the fleet-wide budget |
//! | `keel_variant_credential_broken_total` | pool, variant | upstream 401/403 answers |
//! | `keel_requests_in_flight` | | requests being served now |
//!
//! `outcome` is one of `ok`, `client_error` (4xx), `error` (keel could not serve: 5xx),
//! `incomplete` (a stream that failed after its first byte), `cancelled` (client went away).

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

/// Installs the process-wide recorder once and returns its handle (None if another recorder
/// was installed first, e.g. by an embedding program).
pub fn handle() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .ok()?
                .install_recorder()
                .ok()
        })
        .as_ref()
}

/// The exposition text.
pub fn render() -> String {
    handle().map(|h| h.render()).unwrap_or_default()
}
