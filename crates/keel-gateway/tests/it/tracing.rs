//! OpenTelemetry traces: a minimal OTLP/HTTP receiver on loopback decodes what keel exports
//! (protobuf, with the `opentelemetry-proto` types), and the test checks the request and
//! attempt spans, their GenAI attributes, and the W3C trace context from the client through
//! keel to the upstream.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use keel_sim::{Fleet, ServerConfig};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::{json, Value};

use crate::harness::*;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// Every span POSTed to `/v1/traces`, decoded.
type Received = Arc<Mutex<Vec<Span>>>;

/// A loopback OTLP/HTTP receiver for traces (protobuf bodies).
async fn receiver() -> (SocketAddr, Received) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let spans: Received = Arc::default();
    let store = spans.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let store = store.clone();
            let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let store = store.clone();
                async move {
                    let path_ok = req.uri().path() == "/v1/traces";
                    let body = req.into_body().collect().await.map(|b| b.to_bytes());
                    let decoded = body
                        .ok()
                        .and_then(|b| ExportTraceServiceRequest::decode(b).ok())
                        .filter(|_| path_ok);
                    let status = match decoded {
                        Some(export) => {
                            let mut s = store.lock().unwrap();
                            for rs in export.resource_spans {
                                for ss in rs.scope_spans {
                                    s.extend(ss.spans);
                                }
                            }
                            200
                        }
                        None => 400,
                    };
                    let resp = hyper::Response::builder()
                        .status(status)
                        .header("content-type", "application/x-protobuf")
                        .body(Full::new(Bytes::new()))
                        .unwrap();
                    Ok::<_, Infallible>(resp)
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), svc),
            );
        }
    });
    (addr, spans)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A span's attributes as JSON values (strings, integers, doubles).
fn attrs(s: &Span) -> HashMap<String, Value> {
    s.attributes
        .iter()
        .filter_map(|kv| {
            let v = match kv.value.as_ref()?.value.as_ref()? {
                Any::StringValue(s) => json!(s),
                Any::IntValue(i) => json!(i),
                Any::DoubleValue(d) => json!(d),
                Any::BoolValue(b) => json!(b),
                _ => return None,
            };
            Some((kv.key.clone(), v))
        })
        .collect()
}

/// The `traceparent` a sim received with the last request.
fn upstream_traceparent(h: &Harness, i: usize) -> String {
    h.server(i)
        .state
        .last_headers()
        .into_iter()
        .find(|(k, _)| k == "traceparent")
        .map(|(_, v)| v)
        .unwrap_or_default()
}

#[tokio::test]
async fn request_and_attempt_spans_carry_genai_attributes_and_the_client_trace() {
    let (otlp, received) = receiver().await;
    let fleet = Fleet::start_n(2, ServerConfig::fast("s")).await.unwrap();
    let log = std::env::temp_dir().join(format!("keel-traced-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let cfg = format!(
        "[log]\naccess = {:?}\n[telemetry]\notlp_endpoint = \"http://{otlp}\"\nservice_name = \"keel-test\"\n{}",
        log.display().to_string(),
        pool_over(&fleet, "p", "openai", 1000, "")
    );
    let h = Harness::start(fleet, &cfg).await;
    assert!(h.gw.telemetry.enabled());
    // sim-0 is tried first and fails: one request, two attempts.
    add_fault(h.server(0), json!({"kind": "error", "status": 503})).await;
    let traceparent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-01");
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("traceparent", &traceparent)],
            &chat_body("trace me"),
        )
        .await;
    assert_eq!(r.status(), 200);
    let id = header(r.headers(), "x-keel-request-id").to_owned();
    let answer: Value = r.json().await.unwrap();

    let gw = h.gw.clone();
    tokio::task::spawn_blocking(move || gw.telemetry.flush())
        .await
        .unwrap();
    wait_for!("three spans", received.lock().unwrap().len() >= 3);
    let spans = received.lock().unwrap().clone();

    let server: Vec<&Span> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Server as i32)
        .collect();
    assert_eq!(server.len(), 1, "{spans:#?}");
    let req = server[0];
    assert_eq!(req.name, "POST /v1/chat/completions");
    assert_eq!(hex(&req.trace_id), TRACE_ID, "the client's trace continues");
    assert_eq!(hex(&req.parent_span_id), CLIENT_SPAN);
    let a = attrs(req);
    assert_eq!(a["gen_ai.operation.name"], "chat");
    assert_eq!(a["gen_ai.request.model"], "p");
    assert_eq!(a["gen_ai.response.model"], "sim");
    assert_eq!(a["gen_ai.provider.name"], "openai");
    assert_eq!(
        a["gen_ai.usage.input_tokens"],
        answer["usage"]["prompt_tokens"]
    );
    assert_eq!(
        a["gen_ai.usage.output_tokens"],
        answer["usage"]["completion_tokens"]
    );
    assert!(a["gen_ai.server.time_to_first_token"].as_f64().unwrap() > 0.0);
    assert_eq!(a["keel.request_id"], id.as_str());
    assert_eq!(a["keel.pool"], "p");
    assert_eq!(a["keel.variant"], "sim-1");
    assert_eq!(a["keel.route"], "fallback");
    assert_eq!(a["keel.attempts"], 2);
    assert_eq!(a["http.response.status_code"], 200);

    let mut attempts: Vec<&Span> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .collect();
    attempts.sort_by_key(|s| s.start_time_unix_nano);
    assert_eq!(attempts.len(), 2, "{spans:#?}");
    for (i, (variant, kind)) in [("sim-0", "first"), ("sim-1", "fallback")]
        .iter()
        .enumerate()
    {
        let s = attempts[i];
        assert_eq!(hex(&s.trace_id), TRACE_ID);
        assert_eq!(
            s.parent_span_id, req.span_id,
            "attempts are the request's children"
        );
        let a = attrs(s);
        assert_eq!(a["keel.variant"], *variant);
        assert_eq!(a["keel.attempt.kind"], *kind);
        assert_eq!(a["keel.pool"], "p");
        assert_eq!(a["gen_ai.operation.name"], "chat");
        assert_eq!(a["gen_ai.request.model"], "sim");
        assert_eq!(a["gen_ai.provider.name"], "openai");
        // Each upstream saw its own attempt span as the parent, in the client's trace.
        assert_eq!(
            upstream_traceparent(&h, i),
            format!("00-{TRACE_ID}-{}-01", hex(&s.span_id)),
            "{variant}"
        );
    }
    // The request's access line names its trace.
    wait_for!(
        "the access line",
        std::fs::read_to_string(&log).is_ok_and(|t| t.lines().count() == 1)
    );
    let line: Value = serde_json::from_str(&std::fs::read_to_string(&log).unwrap()).unwrap();
    assert_eq!(line["request_id"], id.as_str());
    assert_eq!(line["trace_id"], TRACE_ID, "{line}");
    assert_ne!(attrs(attempts[0])["keel.attempt.outcome"], "ok");
    assert_eq!(attrs(attempts[1])["keel.attempt.outcome"], "ok");
    assert!(
        attrs(attempts[1])["gen_ai.server.time_to_first_token"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

#[tokio::test]
async fn without_an_endpoint_nothing_is_traced_and_traceparent_passes_through() {
    let h = Harness::openai(1, 1, "", "").await;
    assert!(!h.gw.telemetry.enabled());
    let traceparent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-01");
    let r = h
        .post_with(
            "/v1/chat/completions",
            &[("traceparent", &traceparent)],
            &chat_body("x"),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(upstream_traceparent(&h, 0), traceparent);
}

/// A server that answers every request with a redirect to `to`, counting them.
async fn redirector(to: String) -> (SocketAddr, Arc<Mutex<usize>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count: Arc<Mutex<usize>> = Arc::default();
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let seen = seen.clone();
            let to = to.clone();
            let svc = service_fn(move |_req: hyper::Request<hyper::body::Incoming>| {
                *seen.lock().unwrap() += 1;
                let resp = hyper::Response::builder()
                    .status(307)
                    .header("location", to.clone())
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                async move { Ok::<_, Infallible>(resp) }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), svc),
            );
        }
    });
    (addr, count)
}

/// A gateway exporting to `otlp_endpoint`, whose one variant's URL carries credentials
/// (reached through reqwest, which sends them as basic auth), after one chat request and a
/// flush of its spans.
async fn traced_chat_with_credentials_in_urls(otlp_endpoint: &str) -> Harness {
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let url = fleet
        .get(0)
        .openai_base()
        .replace("http://", "http://user:hunter2@");
    let cfg = format!(
        "[telemetry]\notlp_endpoint = \"{otlp_endpoint}\"\n[[pools]]\nname = \"p\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}",
        variant("a", &url, "openai", 1)
    );
    let h = Harness::start(fleet, &cfg).await;
    let (status, _, body) = h.chat(&chat_body("x")).await;
    assert_eq!(status, 200, "{body}");
    let gw = h.gw.clone();
    tokio::task::spawn_blocking(move || gw.telemetry.flush())
        .await
        .unwrap();
    h
}

#[tokio::test]
async fn the_exporter_follows_no_redirect_and_spans_name_no_credentials() {
    let (otlp, received) = receiver().await;
    let (redirecting, asked) = redirector(format!("http://{otlp}/v1/traces")).await;
    // The collector's address carries credentials too.
    let h =
        traced_chat_with_credentials_in_urls(&format!("http://collector:pw@{redirecting}")).await;
    // The flush returned once the export was answered: a redirect followed would have
    // delivered the spans (and the credentials with them) by now.
    assert!(
        *asked.lock().unwrap() >= 1,
        "the export reached the redirecting address"
    );
    assert!(received.lock().unwrap().is_empty());
    drop(h);

    // Exported where it is received: the attempt span names the upstream's host only.
    let h = traced_chat_with_credentials_in_urls(&format!("http://{otlp}")).await;
    wait_for!("two spans", received.lock().unwrap().len() >= 2);
    let spans = received.lock().unwrap().clone();
    let attempt = spans
        .iter()
        .find(|s| s.kind == SpanKind::Client as i32)
        .expect("an attempt span");
    assert_eq!(attrs(attempt)["server.address"], "127.0.0.1");
    for s in &spans {
        assert!(!format!("{:?}", attrs(s)).contains("hunter2"), "{s:?}");
    }
    assert!(!format!("{:?}", h.gw.cfg.pools[0].variants[0]).contains("hunter2"));
}
