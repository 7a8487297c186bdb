//! Decision records: why each request went where it went, kept in a bounded ring and served at
//! `GET /keel/decisions/{request_id}` and `GET /keel/decisions?pool=&variant=&route=&limit=`.
//!
//! A record is started by selection (`selection::DecisionRecord`: the candidates and every
//! factor of their cost, the plan) and completed by the two things that outlive it: the
//! request's attempts (the pipeline's `settlement::Attempts`: every attempt with its timings,
//! hedges, migrations, the time spent waiting on upstreams) and its [`RequestLog`] (route,
//! status, overhead, totals). Both hold one [`Draft`]; whichever lets go last drops it, and the drop
//! pushes the finished record into the ring. The ring takes no lock: a push is one atomic add on
//! the write position and one atomic swap of the slot (every request pushes one, from any
//! thread); a lookup or a query walks the ring from the newest record (an admin's read: a
//! lookup by id compares up to `decisions_kept` ids; measured in a release build, ≈ 0.1 ms to
//! the middle of a full ring of 10,000 and ≈ 0.2 ms to its oldest record). Nothing of the
//! prompt or the output is ever copied into a record.
//!
//! **Memory** (measured with `size_of`, plus the names on the heap): a record is about 590 bytes
//! of fixed fields (canary side, integrity events, consensus votes and the cache's origin
//! included), about 0.8 KiB with its id, names, slot and `Arc`; each candidate adds
//! 240 bytes plus its name (about 0.27 KiB), each attempt 96 bytes plus two strings (about
//! 0.16 KiB). A request over a pool of 4 variants with 2 attempts is about 2 KiB, so the default
//! ring of 10,000 holds about 22 MiB. A record lists at most 16 candidates whatever the pool's
//! size (see `decision_candidates`), so the worst case is about 6 KiB a record, 60 MiB for a
//! full ring.

use crate::observe::record::{HedgeRecord, MigrationRecord};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use http::{HeaderMap, HeaderValue};
use tokio::time::Instant;

use crate::observe::access_log::RequestLog;
use crate::observe::record::DecisionRecord;
use crate::upstream::translation::PROMPT_FIX_HEADER;

/// The response header with keel's own time for the request, in microseconds.
pub const OVERHEAD_HEADER: http::HeaderName = http::HeaderName::from_static("x-keel-overhead-us");

/// The most records one query returns, and how many it returns by default.
pub const QUERY_MAX: usize = 1000;
pub const QUERY_DEFAULT: usize = 100;

/// The bounded ring of finished records: `kept` slots, written in turn.
pub struct DecisionLog {
    slots: Box<[ArcSwapOption<DecisionRecord>]>,
    /// Records pushed so far: the next goes to slot `next % kept`.
    next: AtomicU64,
}

impl DecisionLog {
    pub fn new(kept: usize) -> Self {
        DecisionLog {
            slots: (0..kept.max(1)).map(|_| ArcSwapOption::empty()).collect(),
            next: AtomicU64::new(0),
        }
    }

    /// Keeps a finished record; it replaces the oldest when the ring is full.
    pub fn push(&self, record: DecisionRecord) {
        let at = self.next.fetch_add(1, Ordering::AcqRel) % self.slots.len() as u64;
        self.slots[at as usize].store(Some(Arc::new(record)));
    }

    /// The kept records, newest first. Each slot is visited once; a push that lands meanwhile
    /// shows in its slot's place or not at all.
    fn newest_first(&self) -> impl Iterator<Item = Arc<DecisionRecord>> + '_ {
        let n = self.slots.len() as u64;
        let end = self.next.load(Ordering::Acquire);
        (end.saturating_sub(n)..end)
            .rev()
            .filter_map(move |i| self.slots[(i % n) as usize].load_full())
    }

    /// The record of one request, while it is kept.
    pub fn get(&self, request_id: &str) -> Option<Arc<DecisionRecord>> {
        self.newest_first().find(|r| r.request_id == request_id)
    }

    /// The records matching `q`, newest first.
    pub fn query(&self, q: &Query) -> Vec<Arc<DecisionRecord>> {
        self.newest_first()
            .filter(|r| q.matches(r))
            .take(q.limit)
            .collect()
    }
}

/// `GET /keel/decisions` filters.
#[derive(Debug, Clone, PartialEq)]
pub struct Query {
    pub pool: Option<String>,
    /// Any attempt's variant, or the one that served.
    pub variant: Option<String>,
    pub route: Option<String>,
    pub limit: usize,
}

impl Default for Query {
    /// The latest [`QUERY_DEFAULT`] records.
    fn default() -> Self {
        Query {
            pool: None,
            variant: None,
            route: None,
            limit: QUERY_DEFAULT,
        }
    }
}

impl Query {
    /// Parses a query string; an unknown parameter or a bad limit is the client's error.
    pub fn parse(query: Option<&str>) -> Result<Query, String> {
        let mut q = Query::default();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = crate::wire::routes::percent_decode(&value.replace('+', " "));
            match name {
                "pool" => q.pool = Some(value),
                "variant" => q.variant = Some(value),
                "route" => q.route = Some(value),
                "limit" => {
                    q.limit = value
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=QUERY_MAX).contains(n))
                        .ok_or_else(|| {
                            format!(
                            "limit: expected a whole number from 1 to {QUERY_MAX}, got `{value}`"
                        )
                        })?
                }
                other => {
                    return Err(format!(
                        "unknown query parameter `{other}`; known: pool, variant, route, limit"
                    ))
                }
            }
        }
        Ok(q)
    }

    fn matches(&self, r: &DecisionRecord) -> bool {
        let is = |want: &Option<String>, have: &str| want.as_deref().is_none_or(|w| w == have);
        is(&self.pool, &r.pool)
            && is(&self.route, r.route)
            && self
                .variant
                .as_deref()
                .is_none_or(|v| r.variant == v || r.attempts.iter().any(|a| a.variant == v))
    }
}

/// A record being completed by a request's attempts and its log; pushed into the ring when the
/// last of them lets go.
pub struct Draft {
    log: Arc<DecisionLog>,
    /// When the request arrived: attempt timings are offsets from here.
    pub started: Instant,
    state: Mutex<DraftState>,
}

struct DraftState {
    record: DecisionRecord,
    /// Upstream attempts outstanding now, since when, and the time with at least one before.
    outstanding: u32,
    busy_since: Option<Instant>,
    waited: Duration,
}

impl Draft {
    pub fn new(log: &Arc<DecisionLog>, started: Instant, record: DecisionRecord) -> Arc<Draft> {
        Arc::new(Draft {
            log: log.clone(),
            started,
            state: Mutex::new(DraftState {
                record,
                outstanding: 0,
                busy_since: None,
                waited: Duration::ZERO,
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, DraftState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the record.
    pub fn update(&self, f: impl FnOnce(&mut DecisionRecord)) {
        f(&mut self.state().record)
    }

    /// Milliseconds from the request's arrival to `t`.
    pub fn offset_ms(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.started).as_secs_f64() * 1000.0
    }

    /// An upstream attempt started.
    pub fn upstream_begin(&self) {
        let mut s = self.state();
        if s.outstanding == 0 {
            s.busy_since = Some(Instant::now());
        }
        s.outstanding += 1;
    }

    /// An upstream attempt ended (answered, failed, cancelled, or its stream closed).
    pub fn upstream_end(&self) {
        let mut s = self.state();
        s.outstanding = s.outstanding.saturating_sub(1);
        if s.outstanding == 0 {
            if let Some(since) = s.busy_since.take() {
                s.waited += since.elapsed();
            }
        }
    }

    /// Time so far with at least one upstream attempt outstanding (overlapping attempts, a
    /// hedge race, count once).
    /// The overhead stamped on the response head, once it was.
    pub fn overhead_us(&self) -> Option<u64> {
        self.state().record.overhead_us
    }

    pub fn upstream_wait(&self) -> Duration {
        let s = self.state();
        s.waited + s.busy_since.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// A hedge sent: `reason` is `first_token_late` (at the hedge delay) or
    /// `first_token_very_late` (later, while the pool's record does not say hedges at the delay
    /// pay).
    pub fn note_hedge(&self, from: &str, to: &str, reason: &'static str) {
        let at_ms = self.offset_ms(Instant::now());
        self.update(|r| {
            r.hedges.push(HedgeRecord {
                from: from.to_owned(),
                to: to.to_owned(),
                reason,
                at_ms,
            })
        });
    }

    pub fn note_migration(&self, from: &str, to: &str, reason: &str, after_tokens: u64) {
        let at_ms = self.offset_ms(Instant::now());
        self.update(|r| {
            r.migrations.push(MigrationRecord {
                from: from.to_owned(),
                to: to.to_owned(),
                reason: reason.to_owned(),
                after_tokens,
                at_ms,
            })
        });
    }

    /// Copies what the request's log knows when it ends.
    pub fn finish_request(&self, log: &RequestLog, outcome: &'static str, total: Duration) {
        self.update(|r| {
            r.pool.clone_from(&log.pool);
            r.endpoint = log.endpoint;
            r.route = log.route;
            r.variant.clone_from(&log.variant);
            r.status = log.status;
            r.outcome = outcome;
            r.total_ms = total.as_secs_f64() * 1000.0;
            r.ttft_ms = log.ttft.map(|t| t.as_secs_f64() * 1000.0);
            r.key = (log.key != "-").then(|| log.key.clone());
            r.tenant = (log.tenant != "-").then(|| log.tenant.clone());
            r.cache = log.cache;
            r.cached_from.clone_from(&log.cached_from);
        });
    }
}

impl Drop for Draft {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut record = std::mem::take(&mut state.record);
        record.upstream_wait_ms =
            (state.waited + state.busy_since.map_or(Duration::ZERO, |t| t.elapsed())).as_secs_f64()
                * 1000.0;
        self.log.push(record);
    }
}

/// What `x-keel-overhead-us` needs, taken from a request's log (which a relay task may own by
/// the time the response head is built).
pub struct OverheadStamp {
    metrics: Arc<crate::observe::metrics::Metrics>,
    pool: String,
    endpoint: &'static str,
    started: Instant,
    decision: Option<Arc<Draft>>,
}

impl OverheadStamp {
    /// Sets `x-keel-overhead-us` (and records `keel_overhead_seconds`): the time spent inside
    /// keel so far, that is since the request arrived minus the time with an upstream attempt
    /// outstanding. Applied when the response head is built: for a stream that is the time to
    /// its first byte, for a whole answer the whole request. Also notes the prompt fixes the
    /// headers carry in the decision record.
    pub fn apply(&self, h: &mut HeaderMap) -> u64 {
        let waited = self
            .decision
            .as_ref()
            .map_or(Duration::ZERO, |d| d.upstream_wait());
        let overhead = self.started.elapsed().saturating_sub(waited);
        self.metrics
            .histogram(
                "keel_overhead_seconds",
                &[("pool", &self.pool), ("endpoint", self.endpoint)],
            )
            .record(overhead.as_secs_f64());
        let us = overhead.as_micros() as u64;
        h.insert(OVERHEAD_HEADER, HeaderValue::from(us));
        if let Some(d) = &self.decision {
            let fixes: Vec<String> = h
                .get(PROMPT_FIX_HEADER)
                .and_then(|v| v.to_str().ok())
                .into_iter()
                .flat_map(|v| v.split(','))
                .filter(|f| !f.is_empty())
                .map(str::to_owned)
                .collect();
            let guard = h
                .get(crate::wire::GUARD_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(|s| Box::new(s.to_owned()));
            d.update(|r| {
                r.overhead_us = Some(us);
                r.prompt_fixes = fixes;
                if guard.is_some() {
                    r.guard = guard;
                }
            });
        }
        us
    }
}

impl RequestLog {
    pub(crate) fn overhead_stamp(&self) -> OverheadStamp {
        OverheadStamp {
            metrics: self.metrics.clone(),
            pool: self.pool.clone(),
            endpoint: self.endpoint,
            started: self.started,
            decision: self.decision.clone(),
        }
    }

    /// [`OverheadStamp::apply`] now (the access line carries it too).
    pub(crate) fn stamp_overhead(&mut self, h: &mut HeaderMap) {
        self.overhead_us = Some(self.overhead_stamp().apply(h));
    }
}

/// Records serialized per poll of a [`document`] body: about 2 KiB each (see the module's
/// memory notes), so a batch is some 64 KiB, a few writes' worth.
const DOCUMENT_BATCH: usize = 32;

/// `GET /keel/decisions`'s answer: `records` as a JSON array, serialized a batch at a time as
/// the body is polled. Whole, `limit=1000` of large records was a document of megabytes per
/// request, held in full by a client that never read it; streamed, an unread answer holds one
/// batch (and the records, which the ring shares).
pub fn document(records: Vec<Arc<DecisionRecord>>) -> http::Response<crate::Body> {
    use http_body_util::BodyExt;
    let body = Document {
        records: records.into_iter(),
        opened: false,
        written: false,
        done: false,
    };
    let mut resp = http::Response::new(body.boxed());
    *resp.headers_mut() = crate::wire::body::response_headers();
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// The body of [`document`].
struct Document {
    records: std::vec::IntoIter<Arc<DecisionRecord>>,
    opened: bool,
    /// A record is in the array already (the next one needs a comma).
    written: bool,
    done: bool,
}

impl Document {
    /// The next piece of the array: its opening with the first batch, a batch, or the last one
    /// with its closing.
    fn next_batch(&mut self) -> bytes::Bytes {
        let mut out = Vec::with_capacity(DOCUMENT_BATCH * 2048);
        if !self.opened {
            self.opened = true;
            out.push(b'[');
        }
        for r in self.records.by_ref().take(DOCUMENT_BATCH) {
            let mark = out.len();
            if self.written {
                out.push(b',');
            }
            // A record that cannot be written (none should) is left out, not half written.
            match serde_json::to_writer(&mut out, &*r) {
                Ok(()) => self.written = true,
                Err(_) => out.truncate(mark),
            }
        }
        if self.records.len() == 0 {
            self.done = true;
            out.push(b']');
        }
        bytes::Bytes::from(out)
    }
}

impl http_body::Body for Document {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        if self.done {
            return std::task::Poll::Ready(None);
        }
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(self.next_batch()))))
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, pool: &str, route: &'static str) -> DecisionRecord {
        DecisionRecord {
            request_id: id.into(),
            pool: pool.into(),
            route,
            ..Default::default()
        }
    }

    /// The streamed answer is the whole document, byte for byte, and an unread one holds a
    /// batch: its first piece is a small part of it.
    #[test]
    fn the_document_is_streamed_a_batch_at_a_time() {
        use http_body_util::BodyExt;
        for n in [0, 1, DOCUMENT_BATCH, DOCUMENT_BATCH + 1, 1_000] {
            let records: Vec<Arc<DecisionRecord>> = (0..n)
                .map(|i| Arc::new(record(&format!("r{i}"), "p", "direct")))
                .collect();
            let whole = serde_json::to_string(
                &records
                    .iter()
                    .map(|r| &**r)
                    .collect::<Vec<&DecisionRecord>>(),
            )
            .unwrap();
            let mut body = document(records).into_body();
            let mut pieces = Vec::new();
            futures_util::FutureExt::now_or_never(async {
                while let Some(frame) = body.frame().await {
                    pieces.push(frame.unwrap().into_data().unwrap());
                }
            })
            .expect("a document needs no waiting");
            let streamed: Vec<u8> = pieces.iter().flat_map(|p| p.iter().copied()).collect();
            assert_eq!(String::from_utf8(streamed).unwrap(), whole, "{n} records");
            assert_eq!(pieces.len(), n.div_ceil(DOCUMENT_BATCH).max(1));
            if n == 1_000 {
                assert!(pieces[0].len() * 20 < whole.len(), "{}", pieces[0].len());
            }
        }
    }

    #[test]
    fn the_ring_forgets_the_oldest_and_its_index() {
        let log = DecisionLog::new(3);
        for i in 0..5 {
            log.push(record(&format!("r{i}"), "p", "direct"));
        }
        assert!(log.get("r0").is_none() && log.get("r1").is_none());
        assert_eq!(log.get("r4").unwrap().request_id, "r4");
        let all = log.query(&Query::parse(None).unwrap());
        let ids: Vec<&str> = all.iter().map(|r| r.request_id.as_str()).collect();
        assert_eq!(ids, ["r4", "r3", "r2"]);
    }

    /// Pushes from many threads at once: the ring ends full, no record kept twice, each kept one
    /// findable by its id, and the last push among them.
    #[test]
    fn concurrent_pushes_keep_the_newest_records() {
        let log = DecisionLog::new(64);
        std::thread::scope(|s| {
            for t in 0..4 {
                let log = &log;
                s.spawn(move || {
                    for i in 0..1_000 {
                        log.push(record(&format!("t{t}-{i}"), "p", "direct"));
                    }
                });
            }
        });
        let all = log.query(&Query {
            limit: 1_000,
            ..Default::default()
        });
        assert_eq!(all.len(), 64);
        for r in &all {
            assert_eq!(log.get(&r.request_id).unwrap().request_id, r.request_id);
        }
        let ids: std::collections::HashSet<&str> =
            all.iter().map(|r| r.request_id.as_str()).collect();
        assert_eq!(ids.len(), 64, "a record kept twice");
        // Some thread pushed last: its last record is kept.
        assert!((0..4).any(|t| ids.contains(format!("t{t}-999").as_str())));
    }

    #[test]
    fn queries_filter_and_refuse_bad_parameters() {
        let log = DecisionLog::new(10);
        log.push(record("a", "chat", "direct"));
        log.push(record("b", "chat", "fallback"));
        log.push(record("c", "other", "fallback"));
        let ids = |q: &str| -> Vec<String> {
            log.query(&Query::parse(Some(q)).unwrap())
                .iter()
                .map(|r| r.request_id.clone())
                .collect()
        };
        assert_eq!(ids("route=fallback"), ["c", "b"]);
        assert_eq!(ids("pool=chat&route=fallback"), ["b"]);
        assert_eq!(ids("limit=1"), ["c"]);
        for bad in ["limit=0", "limit=1001", "limit=x", "colour=red"] {
            assert!(Query::parse(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn upstream_wait_counts_overlapping_attempts_once() {
        let log = Arc::new(DecisionLog::new(2));
        let d = Draft::new(&log, Instant::now(), record("x", "p", "direct"));
        d.upstream_begin();
        d.upstream_begin();
        d.upstream_end();
        let during = d.upstream_wait();
        d.upstream_end();
        let after = d.upstream_wait();
        assert!(after >= during);
        assert_eq!(
            d.upstream_wait(),
            after,
            "no attempt outstanding: no more waiting"
        );
        drop(d);
        assert!(
            log.get("x").is_some(),
            "dropping the draft keeps the record"
        );
    }

    /// The memory figures of docs/src/decisions.md rest on these sizes (plus names on the heap): a change that
    /// grows them should update the figures.
    #[test]
    fn record_sizes_stay_within_the_documented_figures() {
        use crate::observe::record::CandidateRecord;
        assert!(std::mem::size_of::<DecisionRecord>() <= 640);
        assert!(std::mem::size_of::<CandidateRecord>() <= 264);
        assert!(std::mem::size_of::<crate::observe::record::AttemptRecord>() <= 128);
    }
}
