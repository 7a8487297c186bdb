//! The decision record: why a request went where it went, as `GET /keel/decisions` serves it.
//! Selection fills in the candidates and the plan; the attempts, hedges and migrations and the
//! request's end complete it (see [`super::decisions`] for the ring that keeps them). No prompt
//! or output is kept.

use serde::Serialize;

/// The most candidates (and plan entries) one decision record lists. Building an entry for each
/// of 256 variants on every request cost more than the policy's decision itself; a record only
/// needs the ones that explain the choice, and counts for the rest.
pub const CANDIDATES_KEPT: usize = 16;

/// The candidates a record leaves out, and the plan's fallbacks past those it lists.
#[derive(Debug, Clone, Default, Serialize)]
pub struct OmittedCandidates {
    /// Candidates not listed.
    pub count: u32,
    /// Of those, how many could have taken the request (eligible, but costlier than the
    /// listed ones).
    pub eligible: u32,
    /// The unlisted candidates by health state (`healthy`, `ejected`, `warming`, …).
    pub by_state: std::collections::BTreeMap<&'static str, u32>,
    /// Fallbacks of the plan past the first [`CANDIDATES_KEPT`].
    pub plan_tail: u32,
}

/// Why an attempt is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptKind {
    /// The plan's first attempt.
    First,
    /// A new attempt before the first byte reached the client.
    Fallback,
    /// A duplicate of the first attempt, started because its first token is late.
    Hedge,
    /// A new attempt after bytes reached the client, continuing from the text already sent.
    Continuation,
    /// A synthetic short request that re-measures a variant (the monitor's probes and refreshes).
    Probe,
    /// A synthetic request that warms a new or returning variant before client traffic.
    WarmUp,
}

impl AttemptKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptKind::First => "first",
            AttemptKind::Fallback => "fallback",
            AttemptKind::Hedge => "hedge",
            AttemptKind::Continuation => "continuation",
            AttemptKind::Probe => "probe",
            AttemptKind::WarmUp => "warmup",
        }
    }

    /// Retries spend the fleet-wide retry budget (hedges have the pool's hedge budget).
    pub(crate) fn is_retry(self) -> bool {
        matches!(self, AttemptKind::Fallback | AttemptKind::Continuation)
    }
}

/// One attempt, for headers, metrics, logs and the decision record.
#[derive(Debug, Clone, Serialize)]
pub struct AttemptRecord {
    pub variant: String,
    pub kind: AttemptKind,
    pub outcome: String,
    /// Since the request arrived: when the attempt started, its first token (or whole
    /// answer) came, and it ended (ms; `None` while still running or when it never came).
    pub start_ms: f64,
    pub ttft_ms: Option<f64>,
    pub end_ms: Option<f64>,
    /// It failed on a variant still loading or restarting: it does not count against
    /// `max_attempts` (the variant is tried again once ready).
    #[serde(skip)]
    pub(crate) warming: bool,
}

/// One candidate in a decision record: every input of its cost, as selection saw it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CandidateRecord {
    pub variant: String,
    pub state: &'static str,
    /// Whether it could take this request (not cooling down, ejected, warming, full, too
    /// small for the prompt or below the tier floor).
    pub eligible: bool,
    /// Effective weight: configured weight × health.
    pub weight: f64,
    pub configured_weight: u32,
    /// Health weight in 0..=1, the product of `factors`.
    pub health: f64,
    /// The factors behind the health weight, each in 0..=1.
    pub factors: keel_core::health::Factors,
    /// Peak-EWMA time-to-first-token estimate, ms.
    pub predicted_ttft_ms: f64,
    pub p95_ttft_ms: Option<f64>,
    /// Mean inter-token gap of its recent streams, ms: its decode pace, which prices the
    /// rest of the answer against the fastest candidate's (see `decision.answer_tokens`).
    pub gap_ms: Option<f64>,
    /// Time-between-tokens standard deviation (gap variance), ms.
    pub tgsv_ms: Option<f64>,
    pub error_rate: Option<f64>,
    /// Scraped from the upstream's metrics: KV-cache usage (0..=1) and requests waiting.
    pub kv_usage: Option<f64>,
    pub queue_waiting: Option<f64>,
    pub in_flight: u32,
    /// Configured or learned concurrency limit (`None`: unlimited).
    pub concurrency_limit: Option<u32>,
    pub tier: u8,
    pub price: f64,
    /// The policy's cost (lower wins); `None` when not eligible or for round robin.
    pub cost: Option<f64>,
}

/// Why a request went where it went (see `decisions`). Selection fills in the candidates and
/// the plan; the attempts and the request's end complete it. No prompt or output is kept.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DecisionRecord {
    pub request_id: String,
    /// Arrival, milliseconds since the Unix epoch.
    pub time_unix_ms: u64,
    pub pool: String,
    /// The client's API (`chat_completions`, `messages`, …).
    pub endpoint: &'static str,
    /// Virtual key id and tenant, when keys are configured.
    pub key: Option<String>,
    pub tenant: Option<String>,
    pub policy: &'static str,
    pub reason: &'static str,
    /// The affinity key's hash (hex), when the pool uses affinity and the request has one.
    pub affinity_key: Option<String>,
    /// Tokens the answer was expected to stream, with which selection weighed each
    /// candidate's decode pace (`gap_ms`) into its cost; 0: not weighed.
    pub answer_tokens: f64,
    /// The plan's first [`CANDIDATES_KEPT`] variants (every one in pools no larger).
    pub plan: Vec<String>,
    /// Every candidate in pools of up to [`CANDIDATES_KEPT`] variants; in larger ones, the
    /// plan's head and the cheapest others (see [`kept_candidates`]), in variant order.
    pub candidates: Vec<CandidateRecord>,
    /// What a large pool's record leaves out, counted (`None` when nothing is).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidates_omitted: Option<Box<OmittedCandidates>>,
    /// Time selection took, µs.
    pub duration_us: f64,
    /// Every attempt the request made, in order (filled in when the request ends).
    pub attempts: Vec<AttemptRecord>,
    pub hedges: Vec<HedgeRecord>,
    pub migrations: Vec<MigrationRecord>,
    /// `x-keel-prompt-fix` codes.
    pub prompt_fixes: Vec<String>,
    /// `x-keel-guard`: what the PII and secret guard found and did (types and counts only).
    /// Boxed: most records have none, and the record's size is budgeted (see `decisions`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guard: Option<Box<String>>,
    /// What normalization changed: the text around each change, before and after (see
    /// `keel_core::normalize::Edits`; off with `decision_prompt_edits = false`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prompt_edits: Vec<keel_core::normalize::Edit>,
    /// `x-keel-route` and `x-keel-variant` as answered.
    pub route: &'static str,
    pub variant: String,
    pub status: u16,
    pub outcome: &'static str,
    pub ttft_ms: Option<f64>,
    pub total_ms: f64,
    /// Time with an upstream attempt outstanding, ms.
    pub upstream_wait_ms: f64,
    /// `x-keel-overhead-us`.
    pub overhead_us: Option<u64>,
    /// The canary side the request was put on (`stable`, `candidate`), in a pool with one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canary: Option<&'static str>,

    /// Output integrity events, `<issue>:<action>` (`truncated:continued`,
    /// `invalid_json:retried`, `invalid_json:flagged`, …; see `relay::integrity`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub integrity: Vec<String>,
    /// A consensus request's votes (see `consensus`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consensus: Option<serde_json::Value>,

    /// `x-keel-cache` (see `cache`), and for a hit the request whose answer was replayed.
    pub cache: &'static str,
    pub cached_from: Option<String>,
}

impl DecisionRecord {
    /// A record with no selection (the request ended before one).
    pub fn bare(request_id: &str, pool: &str) -> Self {
        DecisionRecord {
            request_id: request_id.to_owned(),
            pool: pool.to_owned(),
            ..Default::default()
        }
    }
}

/// A hedge: a duplicate of the first attempt, started because its first token was late.
#[derive(Debug, Clone, Serialize)]
pub struct HedgeRecord {
    pub from: String,
    pub to: String,
    pub reason: &'static str,
    /// Since the request started, when the hedge was sent.
    pub at_ms: f64,
}

/// A migration: a stream continued on another variant after bytes reached the client.
#[derive(Debug, Clone, Serialize)]
pub struct MigrationRecord {
    pub from: String,
    pub to: String,
    /// `stall`, `slow` or `error`.
    pub reason: String,
    /// Output tokens the client had received when the stream moved.
    pub after_tokens: u64,
    pub at_ms: f64,
}
