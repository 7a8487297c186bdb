//! The upstream edge of a dialect variant (Azure, Gemini, Vertex AI, Bedrock, the Responses
//! API): the hub request becomes the dialect's (path, body, credentials) as it leaves, and the
//! dialect's answer becomes the hub's as it arrives. Everything before [`Edge::outbound`] and
//! after [`Edge::inbound`] sees a variant of the hub protocol (see `keel_core::dialect`).
//!
//! Credentials that expire are kept warm here: a Vertex AI service account's OAuth token is
//! fetched once, then refreshed in the background well before it expires, so no request waits
//! for a token once one has been fetched.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde_json::{Map, Value};

use keel_core::dialect::{self, DialectRequest, StreamToHub};
use keel_core::protocol::{ErrorKind, Protocol};
use keel_core::request::RequestError;

use super::{Body, BodyStream, Request, Response};
use crate::config::cloud::{Dialect, ServiceAccount, VertexAuth};
use crate::config::VariantConfig;
use crate::wire::errors::{ErrorKind as TransportError, GatewayError};

/// The most of a whole answer or an error body the edge reads to translate it.
const MAX_TRANSLATED_BYTES: usize = 64 << 20;

/// The OAuth scope Vertex AI's calls need.
const CLOUD_PLATFORM_SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";

/// A service-account token is refreshed once it has less than this left (Google's last an
/// hour), in the background, while requests keep using it.
const REFRESH_BEFORE_EXPIRY: Duration = Duration::from_secs(15 * 60);

/// One dialect variant's edge.
pub struct Edge {
    variant: VariantConfig,
    tokens: Option<Arc<TokenSource>>,
}

/// How to read a dialect's answer back into the hub.
enum Answer {
    Gemini,
    Bedrock,
    Responses {
        include_usage: bool,
    },
    Azure,
    /// Vertex AI's Claude answers in Anthropic's own words.
    Anthropic,
}

impl Edge {
    /// The edge of `variant`, or `None` when it speaks a client protocol itself.
    pub fn of(variant: &VariantConfig, fetches: metrics::Counter) -> Option<Edge> {
        if variant.dialect.is_native() {
            return None;
        }
        let tokens = match &variant.dialect {
            Dialect::Vertex(v) => match &v.auth {
                VertexAuth::ServiceAccount(sa) => {
                    Some(Arc::new(TokenSource::new(sa.clone(), fetches)))
                }
                VertexAuth::AccessToken(_) => None,
            },
            _ => None,
        };
        Some(Edge {
            variant: variant.clone(),
            tokens,
        })
    }

    /// Warms the variant's credentials (a service account's first token), off any request's
    /// path; a failure is retried by the first request.
    pub fn warm(self: &Arc<Self>, http: reqwest::Client) {
        if let Some(tokens) = self.tokens.clone() {
            tokio::spawn(async move {
                if let Err(e) = tokens.bearer(&http).await {
                    tracing::warn!(error = %e, "cannot fetch the service account's first token");
                }
            });
        }
    }

    /// The hub request as the dialect's, credentials included. `Err`: an answer of its own (the
    /// request cannot be expressed for this dialect, or the credentials cannot be had).
    pub(super) async fn outbound(
        &self,
        mut req: Request,
        http: &reqwest::Client,
    ) -> Result<(Request, Pending), Result<Response, GatewayError>> {
        let hub: Map<String, Value> = match serde_json::from_slice(&req.body) {
            Ok(Value::Object(m)) => m,
            _ => {
                return Err(Ok(refusal(
                    self.variant.protocol,
                    "the request body is not a JSON object",
                )))
            }
        };
        let stream = hub.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let (path, translated, answer) = translate(&self.variant, &hub, stream)
            .map_err(|e| Ok(refusal(self.variant.protocol, &e.message)))?;
        req.url = format!("{}{path}", self.variant.url);
        req.body = Bytes::from(translated.body);
        self.authorize(&mut req, http).await.map_err(Err)?;
        Ok((
            req,
            Pending {
                answer,
                stream,
                fixes: translated.fixes,
                model: self.variant.upstream_model.clone(),
            },
        ))
    }

    /// Adds the dialect's credentials to `req` (the variant's static ones were not added for
    /// dialects: see `upstream::request`).
    async fn authorize(
        &self,
        req: &mut Request,
        http: &reqwest::Client,
    ) -> Result<(), GatewayError> {
        let key = self.variant.api_key.as_deref();
        let h = &mut req.headers;
        match &self.variant.dialect {
            Dialect::Azure(a) => match (&a.ad_token, key) {
                (Some(token), _) => {
                    insert_secret(h, http::header::AUTHORIZATION, &format!("Bearer {token}"))
                }
                (None, Some(k)) => insert_secret(h, HeaderName::from_static("api-key"), k),
                (None, None) => {}
            },
            Dialect::Gemini => {
                if let Some(k) = key {
                    insert_secret(h, HeaderName::from_static("x-goog-api-key"), k);
                }
            }
            Dialect::Vertex(v) => {
                let bearer = match (&v.auth, &self.tokens) {
                    (_, Some(tokens)) => tokens.bearer(http).await?,
                    (VertexAuth::AccessToken(t), None) => format!("Bearer {t}"),
                    (VertexAuth::ServiceAccount(_), None) => String::new(),
                };
                insert_secret(h, http::header::AUTHORIZATION, &bearer);
            }
            Dialect::Bedrock(b) => match &b.keys {
                Some(keys) => sign_sigv4(req, &b.region, keys)?,
                None => {
                    if let Some(k) = key {
                        insert_secret(h, http::header::AUTHORIZATION, &format!("Bearer {k}"));
                    }
                }
            },
            Dialect::OpenAiResponses => {
                if let Some(k) = key {
                    insert_secret(h, http::header::AUTHORIZATION, &format!("Bearer {k}"));
                }
            }
            Dialect::OpenAi | Dialect::Anthropic => {}
        }
        Ok(())
    }
}

/// Whether `variant` (a dialect variant) can carry `hub`, the request in its hub protocol.
pub fn check(variant: &VariantConfig, hub: &Map<String, Value>) -> Result<(), RequestError> {
    let stream = hub.get("stream").and_then(Value::as_bool).unwrap_or(false);
    translate(variant, hub, stream).map(|_| ())
}

/// The dialect's path (after the variant's base URL), body, and how its answer reads back.
fn translate(
    variant: &VariantConfig,
    hub: &Map<String, Value>,
    stream: bool,
) -> Result<(String, DialectRequest, Answer), RequestError> {
    let model = &variant.upstream_model;
    Ok(match &variant.dialect {
        Dialect::Azure(a) => {
            let path = match &a.deployment {
                Some(d) => format!(
                    "/openai/deployments/{}/chat/completions?api-version={}",
                    path_segment(d),
                    path_segment(&a.api_version)
                ),
                None => "/openai/v1/chat/completions".to_owned(),
            };
            let body = serde_json::to_vec(hub).map_err(|e| RequestError::invalid(e.to_string()))?;
            (
                path,
                DialectRequest {
                    body,
                    fixes: Vec::new(),
                },
                Answer::Azure,
            )
        }
        Dialect::Gemini => (
            format!(
                "/v1beta/models/{}:{}",
                path_segment(model),
                gemini_method(stream)
            ),
            dialect::gemini::request(hub)?,
            Answer::Gemini,
        ),
        Dialect::Vertex(v) => {
            let base = format!(
                "/v1/projects/{}/locations/{}/publishers",
                path_segment(&v.project),
                path_segment(&v.location)
            );
            if is_claude(model) {
                let method = if stream {
                    "streamRawPredict"
                } else {
                    "rawPredict"
                };
                (
                    format!("{base}/anthropic/models/{}:{method}", path_segment(model)),
                    dialect::vertex_claude_request(hub.clone()),
                    Answer::Anthropic,
                )
            } else {
                (
                    format!(
                        "{base}/google/models/{}:{}",
                        path_segment(model),
                        gemini_method(stream)
                    ),
                    dialect::gemini::request(hub)?,
                    Answer::Gemini,
                )
            }
        }
        Dialect::Bedrock(_) => {
            let method = if stream {
                "converse-stream"
            } else {
                "converse"
            };
            (
                format!("/model/{}/{method}", path_segment(model)),
                dialect::bedrock::request(hub)?,
                Answer::Bedrock,
            )
        }
        Dialect::OpenAiResponses => {
            let include_usage = hub
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            (
                "/responses".to_owned(),
                dialect::responses::request(hub)?,
                Answer::Responses { include_usage },
            )
        }
        Dialect::OpenAi | Dialect::Anthropic => {
            return Err(RequestError::invalid("not a dialect variant"))
        }
    })
}

fn gemini_method(stream: bool) -> &'static str {
    if stream {
        "streamGenerateContent?alt=sse"
    } else {
        "generateContent"
    }
}

/// Vertex AI serves Claude under `publishers/anthropic`, everything else it hosts for Google.
fn is_claude(model: &str) -> bool {
    model.starts_with("claude")
}

/// `s` percent-encoded for one path segment (a Bedrock model id has `:`; an inference profile
/// ARN has `/` and `:`).
fn path_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

fn insert_secret(h: &mut HeaderMap, name: HeaderName, value: &str) {
    if let Ok(mut v) = HeaderValue::from_str(value) {
        v.set_sensitive(true);
        h.insert(name, v);
    }
}

/// A 400 in the hub's words: the dialect cannot express the request (execution checked
/// beforehand, so this is the rare case a continuation cannot be expressed).
fn refusal(protocol: Protocol, message: &str) -> Response {
    let body = GatewayError::new(ErrorKind::InvalidRequest, message)
        .body(protocol)
        .to_string();
    whole_response(
        StatusCode::BAD_REQUEST,
        HeaderMap::new(),
        body.into_bytes(),
        Vec::new(),
    )
}

fn whole_response(
    status: StatusCode,
    mut headers: HeaderMap,
    body: Vec<u8>,
    fixes: Vec<String>,
) -> Response {
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    Response {
        status,
        headers,
        body: Box::pin(futures_util::stream::iter([Ok(Bytes::from(body))]).fuse()),
        fixes,
    }
}

/// Signs `req` with SigV4 for the `bedrock` service (the AWS SDKs' own signer).
pub fn sign_sigv4(
    req: &mut Request,
    region: &str,
    keys: &crate::config::cloud::AwsKeys,
) -> Result<(), GatewayError> {
    use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SigningSettings};
    use aws_sigv4::sign::v4;
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        GatewayError::new(
            TransportError::Connect,
            format!("cannot sign the request ({what}): {e}"),
        )
    };
    let identity = aws_credential_types::Credentials::new(
        &keys.access_key_id,
        &keys.secret_access_key,
        keys.session_token.clone(),
        None,
        "keel-config",
    )
    .into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name("bedrock")
        .time(SystemTime::now())
        .settings(SigningSettings::default())
        .build()
        .map_err(|e| fail("parameters", &e))?
        .into();
    let headers: Vec<(&str, &str)> = req
        .headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)))
        .collect();
    let signable = SignableRequest::new(
        "POST",
        &req.url,
        headers.into_iter(),
        SignableBody::Bytes(&req.body),
    )
    .map_err(|e| fail("request", &e))?;
    let (instructions, _) = sign(signable, &params)
        .map_err(|e| fail("signature", &e))?
        .into_parts();
    let (headers, _) = instructions.into_parts();
    for h in headers {
        if let (Ok(name), Ok(mut value)) = (
            HeaderName::from_bytes(h.name().as_bytes()),
            HeaderValue::from_str(h.value()),
        ) {
            value.set_sensitive(h.sensitive());
            req.headers.insert(name, value);
        }
    }
    Ok(())
}

/// What reading the answer needs, between sending and answering.
pub(super) struct Pending {
    answer: Answer,
    stream: bool,
    fixes: Vec<String>,
    model: String,
}

impl Pending {
    /// The dialect's answer as the hub's: an error body or a whole answer read and translated
    /// here, a stream translated as it is read.
    pub(super) async fn inbound(self, mut resp: Response) -> Result<Response, GatewayError> {
        let error_type = resp
            .headers
            .get("x-amzn-errortype")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let mut headers = HeaderMap::new();
        for name in [
            "x-request-id",
            "request-id",
            "retry-after",
            "retry-after-ms",
            "x-amzn-requestid",
        ] {
            if let Some(v) = resp.headers.get(name) {
                headers.insert(name, v.clone());
            }
        }
        if resp.status.is_success() && self.stream {
            let hub: Box<dyn StreamToHub> = match self.answer {
                Answer::Gemini => Box::new(dialect::gemini::Stream::new(&self.model)),
                Answer::Bedrock => Box::new(dialect::bedrock::Stream::new(&self.model)),
                Answer::Responses { include_usage } => {
                    Box::new(dialect::responses::Stream::new(&self.model, include_usage))
                }
                Answer::Azure => Box::new(dialect::azure::Stream::new()),
                Answer::Anthropic => {
                    return Ok(Response {
                        fixes: self.fixes,
                        ..resp
                    })
                }
            };
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            return Ok(Response {
                status: resp.status,
                headers,
                body: Box::pin(Translated {
                    inner: resp.body,
                    hub,
                    ended: false,
                }),
                fixes: self.fixes,
            });
        }
        let body = read_all(&mut resp.body).await?;
        let status = resp.status;
        let out = if status.is_success() {
            let whole = match self.answer {
                Answer::Gemini => dialect::gemini::whole(&body, &self.model),
                Answer::Bedrock => dialect::bedrock::whole(&body, &self.model),
                Answer::Responses { .. } => dialect::responses::whole(&body, &self.model),
                Answer::Azure => dialect::azure::whole(&body),
                Answer::Anthropic => Ok(body),
            };
            match whole {
                Ok(b) => b,
                // Not the dialect's answer: the attempt reads it as the malformed body it is.
                Err(e) => format!("the upstream's answer cannot be read: {e}").into_bytes(),
            }
        } else {
            if let Some(secs) = google_retry_delay(&body) {
                headers
                    .entry(http::header::RETRY_AFTER)
                    .or_insert(HeaderValue::from(secs));
            }
            match self.answer {
                Answer::Gemini => dialect::gemini::error(status.as_u16(), &body),
                Answer::Bedrock => {
                    dialect::bedrock::error(status.as_u16(), error_type.as_deref(), &body)
                }
                Answer::Responses { .. } => dialect::responses::error(status.as_u16(), &body),
                Answer::Azure | Answer::Anthropic => body,
            }
        };
        Ok(whole_response(status, headers, out, self.fixes))
    }
}

/// A Google error's `RetryInfo.retryDelay` ("12s"), in whole seconds rounded up.
fn google_retry_delay(body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let details = v.pointer("/error/details")?.as_array()?;
    details.iter().find_map(|d| {
        let s = d.get("retryDelay")?.as_str()?.strip_suffix('s')?;
        let secs: f64 = s.parse().ok()?;
        (secs.is_finite() && secs >= 0.0).then(|| secs.ceil() as u64)
    })
}

async fn read_all(body: &mut Body) -> Result<Vec<u8>, GatewayError> {
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk?;
        if out.len() + chunk.len() > MAX_TRANSLATED_BYTES {
            return Err(GatewayError::new(
                TransportError::Io,
                format!("the answer exceeds {MAX_TRANSLATED_BYTES} bytes"),
            ));
        }
        out.extend_from_slice(&chunk);
    }
    body.as_mut().reached_end();
    Ok(out)
}

/// A dialect's stream read as the hub's.
struct Translated {
    inner: Body,
    hub: Box<dyn StreamToHub>,
    ended: bool,
}

impl Stream for Translated {
    type Item = Result<Bytes, GatewayError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.ended {
                return Poll::Ready(None);
            }
            let mut out = Vec::new();
            let step = match this.inner.as_mut().poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(chunk))) => this.hub.feed(&chunk, &mut out),
                Poll::Ready(None) => {
                    this.ended = true;
                    this.hub.end(&mut out)
                }
            };
            if let Err(e) = step {
                this.ended = true;
                return Poll::Ready(Some(Err(GatewayError::new(
                    TransportError::Io,
                    format!("malformed upstream stream: {e}"),
                ))));
            }
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Bytes::from(out))));
            }
        }
    }
}

impl BodyStream for Translated {
    fn reached_end(mut self: Pin<&mut Self>) {
        self.inner.as_mut().reached_end();
    }
}

/// A service account's OAuth token: fetched with a signed JWT grant at the key file's
/// `token_uri`, kept, and refreshed in the background before it expires.
pub struct TokenSource {
    account: Arc<ServiceAccount>,
    current: tokio::sync::Mutex<Option<Token>>,
    refreshing: std::sync::atomic::AtomicBool,
    fetches: metrics::Counter,
}

#[derive(Clone)]
struct Token {
    bearer: String,
    expires_at: tokio::time::Instant,
}

impl TokenSource {
    fn new(account: Arc<ServiceAccount>, fetches: metrics::Counter) -> TokenSource {
        TokenSource {
            account,
            current: tokio::sync::Mutex::new(None),
            refreshing: std::sync::atomic::AtomicBool::new(false),
            fetches,
        }
    }

    /// The `Authorization` value. Waits only when no unexpired token is held (the first
    /// request, or after a long failure to refresh); otherwise a token close to expiry is
    /// refreshed by a task of its own while this request uses it.
    async fn bearer(self: &Arc<Self>, http: &reqwest::Client) -> Result<String, GatewayError> {
        let now = tokio::time::Instant::now();
        {
            let held = self.current.lock().await;
            if let Some(t) = held.as_ref().filter(|t| t.expires_at > now) {
                if t.expires_at - now < REFRESH_BEFORE_EXPIRY
                    && !self
                        .refreshing
                        .swap(true, std::sync::atomic::Ordering::AcqRel)
                {
                    let me = self.clone();
                    let http = http.clone();
                    tokio::spawn(async move {
                        if let Err(e) = me.refresh(&http).await {
                            tracing::warn!(error = %e, "cannot refresh the service account's token; the current one is used until it expires");
                        }
                        me.refreshing
                            .store(false, std::sync::atomic::Ordering::Release);
                    });
                }
                return Ok(t.bearer.clone());
            }
        }
        self.refresh(http).await
    }

    /// Fetches a token unless another fetch made a fresh one meanwhile.
    async fn refresh(&self, http: &reqwest::Client) -> Result<String, GatewayError> {
        let mut held = self.current.lock().await;
        let now = tokio::time::Instant::now();
        if let Some(t) = held
            .as_ref()
            .filter(|t| t.expires_at - now.min(t.expires_at) > REFRESH_BEFORE_EXPIRY)
        {
            return Ok(t.bearer.clone());
        }
        let token = self.fetch(http).await?;
        let bearer = token.bearer.clone();
        *held = Some(token);
        Ok(bearer)
    }

    async fn fetch(&self, http: &reqwest::Client) -> Result<Token, GatewayError> {
        let fail = |message: String| GatewayError::new(TransportError::Connect, message);
        self.fetches.increment(1);
        let assertion = grant_assertion(&self.account, unix_now())?;
        let form = format!(
            "grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer&assertion={assertion}"
        );
        let started = tokio::time::Instant::now();
        let resp = http
            .post(&self.account.token_uri)
            .header(
                http::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .body(form)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .map_err(|e| fail(format!("the token endpoint: {}", GatewayError::from(e))))?;
        let status = resp.status();
        let body: Value = resp.json().await.map_err(|e| {
            fail(format!(
                "the token endpoint's answer: {}",
                GatewayError::from(e)
            ))
        })?;
        let token = body.get("access_token").and_then(Value::as_str);
        let (true, Some(token)) = (status.is_success(), token) else {
            return Err(fail(format!(
                "the token endpoint answered {status}: {}",
                keel_core::protocol::error_summary(&body)
            )));
        };
        let lifetime = body
            .get("expires_in")
            .and_then(Value::as_u64)
            .unwrap_or(3600);
        Ok(Token {
            bearer: format!("Bearer {token}"),
            expires_at: started + Duration::from_secs(lifetime),
        })
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The RS256-signed JWT a service account presents for a token (RFC 7523, as Google's client
/// libraries build it).
fn grant_assertion(sa: &ServiceAccount, now: u64) -> Result<String, GatewayError> {
    let failed = |why: String| GatewayError::new(TransportError::Connect, why);
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::RS256);
    header.kid = sa.private_key_id.clone();
    let claims = serde_json::json!({
        "iss": sa.client_email,
        "scope": CLOUD_PLATFORM_SCOPE,
        "aud": sa.token_uri,
        "iat": now,
        "exp": now + 3600,
    });
    let key = jsonwebtoken::EncodingKey::from_rsa_pem(sa.private_key.as_bytes())
        .map_err(|e| failed(format!("the service account's key: {e}")))?;
    jsonwebtoken::encode(&header, &claims, &key)
        .map_err(|e| failed(format!("signing the grant: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(
            path_segment("anthropic.claude-3-5-sonnet-20241022-v2:0"),
            "anthropic.claude-3-5-sonnet-20241022-v2%3A0"
        );
        assert_eq!(
            path_segment("arn:aws:bedrock:us-east-1:1:x/y"),
            "arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Ax%2Fy"
        );
    }

    #[test]
    fn google_retry_delay_is_read_from_retry_info() {
        let body = br#"{"error":{"code":429,"status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"12.5s"}]}}"#;
        assert_eq!(google_retry_delay(body), Some(13));
        assert_eq!(google_retry_delay(br#"{"error":{"code":429}}"#), None);
    }
}
