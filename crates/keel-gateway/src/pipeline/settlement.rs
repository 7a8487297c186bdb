//! Settlement: the one way every upstream attempt enters a variant, and the one place where
//! its end is accounted for. The first attempt, a fallback, a hedge and a continuation after
//! the first byte all go through [`Attempts::enter`] and [`Attempts::settle`] (and, for a
//! stream that reached the client, [`Attempts::settle_end`]); the monitor's probes and warm-ups
//! enter the same way and are settled by [`Attempts::settle_maintenance`], which differs only
//! in handing its health sample to the variant's lifecycle. No other code touches cooldowns,
//! credentials, learned limits, health samples or attempt metrics.
//!
//! **Entering a variant.** It must be available (not cooling down, not ejected, credential not
//! refused); it must have a free slot under its concurrency limit (configured, or learned from
//! 429s), waiting in the pool's line for one when it is full (hedges never wait: a hedge that
//! must queue is no longer a race); and every *retry* (a fallback or a continuation) must be
//! allowed by the fleet-wide retry budget. So under a fleet-wide incident, migrations are
//! budgeted retries like any other, and no attempt overfills a variant.
//!
//! **Settling an attempt.** One classification (`keel_core::outcome`) decides: a 429 while
//! other requests run on the variant lowers its learned limit (full, not broken); other
//! retryable failures feed health and honour `retry-after` as a cooldown (a refused connection
//! gets a short one); a server still loading its model, or refusing connections within its
//! restart grace (a restart), is warming instead: no error sample, no cooldown, no client
//! request until the monitor finds it ready; 401/403 mark the variant's credential, but only
//! when keel's own request earned them (a client's may be of its own making: it fails over and
//! keel confirms, see `classify`); a deadline says nothing about the variant. A success feeds the TTFT sample, closes any open cooldown and grows the learned
//! limit. Every attempt is counted once in `keel_attempts_total` (a stream when it ends, so a
//! stream that stalls after its first token counts as `stall`, not `ok`) and listed, with its
//! kind and outcome, in the request's decision record.

use crate::observe::record::{AttemptKind, AttemptRecord};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::time::Instant;

use keel_core::outcome::{AttemptFailure, Verdict};
use keel_core::protocol::ErrorKind;
use keel_core::stream_watch::Gaps;

use crate::observe::access_log::RequestLog;
use crate::observe::decisions::Draft;
use crate::observe::telemetry::{AttemptSpan, RequestSpan};
use crate::pipeline::attempt::{AttemptResult, Served};
use crate::pipeline::context::{Priority, RequestCtx};
use crate::state::pools::{InFlight, Pool};
use crate::wire::errors::GatewayError;
use crate::Gateway;

/// Ends an attempt's span with its outcome label (tracing on only).
fn end_span(trace: Option<AttemptSpan>, outcome: &str) {
    if let Some(t) = trace {
        t.end(outcome);
    }
}

/// Longest `retry-after` keel honours as a cooldown.
pub const MAX_COOLDOWN_MS: u64 = 300_000;
/// The retry-after given to a client whose fleet is still loading its models.
pub const LOADING_RETRY_AFTER_MS: u64 = 1_000;
/// A refused connection is very likely refused again: keep the variant out briefly.
const CONNECT_COOLDOWN_MS: u64 = 1_000;
/// The longest a client's request alone may hold a variant out, on this replica only (its
/// `retry-after` may be of the client's own making); keel's own request confirms a longer one
/// (see `classify`), which is then shared.
pub const CLIENT_EVIDENCE_COOLDOWN_MS: u64 = 1_000;
/// Longest retry-after a "full" 429 may carry: capacity frees within a second or two, while
/// a rate-limit quota (hosted APIs) asks for longer, and is honoured as a cooldown.
const FULL_RETRY_AFTER_MAX_MS: u64 = 2_000;

/// Why an attempt could not enter a variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Cooling down, ejected or with a refused credential.
    Unavailable,
    /// At its concurrency limit, and no slot freed in time.
    Full,
    /// The fleet-wide retry budget is spent.
    Budget,
}

impl Refused {
    pub fn describe(self) -> &'static str {
        match self {
            Refused::Unavailable => "unavailable",
            Refused::Full => "at its concurrency limit",
            Refused::Budget => "retry budget exhausted",
        }
    }
}

/// An attempt that entered its variant; it holds the variant's slot until settled.
pub struct Entered {
    pub vi: usize,
    pub kind: AttemptKind,
    guard: InFlight,
    pub started: Instant,
    /// Its trace span (tracing on only), ended when it is settled.
    trace: Option<AttemptSpan>,
}

impl Entered {
    /// The `traceparent` its upstream request carries (tracing on only).
    pub fn traceparent(&self) -> Option<http::HeaderValue> {
        self.trace.as_ref().and_then(AttemptSpan::traceparent)
    }
}

/// An attempt whose response was committed to the client. It holds its slot while it serves;
/// a stream is settled again when it ends ([`Attempts::settle_end`]).
pub struct Committed {
    pub vi: usize,
    pub kind: AttemptKind,
    guard: InFlight,
    record: usize,
    counted: bool,
    trace: Option<AttemptSpan>,
}

/// What settling an attempt decided.
pub enum Settled {
    /// The attempt serves the client.
    Served(Committed, Served),
    /// The client's own error, returned as the upstream gave it (never retried elsewhere).
    ClientError(Served),
    /// The attempt failed; the next one may be tried.
    Failed,
}

/// How a committed stream ended.
pub enum StreamEnd {
    /// Its terminal event arrived; `gaps`: the gaps between its outputs.
    Complete { gaps: Gaps },
    /// It failed after its first token.
    Failed(AttemptFailure),
    /// The client went away.
    ClientGone,
    /// The request's deadline ended it (says nothing about the variant).
    Deadline,
}

/// Every attempt of one request, and what they left behind.
pub struct Attempts {
    gw: Arc<Gateway>,
    pool: Arc<Pool>,
    records: Vec<AttemptRecord>,
    failures: Vec<(String, AttemptFailure)>,
    /// Failures that left their variant warming (loading, or restarting).
    warming_failures: usize,
    retry_after_ms: Option<u64>,
    budget_refused: bool,
    /// The request's decision record; completed with the attempts (see `decisions`).
    decision: Option<Arc<Draft>>,
    /// Origin of the attempts' timings when there is no record (probes, warm-ups).
    created: Instant,
    /// Committed streams not yet settled at their end: (record, variant, kind).
    open: Vec<(usize, usize, AttemptKind)>,
    /// The request's rank when an attempt waits in the pool's line for its variant.
    pub priority: keel_core::queue::Priority,
    /// The request's span: each attempt gets a child span (tracing on only).
    pub trace: Option<RequestSpan>,
    /// The client prompt's estimated tokens, for the variants' prefill fits (see
    /// `keel_core::prefill`); `None` for probes and warm-ups (and an empty prompt). Four bytes:
    /// every live stream's relay holds its request's attempts.
    pub prompt_tokens: Option<std::num::NonZeroU32>,
}

impl Attempts {
    pub fn new(gw: &Arc<Gateway>, pool: &Arc<Pool>, decision: Option<Arc<Draft>>) -> Self {
        Attempts {
            gw: gw.clone(),
            pool: pool.clone(),
            records: Vec::new(),
            failures: Vec::new(),
            warming_failures: 0,
            retry_after_ms: None,
            budget_refused: false,
            decision,
            created: Instant::now(),
            open: Vec::new(),
            priority: Default::default(),
            trace: None,
            prompt_tokens: None,
        }
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    pub fn records(&self) -> &[AttemptRecord] {
        &self.records
    }

    /// The request's decision record in the making.
    pub fn decision(&self) -> Option<&Arc<Draft>> {
        self.decision.as_ref()
    }

    /// Milliseconds from the request's arrival to `t`.
    fn offset_ms(&self, t: Instant) -> f64 {
        match &self.decision {
            Some(d) => d.offset_ms(t),
            None => t.saturating_duration_since(self.created).as_secs_f64() * 1000.0,
        }
    }

    /// An attempt stopped waiting on its upstream (see `Draft::upstream_wait`).
    fn upstream_done(&self) {
        if let Some(d) = &self.decision {
            d.upstream_end();
        }
    }

    /// Attempts that count against `max_attempts`: all but those a loading or restarting
    /// server refused.
    pub fn counted(&self) -> usize {
        self.records.iter().filter(|r| !r.warming).count()
    }

    /// Whether every failure so far was a server still loading its model or restarting (the
    /// request may wait for the fleet instead of failing).
    pub fn all_loading(&self) -> bool {
        !self.failures.is_empty() && self.warming_failures == self.failures.len()
    }

    /// Whether waiting for the fleet may help: some failure was a server loading or
    /// restarting, and every other one a connection that failed or broke (a restarting
    /// server drops its open connections; a pooled one may meet that first).
    pub fn restart_like(&self) -> bool {
        let transport = self
            .failures
            .iter()
            .filter(|(_, f)| matches!(f, AttemptFailure::Io(_) | AttemptFailure::Connect(_)))
            .count();
        self.warming_failures > 0 && self.warming_failures + transport == self.failures.len()
    }

    /// (failures so far, those of them that left their variant warming): a caller compares
    /// two marks to tell whether everything that failed in between was a loading or
    /// restarting server.
    pub fn failure_marks(&self) -> (usize, usize) {
        (self.failures.len(), self.warming_failures)
    }

    /// The failures after the first `from`.
    pub fn failures_since(&self, from: usize) -> impl Iterator<Item = &AttemptFailure> {
        self.failures.iter().skip(from).map(|(_, f)| f)
    }

    /// Attempts made on variant `vi` so far (those a loading or restarting server refused do
    /// not count: it is tried again once ready).
    pub fn tried(&self, vi: usize) -> usize {
        let name = &self.pool.variants[vi].cfg.name;
        self.records
            .iter()
            .filter(|r| &r.variant == name && !r.warming)
            .count()
    }

    /// The last failure, described.
    pub fn last_failure(&self) -> Option<String> {
        self.failures.last().map(|(_, f)| f.describe())
    }

    /// Whether the last failure means nothing more can be done (the deadline).
    pub fn gave_up(&self) -> bool {
        self.failures
            .last()
            .is_some_and(|(_, f)| f.verdict() == Verdict::GiveUp)
    }

    /// Enters variant `vi` for an attempt of `kind` (see the module doc).
    pub async fn enter(
        &mut self,
        vi: usize,
        kind: AttemptKind,
        deadline: Instant,
    ) -> Result<Entered, Refused> {
        self.enter_inner(vi, kind, deadline, true).await
    }

    /// Enters variant `vi` again for an attempt that replaces one it refused without failing
    /// (a continuation retried in `instruction` mode after its prefill was refused): as
    /// [`Attempts::enter`], but the retry budget was already spent by the attempt it replaces.
    pub async fn reenter(
        &mut self,
        vi: usize,
        kind: AttemptKind,
        deadline: Instant,
    ) -> Result<Entered, Refused> {
        self.enter_inner(vi, kind, deadline, false).await
    }

    async fn enter_inner(
        &mut self,
        vi: usize,
        kind: AttemptKind,
        deadline: Instant,
        budgeted: bool,
    ) -> Result<Entered, Refused> {
        let pool = &self.pool;
        let synthetic = matches!(kind, AttemptKind::Probe | AttemptKind::WarmUp);
        // A cooling variant takes nothing, not even keel's own requests: its cooldown is a
        // server's `retry-after` (or a refused connection's short hold), and the monitor probes
        // it once that is over. Ejection and loading are another matter: probing an ejected
        // variant is the point of a probe, finding out whether a loading variant is ready the
        // point of a warm-up, and no client request goes to either.
        if !pool.available(vi, self.gw.now_ms()) {
            return Err(Refused::Unavailable);
        }
        if !synthetic && pool.loading(vi) {
            return Err(Refused::Unavailable);
        }
        // A hedge that must queue is no longer a race; synthetic requests never queue ahead
        // of clients.
        // The slot is taken here, in one atomic step with the limit check (see
        // `Pool::try_enter`); every refusal below gives it back by dropping it.
        let slot = match kind {
            AttemptKind::Hedge => pool.try_enter(vi, self.priority),
            // Keel's own traffic never takes a slot kept for high-priority requests.
            AttemptKind::Probe | AttemptKind::WarmUp => pool.try_enter(vi, Priority::Low),
            _ => pool.wait_for_slot(vi, self.priority, deadline).await,
        };
        let Some(guard) = slot else {
            return Err(Refused::Full);
        };
        if budgeted && kind.is_retry() && !self.gw.try_retry() {
            self.budget_refused = true;
            self.pool
                .metrics
                .counter(
                    "keel_retry_budget_exhausted_total",
                    &[("pool", &self.pool.cfg.name)],
                )
                .increment(1);
            return Err(Refused::Budget);
        }
        let trace = self
            .trace
            .as_ref()
            .map(|t| t.start_attempt(&pool.cfg.name, &pool.variants[vi].cfg, kind.as_str()));
        if let Some(d) = &self.decision {
            d.upstream_begin();
        }
        Ok(Entered {
            vi,
            kind,
            guard,
            started: Instant::now(),
            trace,
        })
    }

    fn count(&self, vi: usize, kind: AttemptKind, outcome: &str) {
        let pool = &self.pool;
        pool.metrics
            .counter(
                "keel_attempts_total",
                &[
                    ("pool", &pool.cfg.name),
                    ("variant", &pool.variants[vi].cfg.name),
                    ("kind", kind.as_str()),
                    ("outcome", outcome),
                ],
            )
            .increment(1);
    }

    /// Lists an attempt that started at `started`; `ttft` is its first token (or whole
    /// answer) if it came, `ended` whether it is over.
    fn push_record(
        &mut self,
        vi: usize,
        kind: AttemptKind,
        outcome: String,
        started: Instant,
        ttft: Option<Instant>,
        ended: bool,
    ) -> usize {
        let record = AttemptRecord {
            variant: self.pool.variants[vi].cfg.name.clone(),
            kind,
            outcome,
            start_ms: self.offset_ms(started),
            ttft_ms: ttft.map(|t| self.offset_ms(t)),
            end_ms: ended.then(|| self.offset_ms(Instant::now())),
            warming: false,
        };
        self.records.push(record);
        self.records.len() - 1
    }

    /// Settles an attempt that produced a response head, a first token, or a failure.
    pub fn settle(&mut self, entered: Entered, result: AttemptResult) -> Settled {
        let Entered {
            vi,
            kind,
            mut guard,
            started,
            mut trace,
        } = entered;
        let pool = self.pool.clone();
        match result {
            AttemptResult::Served(s) => {
                let (first, whole) = match &s {
                    Served::Stream(st) => (st.first_token_at, false),
                    Served::Whole { .. } => (Instant::now(), true),
                };
                let ttft = first.saturating_duration_since(started);
                if let Some(t) = &mut trace {
                    t.first_token(ttft);
                }
                if whole {
                    end_span(trace.take(), "ok");
                }
                // A continuation's prompt is the client's and the text already sent: its size
                // is not the estimate's.
                let prompt = self
                    .prompt_tokens
                    .filter(|_| kind != AttemptKind::Continuation)
                    .map(|t| u64::from(t.get()));
                pool.record_attempt(vi, true, Some(ttft.as_secs_f64() * 1000.0), prompt);
                pool.record_success(vi);
                pool.variants[vi].limit.success();
                let record = self.push_record(vi, kind, "ok".into(), started, Some(first), whole);
                if whole {
                    self.upstream_done();
                    self.count(vi, kind, "ok");
                } else {
                    self.open.push((record, vi, kind));
                }
                guard.serving = true;
                Settled::Served(
                    Committed {
                        vi,
                        kind,
                        guard,
                        record,
                        counted: whole,
                        trace,
                    },
                    s,
                )
            }
            AttemptResult::ClientError(s) => {
                let label = match &s {
                    Served::Whole { status, .. } => format!("status_{}", status.as_u16()),
                    Served::Stream(_) => "client_error".to_owned(),
                };
                self.count(vi, kind, &label);
                end_span(trace, &label);
                self.push_record(vi, kind, label, started, None, true);
                self.upstream_done();
                pool.record_attempt(vi, true, None, None);
                Settled::ClientError(s)
            }
            AttemptResult::Failed(f) => {
                let label = f.label();
                self.count(vi, kind, &label);
                end_span(trace, &label);
                let record = self.push_record(vi, kind, label, started, None, true);
                self.upstream_done();
                // The slot is still held: a 429 sees this attempt among those running.
                self.fail(vi, f, record);
                drop(guard);
                Settled::Failed
            }
        }
    }

    /// Settles a continuation whose variant refused its prefill ("does not support assistant
    /// message prefill"): recorded as `prefill_refused`, and nothing else: the variant is not
    /// failing (no error sample, no cooldown), it only needs `instruction` mode.
    pub fn settle_prefill_refused(&mut self, entered: Entered) {
        let Entered {
            vi,
            kind,
            guard,
            started,
            trace,
        } = entered;
        end_span(trace, "prefill_refused");
        self.count(vi, kind, "prefill_refused");
        self.push_record(vi, kind, "prefill_refused".into(), started, None, true);
        self.upstream_done();
        drop(guard);
    }

    /// Settles a committed stream when it ends.
    pub fn settle_end(&mut self, committed: Committed, end: StreamEnd) {
        let Committed {
            vi,
            kind,
            guard,
            record,
            counted,
            trace,
        } = committed;
        let label = match &end {
            StreamEnd::Complete { .. } => "ok".to_owned(),
            StreamEnd::Failed(f) => f.label(),
            StreamEnd::ClientGone => "cancelled".to_owned(),
            StreamEnd::Deadline => "deadline".to_owned(),
        };
        if !counted {
            self.count(vi, kind, &label);
            self.open.retain(|(r, ..)| *r != record);
            self.upstream_done();
        }
        end_span(trace, &label);
        let end_ms = self.offset_ms(Instant::now());
        if let Some(r) = self.records.get_mut(record) {
            r.outcome = label;
            r.end_ms = Some(end_ms);
        }
        match end {
            StreamEnd::Complete { gaps } => self.pool.record_stream(vi, &gaps),
            StreamEnd::Failed(f) => {
                // A stream moved for its pace was not broken: its decode factor prices that.
                if !matches!(f, AttemptFailure::Slow(_)) {
                    self.pool.record_break(vi);
                }
                self.fail(vi, f, record)
            }
            StreamEnd::ClientGone | StreamEnd::Deadline => {}
        }
        drop(guard);
    }

    /// Settles a probe or warm-up: counted and classified like any attempt (a 401 marks the
    /// credential, a 429 lowers the learned limit or cools the variant down), but its health
    /// sample belongs to the variant's lifecycle, so it is returned instead of recorded: the
    /// time to its first token when it succeeded (as a client's attempt is measured, so that
    /// the two kinds of sample agree), or to its whole answer when it came whole.
    pub fn settle_maintenance(&mut self, entered: Entered, result: AttemptResult) -> Option<f64> {
        let Entered {
            vi,
            kind,
            guard,
            started,
            ..
        } = entered;
        let (label, ttft_ms) = match &result {
            AttemptResult::Served(served) => {
                let first = match served {
                    Served::Stream(st) => st.first_token_at,
                    Served::Whole { .. } => Instant::now(),
                };
                let ttft = first.saturating_duration_since(started);
                ("ok".to_owned(), Some(ttft.as_secs_f64() * 1000.0))
            }
            AttemptResult::ClientError(Served::Whole { status, .. }) => {
                (format!("status_{}", status.as_u16()), None)
            }
            AttemptResult::ClientError(_) => ("client_error".to_owned(), None),
            AttemptResult::Failed(f) => (f.label(), None),
        };
        self.count(vi, kind, &label);
        self.push_record(vi, kind, label, started, None, true);
        self.upstream_done();
        match result {
            AttemptResult::Served(_) => self.pool.variants[vi].limit.success(),
            AttemptResult::Failed(f) => {
                self.classify(vi, &f, false);
            }
            AttemptResult::ClientError(_) => {}
        }
        drop(guard);
        ttft_ms
    }

    /// A race's loser (a hedge, or a speculative continuation), cancelled before its first
    /// token: its elapsed time is a lower bound of its TTFT.
    pub fn cancelled(&mut self, entered: Entered) {
        let Entered {
            vi,
            kind,
            started,
            trace,
            ..
        } = entered;
        self.pool
            .record_late_ttft(vi, started.elapsed().as_secs_f64() * 1000.0);
        let label = match kind {
            AttemptKind::Hedge => "hedge_cancelled",
            _ => "race_cancelled",
        };
        self.count(vi, kind, label);
        end_span(trace, label);
        self.push_record(vi, kind, label.into(), started, None, true);
        self.upstream_done();
    }

    /// The bookkeeping of a failure, before or after the commit point.
    fn fail(&mut self, vi: usize, f: AttemptFailure, record: usize) {
        if self.classify(vi, &f, true) {
            self.warming_failures += 1;
            if let Some(r) = self.records.get_mut(record) {
                r.warming = true;
            }
        }
        let name = self.pool.variants[vi].cfg.name.clone();
        self.failures.push((name, f));
    }

    /// What a failure means for its variant. `client` is true for a client's request, false
    /// for keel's own (probes and warm-ups, whose samples drive the variant's lifecycle
    /// instead, and which carry nothing of any client's). True when it left the variant
    /// warming (still loading its model, or restarting).
    ///
    /// A client's request can earn refusals of its own making: a 401/403 for a header the
    /// operator forwards or a body field the upstream authorizes on, a 429 with a long
    /// `retry-after` for a prompt past the account's per-minute tokens. Such a refusal fails
    /// this request over, and only keel's own request ([`crate::state::pools::Maintenance::Confirm`],
    /// sent at the monitor's next tick) can mark the credential broken or hold the variant out
    /// for longer than [`CLIENT_EVIDENCE_COOLDOWN_MS`], for this replica and, through shared
    /// signals, the others.
    fn classify(&mut self, vi: usize, f: &AttemptFailure, client: bool) -> bool {
        let pool = self.pool.clone();
        let variant = &pool.variants[vi].cfg;
        let now_ms = self.gw.now_ms();
        if f.is_loading() {
            // Warming, not failing: no error sample, no cooldown; no client request goes there
            // until a warm-up succeeds.
            pool.mark_loading(vi);
            return true;
        }
        if matches!(f, AttemptFailure::Refused(_)) && pool.mark_restarting(vi) {
            // A restart (or a server not up yet): warming like a loading one. A variant that
            // refuses past its restart grace is ejected instead and handled below.
            return true;
        }
        let sample = |ok| {
            if client {
                pool.record_attempt(vi, ok, None, None);
            }
        };
        match f.verdict() {
            Verdict::Retry { .. } if is_full(f, &pool, vi) => {
                // Full at this concurrency, not broken: lower its limit (see `capacity`); it
                // stays available below it.
                let running = pool.variants[vi].in_flight.load(Ordering::Relaxed);
                pool.variants[vi].limit.full_at(running);
                self.retry_after_ms = pool.expected_wait_ms();
            }
            Verdict::Retry { cooldown_ms } => {
                sample(false);
                let cool = cooldown_ms.or(matches!(
                    f,
                    AttemptFailure::Connect(_) | AttemptFailure::Refused(_)
                )
                .then_some(CONNECT_COOLDOWN_MS));
                match cool {
                    Some(ms) if client && ms > CLIENT_EVIDENCE_COOLDOWN_MS => {
                        pool.hold_unconfirmed(vi, now_ms, CLIENT_EVIDENCE_COOLDOWN_MS)
                    }
                    Some(ms) => pool.cool_down(vi, now_ms, ms.min(MAX_COOLDOWN_MS)),
                    None => {}
                }
                if cooldown_ms.is_some() {
                    self.retry_after_ms = cooldown_ms;
                }
            }
            Verdict::BrokenCredential if client => {
                pool.to_confirm(vi);
                pool.metrics
                    .counter(
                        "keel_variant_credential_unconfirmed_total",
                        &[("pool", &pool.cfg.name), ("variant", &variant.name)],
                    )
                    .increment(1);
                tracing::warn!(pool = %pool.cfg.name, variant = %variant.name, "upstream refused a client's request with 401/403; the request fails over and keel's own request checks the variant's credential");
            }
            Verdict::BrokenCredential => {
                pool.mark_credential_broken(vi, now_ms);
                pool.metrics
                    .counter(
                        "keel_variant_credential_broken_total",
                        &[("pool", &pool.cfg.name), ("variant", &variant.name)],
                    )
                    .increment(1);
                tracing::error!(pool = %pool.cfg.name, variant = %variant.name, "upstream refused the variant's credential to keel's own request; variant marked broken and skipped for 60 s");
            }
            // Running out of the request's own time says nothing about the variant.
            Verdict::ReturnToClient | Verdict::GiveUp => {}
        }
        false
    }

    /// The client's error when no variant could serve: 504 when time ran out, 503 when every
    /// variant was saturated (with the shortest retry-after), 502 otherwise; the message lists
    /// every attempt.
    pub fn give_up_error(&self, ctx: &RequestCtx) -> GatewayError {
        let failures = &self.failures;
        let tried: Vec<String> = failures
            .iter()
            .map(|(v, f)| format!("{v}: {}", f.describe()))
            .collect();
        let mut message = format!(
            "no variant of `{}` could serve the request",
            self.pool.cfg.name
        );
        if tried.is_empty() {
            message.push_str(" (no attempt could be made before the deadline)");
        } else {
            message.push_str(&format!("; tried {}", tried.join("; ")));
        }
        if self.budget_refused {
            message.push_str(
                "; further retries refused by the retry budget (the fleet is failing broadly)",
            );
        }
        let timed_out = Instant::now() >= ctx.deadline
            || failures.iter().all(|(_, f)| {
                matches!(
                    f,
                    AttemptFailure::FirstTokenTimeout { .. } | AttemptFailure::Deadline { .. }
                )
            });
        let saturated = !failures.is_empty()
            && failures.iter().all(|(_, f)| {
                matches!(
                    f,
                    AttemptFailure::Status {
                        status: 429 | 503 | 529,
                        ..
                    }
                )
            });
        if self.all_loading() {
            GatewayError::new(
                ErrorKind::Overloaded,
                loading_message(&self.pool, failures.iter().all(|(_, f)| f.is_loading())),
            )
            .with_retry_after(LOADING_RETRY_AFTER_MS)
        } else if failures.is_empty() || timed_out {
            GatewayError::new(ErrorKind::Timeout, message)
        } else if saturated {
            let e = GatewayError::new(ErrorKind::Overloaded, message);
            match self.retry_after_ms {
                Some(ms) => e.with_retry_after(ms),
                None => e,
            }
        } else {
            GatewayError::new(ErrorKind::BadGateway, message)
        }
    }
}

impl Drop for Attempts {
    /// A committed stream whose request was dropped before its end (a non-streaming client
    /// that went away while its answer was assembled, a task that panicked) is still counted,
    /// once; then the request's decision record is kept.
    fn drop(&mut self) {
        let label = if std::thread::panicking() {
            "internal_error"
        } else {
            "cancelled"
        };
        let end_ms = self.offset_ms(Instant::now());
        for (record, vi, kind) in std::mem::take(&mut self.open) {
            self.count(vi, kind, label);
            self.upstream_done();
            if let Some(r) = self.records.get_mut(record) {
                r.outcome = label.to_owned();
                r.end_ms = Some(end_ms);
            }
        }
        if let Some(d) = self.decision.take() {
            let records = std::mem::take(&mut self.records);
            d.update(|r| r.attempts = records);
        }
    }
}

/// The client's message when a request gave up waiting for a fleet that is loading its
/// models (`only_loading`) or restarting.
pub fn loading_message(pool: &Pool, only_loading: bool) -> String {
    if only_loading && !(0..pool.variants.len()).any(|i| pool.restarting(i)) {
        format!(
            "every variant of `{}` is still loading its model",
            pool.cfg.name
        )
    } else {
        format!(
            "every variant of `{}` is restarting or still loading its model",
            pool.cfg.name
        )
    }
}

/// A 429 while other requests of this gateway are running on the variant (this attempt's
/// slot is still held), with at most a short retry-after: the variant is full, not out of
/// quota.
fn is_full(f: &AttemptFailure, pool: &Pool, vi: usize) -> bool {
    matches!(f, AttemptFailure::Status { status: 429, retry_after_ms, .. }
        if retry_after_ms.is_none_or(|ms| ms <= FULL_RETRY_AFTER_MAX_MS))
        && pool.variants[vi].in_flight.load(Ordering::Relaxed) >= 2
}

impl RequestLog {
    /// Takes the attempts' count, order and hedges from the request's ledger.
    pub fn note_attempts(&mut self, attempts: &Attempts) {
        let records = attempts.records();
        self.attempts = records.len();
        // In the order they started. The ledger holds them as they ended, which is the same
        // order unless a race ran: a hedge that lost ends before the primary that beat it.
        self.tried = records.iter().map(|r| r.variant.clone()).collect();
        if !records.is_sorted_by(|a, b| a.start_ms <= b.start_ms) {
            let mut started: Vec<&AttemptRecord> = records.iter().collect();
            started.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
            self.tried = started.iter().map(|r| r.variant.clone()).collect();
        }
        self.hedges = records
            .iter()
            .filter(|r| r.kind == AttemptKind::Hedge)
            .count();
    }
}
