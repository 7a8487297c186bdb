//! OpenTelemetry traces, exported over OTLP/HTTP when `[telemetry] otlp_endpoint` is set: one
//! SERVER span per client request and one CLIENT span per upstream attempt (its child), with
//! the GenAI semantic-convention attributes and keel's decisions (docs/src/logs.md lists them).
//!
//! W3C trace context: a client's `traceparent` (and `tracestate`) makes the request span its
//! child; each attempt sends its own span's `traceparent` upstream, so a traced model server
//! joins the same trace.
//!
//! **No telemetry, no cost.** Without an endpoint [`Telemetry`] holds nothing: starting a
//! request span is one `Option` check that returns `None`, and every later step (attempt spans,
//! `traceparent` headers, attributes) hangs off that `None`. Spans are handed to the SDK's
//! batch processor: a bounded queue (spans beyond it are dropped, never waited for) exported
//! from its own thread (see `export`).

mod export;

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderValue};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider, Span,
};
use tokio::time::Instant;

use keel_core::protocol::Endpoint;

use crate::config::{TelemetryConfig, VariantConfig};

/// Spans waiting for export; more are dropped (the SDK counts them) rather than waited for.
const MAX_QUEUED_SPANS: usize = 4096;
/// How often queued spans are sent.
const EXPORT_EVERY: Duration = Duration::from_secs(2);

/// The tracer, when tracing is configured.
#[derive(Default)]
pub struct Telemetry {
    inner: Option<(SdkTracerProvider, SdkTracer)>,
}

/// The GenAI operation an endpoint performs (`gen_ai.operation.name`).
pub fn operation(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Messages => "chat",
        Endpoint::Completions => "text_completion",
        Endpoint::Embeddings => "embeddings",
        // Not a GenAI operation of the conventions; named for what it is.
        Endpoint::CountTokens => "count_tokens",
    }
}

impl Telemetry {
    /// Tracing as configured; disabled (with the reason logged) when the exporter cannot be
    /// built.
    pub fn new(cfg: &TelemetryConfig) -> Telemetry {
        let Some(endpoint) = &cfg.otlp_endpoint else {
            return Telemetry::default();
        };
        match Self::provider(endpoint, &cfg.service_name) {
            Ok(provider) => {
                tracing::info!(endpoint = %endpoint, "OpenTelemetry traces exported over OTLP/HTTP");
                let tracer = provider.tracer("keel");
                Telemetry {
                    inner: Some((provider, tracer)),
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "[telemetry] cannot start the OTLP exporter: traces are off");
                Telemetry::default()
            }
        }
    }

    fn provider(endpoint: &str, service: &str) -> Result<SdkTracerProvider, String> {
        use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
        let client = export::ExportClient::new().map_err(|e| e.to_string())?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(format!("{endpoint}/v1/traces"))
            .with_http_client(client)
            .build()
            .map_err(|e| e.to_string())?;
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(MAX_QUEUED_SPANS)
            .with_scheduled_delay(EXPORT_EVERY)
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build();
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(service.to_owned())
            .build();
        Ok(SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build())
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Exports every finished span now (blocking; call it off the async workers, e.g. from
    /// `spawn_blocking`). A no-op without tracing.
    pub fn flush(&self) {
        if let Some((provider, _)) = &self.inner {
            if let Err(e) = provider.force_flush() {
                tracing::warn!(error = %e, "exporting spans failed");
            }
        }
    }

    /// Starts the SERVER span of a client request (`POST {path}`) that began at `started`,
    /// continuing the client's trace when it sent a `traceparent`.
    pub fn start_request(
        &self,
        headers: &HeaderMap,
        path: &str,
        endpoint: Endpoint,
        started: Instant,
        request_id: &str,
    ) -> Option<RequestSpan> {
        let (_, tracer) = self.inner.as_ref()?;
        let parent =
            TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers));
        let span = tracer
            .span_builder(format!("POST {path}"))
            .with_kind(SpanKind::Server)
            .with_start_time(wall_clock(started))
            .with_attributes([
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("url.path", path.to_owned()),
                KeyValue::new("gen_ai.operation.name", operation(endpoint)),
                KeyValue::new("keel.request_id", request_id.to_owned()),
            ])
            .start_with_context(tracer, &parent);
        Some(RequestSpan {
            cx: parent.with_span(span),
            tracer: tracer.clone(),
            operation: operation(endpoint),
        })
    }
}

/// The wall-clock time of a monotonic instant in the past (spans carry wall-clock times).
fn wall_clock(at: Instant) -> SystemTime {
    SystemTime::now() - at.elapsed()
}

/// A provider name for the conventions' `gen_ai.provider.name`: the API the variant speaks,
/// in the semantic conventions' words.
fn provider_name(variant: &VariantConfig) -> &'static str {
    use crate::config::cloud::Dialect;
    match &variant.dialect {
        Dialect::Azure(_) => "azure.ai.openai",
        Dialect::Gemini => "gcp.gemini",
        Dialect::Vertex(_) => "gcp.vertex_ai",
        Dialect::Bedrock(_) => "aws.bedrock",
        Dialect::OpenAi | Dialect::OpenAiResponses => "openai",
        Dialect::Anthropic => "anthropic",
    }
}

/// The request's SERVER span (inside its context, for the attempts' parent).
#[derive(Clone)]
pub struct RequestSpan {
    cx: Context,
    tracer: SdkTracer,
    operation: &'static str,
}

/// What the request span records when the request ends.
pub struct RequestEnd<'a> {
    pub pool: &'a str,
    pub route: &'static str,
    pub variant: &'a str,
    pub response_model: Option<&'a str>,
    pub provider: Option<&'static str>,
    pub status: u16,
    pub outcome: &'static str,
    pub detail: Option<&'a str>,
    pub attempts: usize,
    pub hedges: usize,
    pub migrations: u32,
    pub ttft: Option<Duration>,
    pub tokens: Option<(u64, u64)>,
}

impl std::fmt::Debug for RequestSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RequestSpan({})", self.trace_id())
    }
}

impl RequestSpan {
    /// The trace id (32 lowercase hex digits), for the access log.
    pub fn trace_id(&self) -> String {
        self.cx.span().span_context().trace_id().to_string()
    }

    /// Starts the CLIENT span of one upstream attempt on `variant`.
    pub fn start_attempt(
        &self,
        pool: &str,
        variant: &VariantConfig,
        kind: &'static str,
    ) -> AttemptSpan {
        let span = self
            .tracer
            .span_builder(format!("{} {}", self.operation, variant.upstream_model))
            .with_kind(SpanKind::Client)
            .with_attributes([
                KeyValue::new("gen_ai.operation.name", self.operation),
                KeyValue::new("gen_ai.request.model", variant.upstream_model.clone()),
                KeyValue::new("gen_ai.provider.name", provider_name(variant)),
                KeyValue::new("gen_ai.system", provider_name(variant)),
                KeyValue::new("server.address", server_address(&variant.url)),
                KeyValue::new("keel.pool", pool.to_owned()),
                KeyValue::new("keel.variant", variant.name.clone()),
                KeyValue::new("keel.attempt.kind", kind),
            ])
            .start_with_context(&self.tracer, &self.cx);
        AttemptSpan {
            span: Box::new(span),
        }
    }

    /// Records the request's outcome and ends the span.
    pub fn end(self, e: RequestEnd<'_>) {
        let span = self.cx.span();
        let mut attrs = vec![
            KeyValue::new("gen_ai.request.model", e.pool.to_owned()),
            KeyValue::new("http.response.status_code", i64::from(e.status)),
            KeyValue::new("keel.pool", e.pool.to_owned()),
            KeyValue::new("keel.variant", e.variant.to_owned()),
            KeyValue::new("keel.route", e.route),
            KeyValue::new("keel.outcome", e.outcome),
            KeyValue::new("keel.attempts", e.attempts as i64),
            KeyValue::new("keel.hedges", e.hedges as i64),
            KeyValue::new("keel.migrations", i64::from(e.migrations)),
        ];
        if let Some(m) = e.response_model {
            attrs.push(KeyValue::new("gen_ai.response.model", m.to_owned()));
        }
        if let Some(p) = e.provider {
            attrs.push(KeyValue::new("gen_ai.provider.name", p));
            attrs.push(KeyValue::new("gen_ai.system", p));
        }
        if let Some(t) = e.ttft {
            attrs.push(ttft_attribute(t));
        }
        if let Some((input, output)) = e.tokens {
            attrs.push(KeyValue::new("gen_ai.usage.input_tokens", input as i64));
            attrs.push(KeyValue::new("gen_ai.usage.output_tokens", output as i64));
        }
        span.set_attributes(attrs);
        if e.status >= 500 || matches!(e.outcome, "error" | "incomplete") {
            span.set_status(Status::error(e.detail.unwrap_or(e.outcome).to_owned()));
        }
        span.end();
    }
}

/// Time to first token, in seconds (the unit of the conventions' TTFT metric).
fn ttft_attribute(t: Duration) -> KeyValue {
    KeyValue::new("gen_ai.server.time_to_first_token", t.as_secs_f64())
}

/// One attempt's CLIENT span; ended with its outcome when settled (or when dropped).
pub struct AttemptSpan {
    /// Boxed: an SDK span is several hundred bytes, and attempts are moved around often
    /// (`Option<AttemptSpan>` stays one pointer when tracing is off).
    span: Box<Span>,
}

impl AttemptSpan {
    /// This span's context as a W3C `traceparent`, for the upstream request.
    pub fn traceparent(&self) -> Option<HeaderValue> {
        let sc = self.span.span_context();
        let v = format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        );
        HeaderValue::from_str(&v).ok()
    }

    /// The first token arrived `ttft` after the attempt started (the span stays open while
    /// the stream is relayed).
    pub fn first_token(&mut self, ttft: Duration) {
        self.span.set_attribute(ttft_attribute(ttft));
    }

    /// Records the attempt's outcome (`ok`, a failure label, `hedge_cancelled`, …) and ends it.
    pub fn end(mut self, outcome: &str) {
        self.span.set_attribute(KeyValue::new(
            "keel.attempt.outcome",
            Cow::Owned(outcome.to_owned()),
        ));
        if outcome != "ok" && !outcome.ends_with("cancelled") && !outcome.starts_with("status_4") {
            self.span.set_status(Status::error(outcome.to_owned()));
        }
        self.span.end();
    }
}

/// The host of a variant's URL, as OpenTelemetry's `server.address` means it: never the
/// scheme, path or any `user:password@` the URL holds.
fn server_address(url: &str) -> String {
    reqwest::Url::parse(url)
        .ok()
        .and_then(|u| u.host_str().map(str::to_owned))
        .unwrap_or_default()
}
