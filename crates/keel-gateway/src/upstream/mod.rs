//! The upstream side: how one upstream request is built for a variant (URL, credential,
//! forwarded headers) and sent.
//!
//! Two transports sit behind [`Client`]. Plain `http://` variants (vLLM, SGLang, llama.cpp on
//! the same network: the latency-critical case) go through keel's own keep-alive pool of
//! HTTP/1.1 connections, each read and written by the task of the request using it
//! ([`direct`]): no connection task, no hop between tasks per chunk, no shared lock, and a
//! connection that holds only its socket and a small read buffer. `https://` variants (hosted
//! APIs, HTTP/2 by ALPN), URLs with credentials in them, and every variant when an HTTP proxy
//! is configured (`HTTP_PROXY` / `ALL_PROXY`) go through reqwest (rustls, `HTTPS_PROXY` /
//! `HTTP_PROXY` / `NO_PROXY`). A variant with a private CA or a client certificate of its own
//! gets its own reqwest client (see [`Client`]).

pub mod cloud;
mod direct;
pub(crate) use direct::fuzz_response;
pub mod translation;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt, TryStreamExt};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use keel_core::protocol::{Endpoint, Protocol};

use crate::config::VariantConfig;
use crate::wire::errors::{chain, ErrorKind, GatewayError};

/// The default `anthropic-version` when a client does not send one.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// An upstream response's body, chunk by chunk; it keeps returning `None` after its end.
pub type Body = Pin<Box<dyn BodyStream>>;

/// A response body's chunks, and whether their reader saw the response's last event.
///
/// A body dropped before its end means one of two things. Its reader saw the stream's terminal
/// event (`[DONE]`, `message_stop`) and only the transfer's own end is still to come: reading
/// on to it keeps the connection for the next request. Or its reader gave the response up (a
/// client gone, a stall left for another variant, a hedge's loser): the upstream should see
/// the connection close at once and stop generating. [`BodyStream::reached_end`] says the
/// first; without it a dropped body is given up.
pub trait BodyStream: Stream<Item = Result<Bytes, GatewayError>> + Send {
    /// The reader saw the response's last event; nothing it needs is left to read.
    fn reached_end(self: Pin<&mut Self>) {}
}

/// reqwest's bodies: its connection pool finishes or closes a dropped body itself.
impl<S: Stream<Item = Result<Bytes, GatewayError>> + Send> BodyStream
    for futures_util::stream::Fuse<S>
{
}

/// A body with nothing in it.
impl BodyStream for futures_util::stream::Empty<Result<Bytes, GatewayError>> {}

/// An upstream's answer: its head, and its body still to read.
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Body,
    /// What a dialect's edge dropped or changed in the request (`x-keel-prompt-fix`).
    pub fixes: Vec<String>,
}

impl Response {
    /// The body's declared length, when it has one.
    pub fn content_length(&self) -> Option<u64> {
        self.headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    }
}

/// Whether an io error (anywhere in `e`'s sources) is a refused connection.
fn refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut src = Some(e);
    while let Some(s) = src {
        if s.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        src = s.source();
    }
    false
}

/// Why an upstream request failed below HTTP: connecting (refused, or anything else), or the
/// connection failing later. The message never carries the URL.
impl From<reqwest::Error> for GatewayError {
    fn from(e: reqwest::Error) -> GatewayError {
        let connect = e.is_connect();
        let e = e.without_url();
        let kind = match (connect, refused(&e)) {
            (true, true) => ErrorKind::Refused,
            (true, false) => ErrorKind::Connect,
            _ => ErrorKind::Io,
        };
        GatewayError::upstream(kind, &e)
    }
}

/// One pool's upstream client: keel's own HTTP/1.1 pool for plain-HTTP variants, reqwest for
/// the rest (and for the monitor's probes and scrapes). A variant with TLS settings of its own
/// (a private CA, a client certificate) has a reqwest client of its own, built with the pool.
#[derive(Clone)]
pub struct Client {
    direct: Option<Arc<direct::Direct>>,
    http: reqwest::Client,
    /// By variant name; empty unless some variant sets `ca_file` or a client certificate.
    own: Arc<[(String, reqwest::Client)]>,
    /// The edges of dialect variants (Azure, Gemini, Vertex AI, Bedrock, Responses), by name.
    edges: Arc<[(String, Arc<cloud::Edge>)]>,
    /// The connection caps of variants with `max_connections`, by name (see [`direct`]).
    caps: Arc<[(String, Arc<direct::Cap>)]>,
}

/// reqwest's settings for every upstream client of a pool.
fn reqwest_builder(connect: Duration) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .connect_timeout(connect)
        .pool_idle_timeout(direct::IDLE_TIMEOUT)
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        // Never follow a redirect: it would carry the variant's credential elsewhere.
        .redirect(reqwest::redirect::Policy::none())
}

/// The client of a variant with TLS settings: its CA bundle trusted besides the system's
/// roots, its client certificate presented when the server asks for one. The files were read
/// and checked with the config, so a failure here is unexpected: logged, and the variant uses
/// the pool's client (its requests then fail the server's verification, visibly).
fn variant_client(
    connect: Duration,
    variant: &VariantConfig,
    tls: &crate::config::UpstreamTls,
) -> Option<reqwest::Client> {
    let mut builder = reqwest_builder(connect);
    let built = (|| {
        if let Some(pem) = &tls.ca_pem {
            builder = builder.tls_certs_merge(reqwest::Certificate::from_pem_bundle(pem)?);
        }
        if let Some(pem) = &tls.identity_pem {
            builder = builder.identity(reqwest::Identity::from_pem(pem)?);
        }
        builder.build()
    })();
    match built {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::error!(variant = %variant.name, error = %chain(&e), "the variant's TLS settings are unusable: it uses the pool's client");
            None
        }
    }
}

/// Builds the upstream client for one pool of `variants`; `opened` counts the connections
/// keel's own pool opens, `token_fetches` a variant's OAuth token fetches, `held` the
/// connections open under a variant's `max_connections`.
pub fn client(
    connect_ms: u64,
    opened: metrics::Counter,
    token_fetches: &dyn Fn(&str) -> metrics::Counter,
    held: &dyn Fn(&str) -> Option<metrics::Gauge>,
    variants: &[VariantConfig],
) -> Client {
    crate::config::install_crypto();
    let connect = Duration::from_millis(connect_ms);
    let http = reqwest_builder(connect)
        .build()
        .unwrap_or_else(|e| {
            // A proxy setting from the environment that reqwest cannot read, most likely.
            tracing::error!(error = %e, "cannot build the upstream HTTP client as configured; using one without proxies");
            reqwest::Client::builder()
                .connect_timeout(connect)
                .redirect(reqwest::redirect::Policy::none())
                .no_proxy()
                .build()
                .unwrap_or_default()
        });
    let own = variants
        .iter()
        .filter_map(|v| {
            let tls = v.tls.as_ref()?;
            Some((v.name.clone(), variant_client(connect, v, tls)?))
        })
        .collect();
    // A proxy for plain HTTP applies to every `http://` variant: reqwest honours it (and
    // NO_PROXY); keel's own pool connects only directly.
    let proxied = ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]
        .iter()
        .any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()));
    let mut client = Client {
        direct: (!proxied).then(|| Arc::new(direct::Direct::new(connect, opened))),
        http,
        own,
        edges: Arc::new([]),
        caps: variants
            .iter()
            .filter_map(|v| {
                let max = v.max_connections?;
                Some((v.name.clone(), direct::Cap::new(max, held(&v.name))))
            })
            .collect(),
    };
    let edges: Vec<(String, Arc<cloud::Edge>)> = variants
        .iter()
        .filter_map(|v| {
            let edge = Arc::new(cloud::Edge::of(v, token_fetches(&v.name))?);
            if tokio::runtime::Handle::try_current().is_ok() {
                edge.warm(client.http(&v.name).clone());
            }
            Some((v.name.clone(), edge))
        })
        .collect();
    client.edges = edges.into();
    client
}

impl Client {
    /// Connections open under `variant`'s `max_connections` now (`None`: no cap).
    pub fn connections_held(&self, variant: &str) -> Option<u32> {
        self.cap(variant).map(|c| c.held())
    }

    fn cap(&self, variant: &str) -> Option<&Arc<direct::Cap>> {
        self.caps.iter().find(|(n, _)| n == variant).map(|(_, c)| c)
    }

    /// The reqwest client for `variant`'s requests off the request path (the monitor's
    /// probes and scrapes).
    pub fn http(&self, variant: &str) -> &reqwest::Client {
        self.own
            .iter()
            .find(|(name, _)| name == variant)
            .map_or(&self.http, |(_, c)| c)
    }

    /// Sends one request to `variant` and returns the response head; the body is read from
    /// the response. A dialect variant's request leaves, and its answer arrives, through its
    /// edge (see [`cloud`]): the caller sends and reads the hub protocol.
    pub async fn send(&self, variant: &str, req: Request) -> Result<Response, GatewayError> {
        let Some((_, edge)) = self.edges.iter().find(|(name, _)| name == variant) else {
            return self.transport(variant, req).await;
        };
        let (req, pending) = match edge.outbound(req, self.http(variant)).await {
            Ok(sendable) => sendable,
            Err(answered) => return answered,
        };
        pending.inbound(self.transport(variant, req).await?).await
    }

    async fn transport(&self, variant: &str, req: Request) -> Result<Response, GatewayError> {
        if let Some(direct) = &self.direct {
            if let Some(target) = direct.target(&req.url) {
                return direct
                    .send(target, self.cap(variant), req.headers, req.body)
                    .await;
            }
        }
        let resp = self
            .http(variant)
            .post(req.url)
            .headers(req.headers)
            .body(req.body)
            .send()
            .await?;
        Ok(Response {
            status: resp.status(),
            headers: resp.headers().clone(),
            body: Box::pin(resp.bytes_stream().map_err(GatewayError::from).fuse()),
            fixes: Vec::new(),
        })
    }
}

/// An upstream request, ready to send.
pub struct Request {
    pub url: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// Headers never forwarded upstream: hop-by-hop headers (RFC 9110 §7.6.1), framing that the
/// client re-computes, the client's credentials (keel presents the variant's own), cookies,
/// keel's own controls, `accept-encoding` (keel parses the stream, so it asks for identity) and
/// `expect` (keel has read the whole body already; curl sends `100-continue` with large ones).
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
    "expect",
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

/// Builds the upstream request for one variant: of the client's headers (`forwarded`), only
/// those the variant's `forward_headers` lists. `traceparent`, when tracing is on, is the
/// attempt span's W3C trace context and replaces the client's (which is forwarded unchanged
/// when tracing is off and the list has it).
pub fn request(
    variant: &VariantConfig,
    endpoint: Endpoint,
    forwarded: &HeaderMap,
    traceparent: Option<HeaderValue>,
    body: Vec<u8>,
) -> Request {
    let url = format!("{}{}", variant.url, endpoint.upstream_path());
    let mut headers = HeaderMap::with_capacity(variant.forward_headers.len() + 4);
    for name in &variant.forward_headers {
        for v in forwarded.get_all(name) {
            headers.append(name.clone(), v.clone());
        }
    }
    if let Some(tp) = traceparent {
        headers.insert(HeaderName::from_static("traceparent"), tp);
    }
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    // A dialect's credentials are its edge's to add (see `cloud::Edge::outbound`).
    let native_key = variant
        .api_key
        .as_ref()
        .filter(|_| variant.dialect.is_native());
    if let Some(key) = native_key {
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
                    headers.insert(crate::wire::X_API_KEY, v);
                }
            }
        }
    }
    if variant.dialect == crate::config::cloud::Dialect::Anthropic
        && !headers.contains_key(crate::wire::ANTHROPIC_VERSION_HEADER)
    {
        headers.insert(
            crate::wire::ANTHROPIC_VERSION_HEADER,
            HeaderValue::from_static(ANTHROPIC_VERSION),
        );
    }
    Request {
        url,
        headers,
        body: Bytes::from(body),
    }
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
        h.insert("expect", HeaderValue::from_static("100-continue"));
        h.insert("anthropic-version", HeaderValue::from_static("2023-06-01"));
        h.insert("openai-beta", HeaderValue::from_static("assistants=v2"));
        let f = forwarded_headers(&h);
        let names: Vec<&str> = f.keys().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(f.contains_key("anthropic-version") && f.contains_key("openai-beta"));
    }
}
