//! What the client sees on the wire, whoever produces it: response bodies, the client-side
//! writer, errors in the client's protocol, the Responses API's shape, the route table and
//! request ids.

pub mod body;
pub mod client_write;
pub mod errors;
pub mod request_id;
pub mod responses;
pub mod routes;

/// The response header naming what a pool's guard found in the request and did about it.
pub const GUARD_HEADER: http::HeaderName = http::HeaderName::from_static("x-keel-guard");

/// `anthropic-version`: on a shared path it marks an Anthropic client; keel sends it upstream.
pub const ANTHROPIC_VERSION_HEADER: http::HeaderName =
    http::HeaderName::from_static("anthropic-version");

/// Anthropic's key header: a client may present its key in it, and keel presents a variant's.
pub const X_API_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");

/// The headers a client may send to steer its own request (admission reads them and narrows
/// them by the client's key), as names built at compile time: a lookup by a `&str` name parses
/// the name first, and every request looks for each of these.
pub mod control {
    use http::HeaderName;

    pub const SESSION: HeaderName = HeaderName::from_static("x-keel-session");
    pub const TIMEOUT_MS: HeaderName = HeaderName::from_static("x-keel-timeout-ms");
    pub const FORCE_VARIANT: HeaderName = HeaderName::from_static("x-keel-force-variant");
    pub const PREFERENCE: HeaderName = HeaderName::from_static("x-keel-preference");
    pub const MIN_TIER: HeaderName = HeaderName::from_static("x-keel-min-tier");
    pub const PRIORITY: HeaderName = HeaderName::from_static("x-keel-priority");
    pub const NORMALIZE: HeaderName = HeaderName::from_static("x-keel-normalize");
}
