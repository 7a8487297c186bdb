//! The per-request context: what admission established about a request that every later stage
//! needs (its id, clocks, endpoint, controls, and the headers that travel upstream).

use http::HeaderMap;
use tokio::time::Instant;

use keel_core::protocol::Endpoint;
use keel_core::selection::Preference;

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
    pub force_variant: Option<String>,
    pub preference: Preference,
    pub min_tier: Option<u8>,
}
