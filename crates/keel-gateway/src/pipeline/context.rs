//! The per-request context: what admission established about a request that every later stage
//! needs (its id, clocks, endpoint, controls, and the headers that travel upstream).

use http::HeaderMap;
use tokio::time::Instant;

use keel_core::protocol::Endpoint;
/// A request's rank in the pool's wait line (`High`, `Normal`, `Low`; see `capacity`).
pub use keel_core::queue::Priority;
use keel_core::selection::Preference;

pub use crate::wire::routes::ClientApi;

/// Per-request context shared by the stages.
#[derive(Debug, Clone)]
pub struct RequestCtx {
    pub id: String,
    pub started: Instant,
    pub endpoint: Endpoint,
    /// Client headers that travel upstream.
    pub forwarded: HeaderMap,
    /// All attempts together end here (pool `total_ms`, capped by `x-keel-timeout-ms`).
    pub deadline: Instant,
    /// Whether the client asked for a stream (keel may stream upstream either way).
    pub client_stream: bool,
    /// The client asked for a whole answer, which keel assembles from the events it streams
    /// upstream: only keel reads them, so what is done to each event for the client's eyes
    /// (its `model` renamed) is done once to the assembled answer instead. Unlike
    /// `client_stream`, continuations and retries leave it as the client set it.
    pub assembled: bool,
    pub force_variant: Option<String>,
    pub preference: Preference,
    pub min_tier: Option<u8>,
    /// Its rank in the wait line of a full pool: `x-keel-priority` (a client may ask for any
    /// priority while no keys are configured; a key's priority caps it).
    pub priority: Priority,
    /// Set when the client called the Responses API: the request runs as Chat Completions
    /// and delivery answers in Responses form.
    pub responses: Option<std::sync::Arc<crate::wire::responses::Front>>,
    /// The client's virtual key and what admission reserved for it; `None` when keel runs
    /// open. Shared by every clone of the context, so it settles when the last one (the
    /// relay's, for a stream) is dropped: see `keys::Grant`.
    pub grant: Option<std::sync::Arc<crate::state::keys::Grant>>,
    /// What admission changed in the prompt (`x-keel-prompt-fix` codes, e.g. a middle-out
    /// trim; see `context_fit`).
    pub prompt_fixes: Vec<String>,
    /// What normalization changed, for the decision record (`decision_prompt_edits`).
    pub prompt_edits: Vec<keel_core::normalize::Edit>,
    /// Messages middle-out dropped (`x-keel-trimmed-messages`; 0: none).
    pub trimmed_messages: usize,
    /// The tokens the attempts used (the key's meter when there is one), for the access log,
    /// the trace and the key's reconciliation.
    pub meter: std::sync::Arc<crate::observe::meter::Meter>,
    /// The request's trace span (tracing on only); attempts become its children.
    pub trace: Option<crate::observe::telemetry::RequestSpan>,
    /// `x-keel-consensus`: the variants to ask at once (see `consensus`).
    pub consensus: Option<usize>,
    /// What the PII and secret guard did to the request, and its placeholder map (request
    /// memory only; see `guard`). `None` when the pool has no guard.
    pub guard: Option<std::sync::Arc<crate::pipeline::guard::Guarded>>,
}
