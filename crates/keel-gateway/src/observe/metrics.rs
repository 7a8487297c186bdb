//! Prometheus metrics, one registry per gateway instance (not a process-global recorder): two
//! gateways in one process (tests, an embedding program) each count only their own requests, so
//! tests can assert exact values. Names and labels:
//!
//! | metric | labels | meaning |
//! |---|---|---|
//! | `keel_requests_total` | pool, endpoint, route, outcome | every accepted request, once, when it ends |
//! | `keel_request_duration_seconds` | pool, endpoint, outcome | entry to last byte |
//! | `keel_ttft_seconds` | pool, endpoint | entry to the first byte of a successful response |
//! | `keel_attempts_total` | pool, variant, kind, outcome | every upstream attempt, once, when it ends (`ok`, `status_503`, `connect_error`, `stall`, …); kind = `first`, `fallback`, `hedge`, `continuation`, `probe`, `warmup` |
//! | `keel_retry_budget_exhausted_total` | pool | retries (fallbacks, continuations) refused by the fleet-wide budget |
//! | `keel_variant_credential_broken_total` | pool, variant | upstream 401/403 answers to keel's own requests (the credential marked broken) |
//! | `keel_variant_credential_unconfirmed_total` | pool, variant | upstream 401/403 answers to client requests (failed over; keel's own request confirms or clears) |
//! | `keel_migrations_total` | pool, reason, outcome | continuations after the first byte |
//! | `keel_hedges_total` | pool, outcome | hedges started (`won`, `lost`, `failed`), or not (`withheld`: would not pay; `deferred`: to 1.5 delays, the budget's reserve kept; `over_budget`; `no_variant`) |
//! | `keel_queue_wait_seconds` | pool | time a served request waited in the line of a full pool |
//! | `keel_queue_refused_total` | pool, reason | requests the line refused: `full`, `displaced` (429), `deadline`, `timeout` (503) |
//! | `keel_queue_depth` | pool, priority | requests waiting in the line now, by `x-keel-priority` |
//! | `keel_decision_duration_seconds` | pool | one selection |
//! | `keel_prompt_fixes_total` | pool, fix | prompt normalization's fixes, by code (`quotes_ascii`, `invisible_removed`, …, `opt_out`) |
//! | `keel_prompt_repair_bytes_total` | pool | bytes `full` normalization's JSON-example repair examined (its work, counted against a budget per request) |
//! | `keel_prompt_repair_exhausted_total` | pool | requests whose JSON-example repair ran out of its budget (the examples left were forwarded as sent) |
//! | `keel_bpe_texts_total` | pool, count | long prompt texts (512 bytes and up) a pool with a BPE tokenizer estimated: `counted`, or `kept` (the count of the same text from an earlier request, found by its hash) |
//! | `keel_guard_findings_total` | pool, entity, action, direction | what the PII and secret guard found (`email`, `card`, `secret`, an operator pattern's name …) and did (`detect`, `mask`, `redact`, `block`), `direction` `request` or `answer`; types and counts only |
//! | `keel_overhead_seconds` | pool, endpoint | keel's own time per generation request: arrival to response head, upstream waits excluded (`x-keel-overhead-us`) |
//! | `keel_health_state` | pool | the pool's health colour: 0 green, 1 yellow, 2 red (see `safe_mode`) |
//! | `keel_safe_mode` | pool | 1 while the pool is in safe mode |
//! | `keel_requests_in_flight` | | requests being served now |
//! | `keel_client_write_timeouts_total` | protocol | requests (HTTP/1.1: connections, HTTP/2: streams or connections) dropped because the client took no response bytes for `client_write_timeout_ms` |
//! | `keel_tls_handshake_failures_total` | reason | inbound TLS handshakes that failed: `refused` (no or a wrong client certificate, a client not speaking TLS), `timeout` (none within `header_read_timeout_ms`) |
//! | `keel_connections_open` | | client connections open now |
//! | `keel_connections_refused_total` | | client connections answered 503 and closed because `max_connections` were open |
//! | `keel_ratelimited_total` | key, kind | keyed requests refused by a limit (`requests`, `tokens`, `concurrency`, `budget`) |
//! | `keel_tokens_total` | key, direction | tokens a key's requests used (`input`, `output`), at reconciliation |
//! | `keel_spend_total` | key | USD a key's requests cost (a gauge that only grows: Prometheus counters are integers here) |
//! | `keel_quota_store_errors_total` | op | shared quota store (Redis) calls that failed or timed out (`take`, `adjust`, `reserve`, `settle`, `acquire`, `release`, `renew`, `usage`; see `[quota] fail_mode`) |
//! | `keel_signals_published_total` | kind | variant signals this replica published to the others through Redis (`eject`, `cooldown`, `limit`, `recovered`; see `signals`) |
//! | `keel_signals_applied_total` | kind | other replicas' signals this replica applied |
//! | `keel_log_lines_dropped_total` | — | access-log and log lines dropped because the log writer's queue was full (stdout or the log file stopped taking lines); the process's count, as of the scrape |
//! | `keel_upstream_connections` | pool, variant | connections open now to a variant with `max_connections` (busy or idle; never above the cap; see `upstream::direct`) |
//! | `keel_upstream_connections_opened_total` | pool | connections keel's own HTTP/1.1 pool opened to the pool's plain-`http://` variants (see `upstream`); growing with requests rather than with concurrency means connections are not reused |
//! | `keel_upstream_token_fetches_total` | pool, variant | OAuth tokens fetched for a Vertex AI variant's service account (`credentials_file`); one per token lifetime once warm, refreshed in the background before expiry, never on a request's path |
//! | `keel_maintenance_requests_total` | pool, variant, kind, outcome | keel's own requests to a variant: kind = `probe`, `warmup`, `refresh`, `health`, `confirm` |
//! | `keel_resume_learned_total` | pool, variant | variants found to refuse assistant prefill (they continue in `instruction` mode from then on) |
//! | `keel_variant_weight` | pool, variant | the variant's routing weight now (health × configured weight) |
//! | `keel_variant_ttft_seconds` | pool, variant | its smoothed TTFT estimate |
//! | `keel_variant_gap_seconds` | pool, variant | its decode pace: the smoothed mean inter-token gap, which selection prices against the fastest variant's |
//! | `keel_variant_tgsv_seconds` | pool, variant | its inter-token gap spread (TGSV) |
//! | `keel_variant_inflight` | pool, variant | its requests in flight |
//! | `keel_variant_state` | pool, variant | 0 healthy, 1 slow start, 2 warming, 3 ejected |
//! | `keel_shadow_requests_total` | pool, variant, outcome | shadow copies: `compared`, `failed`, `skipped` (bounds reached) |
//! | `keel_shadow_similarity` | pool, variant | mean similarity of the shadow variant's answers with the served ones (0..1) |
//! | `keel_shadow_latency_delta_seconds` | pool, variant | mean whole-answer time of the shadow copy minus the served request's |
//! | `keel_canary_requests_total` | pool, side | requests put on the canary's `stable` or `candidate` side |
//! | `keel_canary_fallbacks_total` | pool, side | requests whose side had no variant able to serve (served by the other side) |
//! | `keel_canary_transitions_total` | pool, to | canary moves: `advanced`, `promoted`, `rolled_back` |
//! | `keel_canary_weight_percent` | pool | the candidate's weight now, percent |

//! | `keel_config_reloads_total` | outcome | config reloads: `ok`, `invalid`, `refused` (a change that needs a restart), `unavailable` (no file) (see `live`) |

//! | `keel_integrity_total` | pool, issue, action | output integrity events: issue = `truncated`, `invalid_json`; action = `continued`, `retried`, `flagged` (see `relay::integrity`) |
//! | `keel_consensus_total` | pool, result | consensus requests by result: `unanimous`, `split`, `no_valid_answer` (see `consensus`) |

//! | `keel_cache_lookups_total` | pool, result | response cache lookups: `hit`, `semantic_hit`, `coalesced` (answered by an identical request in flight: its stored answer, or its stream followed live), `miss`, `bypass` (not cacheable by policy, or `x-keel-cache`/`cache-control` said so) |
//! | `keel_cache_stored_total` | pool | answers stored in the response cache |
//! | `keel_fingerprinted_requests_total` | pool | generation requests fingerprinted for workload analysis (pools with `fingerprint = true`: cache keys and a template id in the access line, see `analysis`) |
//! | `keel_cache_skipped_total` | reason | answers not stored: `incomplete` (error, truncated, client gone), `invalid` (no finish reason, structured output off its schema), `too_large` |
//! | `keel_cache_bytes` |  | bytes held by the in-process response cache |
//! | `keel_cache_evictions_total` | cause | in-process cache entries evicted: `size` (over `[cache] max_bytes`), `expired` (TTL) |
//! | `keel_cache_errors_total` | op | response cache store calls that failed or timed out (`get`, `set`, `semantic_index`, `semantic_scan` on Redis; `decode`, `encode`); the request goes on as a miss |
//! | `keel_cache_semantic_distance` | pool | summary: cosine distance of semantic-mode hits |
//!
//! `outcome` of a request is one of `ok`, `client_error` (4xx), `error` (keel could not serve:
//! 5xx), `incomplete` (a stream that failed after its first byte), `cancelled` (client went away),
//! `client_write_timeout` (the client took no response bytes for `client_write_timeout_ms`).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Arc;

use arc_swap::ArcSwap;
use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

static META: Metadata<'static> = Metadata::new("keel", Level::INFO, Some("keel_gateway"));

/// One gateway's metrics registry.
pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    counters: Handles<Counter>,
    gauges: Handles<Gauge>,
    histograms: Handles<Histogram>,
    /// `keel_requests_in_flight`, moved twice a request: held rather than looked up.
    in_flight: Gauge,
    /// The last minutes of requests (route mix, TTFT percentiles) for the dashboard.
    pub recent: crate::observe::window::Recent,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

fn key(name: &'static str, labels: &[(&'static str, &str)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::new(*k, v.to_string()))
        .collect();
    Key::from_parts(name, labels)
}

/// Handles already registered, by metric name and label values. The registry's own lookup
/// builds a `Key` (a `String` for every label value) and compares it under a shard's lock; here
/// the values are hashed and compared where they lie. Seven metrics are recorded on every
/// request, and their lookups were 2% of keel's CPU per streamed request. Read without a lock;
/// a combination seen for the first time copies the map (label values come from small sets:
/// pools, variants, endpoints, outcomes, keys), which the registry keeps for the process's
/// life too, so the two hold the same series. (That holds because no idle timeout is set on the
/// recorder: one that removed idle series would leave handles here recording into removed ones.)
struct Handles<H> {
    hasher: foldhash::fast::RandomState,
    by_hash: ArcSwap<HashMap<u64, Vec<Registered<H>>, BuildHasherDefault<Prehashed>>>,
}

/// The map of [`Handles`] is keyed by a hash already taken: it is its own hash (the map's
/// default, SipHash, hashed it again on every lookup).
#[derive(Default)]
struct Prehashed(u64);

impl std::hash::Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed here; any other input is folded in rather than lost.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[derive(Clone)]
struct Registered<H> {
    name: &'static str,
    labels: Box<[(&'static str, Box<str>)]>,
    handle: H,
}

/// Two `'static` names: the same literal (the usual case, decided without reading them), or
/// equal text.
fn same_name(a: &'static str, b: &'static str) -> bool {
    std::ptr::eq(a, b) || a == b
}

impl<H> Registered<H> {
    fn is(&self, name: &'static str, labels: &[(&'static str, &str)]) -> bool {
        same_name(self.name, name)
            && self.labels.len() == labels.len()
            && self
                .labels
                .iter()
                .zip(labels)
                .all(|((k, v), (key, value))| same_name(k, key) && **v == **value)
    }
}

impl<H> Default for Handles<H> {
    fn default() -> Self {
        Handles {
            hasher: Default::default(),
            by_hash: Default::default(),
        }
    }
}

impl<H: Clone> Handles<H> {
    /// A lookup's hash. The metric's name and the label keys are `'static` literals: their
    /// addresses stand for them (hashing their text was most of a lookup, which ran seven times
    /// a request). A name reached through another copy of its literal hashes elsewhere and is
    /// registered there too: the registry hands back the same series, so it only costs an entry.
    /// Label values are hashed as text; `is` settles any collision.
    fn hash(&self, name: &'static str, labels: &[(&'static str, &str)]) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = self.hasher.build_hasher();
        h.write_usize(name.as_ptr() as usize);
        for (k, v) in labels {
            h.write_usize(k.as_ptr() as usize);
            h.write(v.as_bytes());
        }
        h.finish()
    }

    fn get(
        &self,
        name: &'static str,
        labels: &[(&'static str, &str)],
        register: impl FnOnce() -> H,
    ) -> H {
        let hash = self.hash(name, labels);
        if let Some(known) = self
            .by_hash
            .load()
            .get(&hash)
            .and_then(|same_hash| same_hash.iter().find(|r| r.is(name, labels)))
        {
            return known.handle.clone();
        }
        let handle = register();
        let entry = Registered {
            name,
            labels: labels.iter().map(|(k, v)| (*k, Box::from(*v))).collect(),
            handle: handle.clone(),
        };
        self.by_hash.rcu(|map| {
            let mut map = HashMap::clone(map);
            let same_hash = map.entry(hash).or_default();
            if !same_hash.iter().any(|r| r.is(name, labels)) {
                same_hash.push(entry.clone());
            }
            map
        });
        handle
    }
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        let builder = PrometheusBuilder::new();
        let builder = match builder
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        {
            Ok(b) => b,
            // Only an empty bucket list is refused; ours is a constant.
            Err(_) => PrometheusBuilder::new(),
        };
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        // The registry hands any later lookup of the same series this same gauge.
        let in_flight = recorder.register_gauge(&key("keel_requests_in_flight", &[]), &META);
        Arc::new(Metrics {
            recorder,
            handle,
            counters: Handles::default(),
            gauges: Handles::default(),
            histograms: Handles::default(),
            in_flight,
            recent: Default::default(),
        })
    }

    pub fn counter(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Counter {
        self.counters.get(name, labels, || {
            self.recorder.register_counter(&key(name, labels), &META)
        })
    }

    pub fn gauge(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Gauge {
        self.gauges.get(name, labels, || {
            self.recorder.register_gauge(&key(name, labels), &META)
        })
    }

    pub fn histogram(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Histogram {
        self.histograms.get(name, labels, || {
            self.recorder.register_histogram(&key(name, labels), &META)
        })
    }

    /// `keel_requests_in_flight`: requests admitted and not yet ended.
    pub fn requests_in_flight(&self) -> &Gauge {
        &self.in_flight
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        self.handle.render()
    }

    /// Drains histogram buffers; the monitor calls it periodically so that memory stays flat
    /// when nobody scrapes.
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_registries_count_separately() {
        let a = Metrics::new();
        let b = Metrics::new();
        a.counter("keel_x_total", &[("pool", "p")]).increment(2);
        b.counter("keel_x_total", &[("pool", "p")]).increment(5);
        assert!(a.render().contains("keel_x_total{pool=\"p\"} 2\n"));
        assert!(b.render().contains("keel_x_total{pool=\"p\"} 5\n"));
    }

    #[test]
    fn handles_found_again_record_into_their_own_series() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.counter("keel_x_total", &[("pool", "p"), ("outcome", "ok")])
                .increment(1);
        }
        m.counter("keel_x_total", &[("pool", "p"), ("outcome", "error")])
            .increment(10);
        m.counter("keel_x_total", &[("pool", "q"), ("outcome", "ok")])
            .increment(100);
        m.counter("other_total", &[("pool", "p"), ("outcome", "ok")])
            .increment(1000);
        // Same values under other label names: another series.
        m.counter("keel_x_total", &[("pool", "p"), ("result", "ok")])
            .increment(7);
        m.gauge("in_use", &[]).increment(2.0);
        m.gauge("in_use", &[]).decrement(0.5);
        m.histogram("took_seconds", &[("pool", "p")]).record(0.002);
        m.histogram("took_seconds", &[("pool", "p")]).record(0.02);
        let text = m.render();
        for line in [
            "keel_x_total{pool=\"p\",outcome=\"ok\"} 3\n",
            "keel_x_total{pool=\"p\",outcome=\"error\"} 10\n",
            "keel_x_total{pool=\"q\",outcome=\"ok\"} 100\n",
            "other_total{pool=\"p\",outcome=\"ok\"} 1000\n",
            "keel_x_total{pool=\"p\",result=\"ok\"} 7\n",
            "in_use 1.5\n",
            "took_seconds_count{pool=\"p\"} 2\n",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        assert_eq!(
            m.counters
                .by_hash
                .load()
                .values()
                .map(Vec::len)
                .sum::<usize>(),
            5
        );
    }
}
