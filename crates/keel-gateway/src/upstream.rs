//! The upstream side: a pooled keep-alive HTTP client per pool (HTTP/1.1 and HTTP/2 over
//! rustls, honouring HTTPS_PROXY / HTTP_PROXY / NO_PROXY), and how one upstream request is
//! built for a variant: URL, credential, forwarded headers.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};

use keel_core::protocol::{Endpoint, Protocol};

use crate::config::VariantConfig;

/// The default `anthropic-version` when a client does not send one.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// Builds the upstream client for one pool.
pub fn client(connect_ms: u64) -> reqwest::Client {
    crate::install_crypto();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(connect_ms))
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

/// Headers never forwarded upstream: hop-by-hop headers (RFC 9110 §7.6.1), framing that the
/// client re-computes, the client's credentials (keel presents the variant's own), cookies,
/// keel's own controls, and `accept-encoding` (keel parses the stream, so it asks for identity).
const NOT_FORWARDED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "authorization",
    "x-api-key",
    "api-key",
    "cookie",
    "accept-encoding",
    "content-type",
];

/// The client's headers that travel upstream.
pub fn forwarded_headers(client: &HeaderMap) -> HeaderMap {
    // Headers named in `Connection:` are hop-by-hop too.
    let listed: Vec<String> = client
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    let mut out = HeaderMap::new();
    for (name, value) in client {
        let n = name.as_str();
        if NOT_FORWARDED.contains(&n) || n.starts_with("x-keel-") || listed.iter().any(|l| l == n) {
            continue;
        }
        out.append(name.clone(), detached(value));
    }
    out
}

/// A copy of `v` in an allocation of its own. hyper parses header values as slices of the
/// connection's read buffer (8 KiB or more), so a value kept for a stream's life (the forwarded
/// headers travel with the request for continuations) would keep that buffer alive and make the
/// connection allocate another for its next read.
pub fn detached(v: &HeaderValue) -> HeaderValue {
    let mut out = HeaderValue::from_bytes(v.as_bytes()).unwrap_or_else(|_| v.clone());
    out.set_sensitive(v.is_sensitive());
    out
}

/// Builds the upstream request for one variant. `traceparent`, when tracing is on, is the
/// attempt span's W3C trace context and replaces the client's (which is forwarded unchanged
/// when tracing is off).
pub fn request(
    client: &reqwest::Client,
    variant: &VariantConfig,
    endpoint: Endpoint,
    forwarded: &HeaderMap,
    traceparent: Option<HeaderValue>,
    body: Vec<u8>,
) -> reqwest::RequestBuilder {
    let url = format!("{}{}", variant.url, endpoint.upstream_path());
    let mut headers = forwarded.clone();
    if let Some(tp) = traceparent {
        headers.insert(HeaderName::from_static("traceparent"), tp);
    }
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(key) = &variant.api_key {
        match variant.protocol {
            Protocol::OpenAi => {
                if let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}")) {
                    let mut v = v;
                    v.set_sensitive(true);
                    headers.insert(http::header::AUTHORIZATION, v);
                }
            }
            Protocol::Anthropic => {
                if let Ok(mut v) = HeaderValue::from_str(key) {
                    v.set_sensitive(true);
                    headers.insert(HeaderName::from_static("x-api-key"), v);
                }
            }
        }
    }
    if variant.protocol == Protocol::Anthropic && !headers.contains_key("anthropic-version") {
        headers.insert(
            HeaderName::from_static("anthropic-version"),
            HeaderValue::from_static(ANTHROPIC_VERSION),
        );
    }
    client.post(url).headers(headers).body(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forwarded value must not share the client connection's read buffer (hyper's header
    /// values are slices of it), or a live stream keeps that buffer for its whole life.
    #[test]
    fn forwarded_values_do_not_share_the_read_buffer() {
        let buffer = bytes::Bytes::from(b"GET / HTTP/1.1\r\nx-trace: abc\r\n\r\n".to_vec());
        let range = buffer.as_ptr() as usize..buffer.as_ptr() as usize + buffer.len();
        let at = 25; // "abc" in the buffer
        assert_eq!(&buffer[at..at + 3], b"abc");
        let mut sensitive = HeaderValue::from_maybe_shared(buffer.slice(at..at + 3)).unwrap();
        sensitive.set_sensitive(true);
        let mut h = HeaderMap::new();
        h.insert("x-trace", sensitive);
        let shared = h["x-trace"].as_bytes().as_ptr() as usize;
        assert!(
            range.contains(&shared),
            "the test's value must start as a slice"
        );
        let out = forwarded_headers(&h);
        let v = &out["x-trace"];
        assert_eq!(v.as_bytes(), b"abc");
        assert!(v.is_sensitive());
        assert!(!range.contains(&(v.as_bytes().as_ptr() as usize)));
    }

    #[test]
    fn strips_credentials_and_hop_by_hop() {
        let mut h = HeaderMap::new();
        h.insert(
            "authorization",
            HeaderValue::from_static("Bearer client-key"),
        );
        h.insert("x-api-key", HeaderValue::from_static("client-key"));
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-trace"),
        );
        h.insert("x-trace", HeaderValue::from_static("1"));
        h.insert("x-keel-session", HeaderValue::from_static("s"));
        h.insert("anthropic-version", HeaderValue::from_static("2023-06-01"));
        h.insert("openai-beta", HeaderValue::from_static("assistants=v2"));
        let f = forwarded_headers(&h);
        let names: Vec<&str> = f.keys().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(f.contains_key("anthropic-version") && f.contains_key("openai-beta"));
    }
}
