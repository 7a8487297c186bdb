//! `forward_headers` (on a pool, or on one of its variants): which of the client's request
//! headers travel upstream. An allow-list, because the headers a client may send beside keel's
//! own upstream credential select accounts and features on the provider's side: with a
//! deny-list, `OpenAI-Organization` or `OpenAI-Project` from one tenant billed another account,
//! or earned an upstream 401 that looked like keel's credential failing, for every tenant.
//!
//! ```toml
//! forward_headers = ["traceparent", "tracestate", "x-request-id", "openai-organization"]
//! ```
//!
//! Without it, a variant forwards its protocol's own request headers that select nothing on
//! the provider's side (Anthropic's `anthropic-version` and `anthropic-beta`) and the trace
//! context (`traceparent`, `tracestate`, `x-request-id`). A variant's list replaces its pool's.
//! Credentials, cookies and the framing keel computes itself can never be listed.

use http::HeaderName;

use keel_core::protocol::Protocol;

use super::read::{Issues, Table};

/// Forwarded by every variant without a `forward_headers` of its own or its pool's.
const TRACE_CONTEXT: [&str; 3] = ["traceparent", "tracestate", "x-request-id"];

/// The protocol's own request headers that select nothing on the provider's side.
fn protocol_headers(protocol: Protocol) -> &'static [&'static str] {
    match protocol {
        Protocol::OpenAi => &[],
        Protocol::Anthropic => &["anthropic-version", "anthropic-beta"],
    }
}

/// Headers no list may name: the client's credentials (keel presents the variant's own),
/// cookies, hop-by-hop headers and the framing keel computes itself.
const NEVER: &[&str] = &[
    "authorization",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
    "cookie",
    "proxy-authorization",
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "accept-encoding",
];

/// The default list for a variant of `protocol`.
pub fn defaults(dialect: &super::cloud::Dialect) -> Vec<HeaderName> {
    use super::cloud::Dialect;
    // A client protocol's own headers mean something only to a server of that protocol.
    let own: &[&'static str] = match dialect {
        Dialect::OpenAi => protocol_headers(Protocol::OpenAi),
        Dialect::Anthropic => protocol_headers(Protocol::Anthropic),
        _ => &[],
    };
    TRACE_CONTEXT
        .iter()
        .chain(own)
        .map(|h| HeaderName::from_static(h))
        .collect()
}

/// `forward_headers` in table `t`, if written: each a valid header name, none of [`NEVER`]
/// nor keel's own `x-keel-*` controls.
pub(super) fn read(t: &mut Table, issues: &mut Issues) -> Option<Vec<HeaderName>> {
    let present = t.raw("forward_headers").is_some();
    let items = t.strings("forward_headers", issues);
    if !present {
        return None;
    }
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let lower = item.value.trim().to_ascii_lowercase();
        match HeaderName::from_bytes(lower.as_bytes()) {
            Ok(_) if NEVER.contains(&lower.as_str()) || lower.starts_with("x-keel-") => {
                issues.report(
                    item.at,
                    &item.path,
                    format!("`{lower}` is never forwarded: keel sends its own credentials and framing, and reads its own controls"),
                );
            }
            Ok(name) => {
                if !out.contains(&name) {
                    out.push(name);
                }
            }
            Err(_) => issues.report(
                item.at,
                &item.path,
                format!("not a header name: {:?}", item.value),
            ),
        }
    }
    Some(out)
}
