//! The floor under keel's cost: a plain reverse proxy built from the same parts as keel's HTTP
//! path — tokio's multi-thread runtime, hyper's HTTP/1.1 server connection and hyper's HTTP/1.1
//! client with a keep-alive pool — and nothing else: no parse of the body, no routing decision,
//! no record, no log. Requests go round robin over the upstreams, bodies stream through both
//! ways untouched.
//!
//! `keel bench overhead --contenders keel,nginx,hyper` measures it beside keel and nginx. What
//! it costs per request is what any gateway built on these crates pays before doing anything;
//! keel's CPU per request splits into that floor and what keel does on top of it, and nginx's
//! figure beside both says how much of the gap to nginx is the stack
//! (bench/history/2026-12-02-overhead-stops-12-18.md).
//! It is a benchmark contender, not a product path: `keel bench plain-proxy` is hidden.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http::uri::{Authority, Scheme, Uri};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type Answer = Response<http_body_util::combinators::BoxBody<bytes::Bytes, hyper::Error>>;

/// Where requests go: each upstream's authority (`host:port`), taken in turn.
struct Upstreams {
    authorities: Vec<Authority>,
    next: AtomicUsize,
    client: Client<HttpConnector, Incoming>,
}

impl Upstreams {
    fn parse(urls: &[String]) -> Result<Upstreams, String> {
        let authorities = urls
            .iter()
            .map(|u| {
                let uri: Uri = u.parse().map_err(|e| format!("{u}: {e}"))?;
                uri.authority()
                    .cloned()
                    .ok_or_else(|| format!("{u}: no host:port"))
            })
            .collect::<Result<Vec<_>, String>>()?;
        if authorities.is_empty() {
            return Err("plain-proxy: no upstream".into());
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Upstreams {
            authorities,
            next: AtomicUsize::new(0),
            client,
        })
    }

    /// `req` sent on to the next upstream with its path, headers and body as they came; a
    /// failure to reach it is a bare 502.
    async fn forward(&self, mut req: Request<Incoming>) -> Answer {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.authorities.len();
        let mut parts = req.uri().clone().into_parts();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(self.authorities[i].clone());
        match Uri::from_parts(parts) {
            Ok(uri) => *req.uri_mut() = uri,
            Err(_) => return status(StatusCode::BAD_REQUEST),
        }
        match self.client.request(req).await {
            Ok(resp) => resp.map(|b| b.boxed()),
            Err(_) => status(StatusCode::BAD_GATEWAY),
        }
    }
}

fn status(code: StatusCode) -> Answer {
    let mut r = Response::new(Empty::new().map_err(|never| match never {}).boxed());
    *r.status_mut() = code;
    r
}

/// Serves on `127.0.0.1:port` until the process is killed.
pub async fn serve(port: u16, upstreams: &[String]) -> Result<(), String> {
    let upstreams = Arc::new(Upstreams::parse(upstreams)?);
    let listener = TcpListener::bind(("127.0.0.1", port))
        .await
        .map_err(|e| format!("plain-proxy: 127.0.0.1:{port}: {e}"))?;
    // Accept on a worker, as keel does (a task spawned from outside the workers costs a
    // wake-up through the shared queue).
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let upstreams = upstreams.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let upstreams = upstreams.clone();
                    async move { Ok::<_, Infallible>(upstreams.forward(req).await) }
                });
                let _ = http1::Builder::new()
                    .keep_alive(true)
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    })
    .await
    .map_err(|e| format!("plain-proxy: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The floor proxies both modes byte for byte, round robin over its upstreams.
    #[tokio::test]
    async fn the_plain_proxy_passes_requests_and_streams_through() {
        let fleet = keel_sim::Fleet::start_n(2, keel_sim::ServerConfig::default())
            .await
            .unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let urls: Vec<String> = fleet.servers.iter().map(|s| s.openai_base()).collect();
        tokio::spawn(async move { serve(port, &urls).await });
        let client = keel_sim::http_client();
        let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
        let body = |stream: bool| {
            serde_json::json!({"model": "m", "stream": stream, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})
        };
        let mut answered = None;
        for _ in 0..100 {
            if let Ok(r) = client.post(&url).json(&body(false)).send().await {
                answered = Some(r);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let whole: serde_json::Value = answered.unwrap().json().await.unwrap();
        assert_eq!(whole["object"], "chat.completion", "{whole}");
        let streamed = client.post(&url).json(&body(true)).send().await.unwrap();
        assert_eq!(streamed.status(), 200);
        let text = streamed.text().await.unwrap();
        assert!(text.contains("chat.completion.chunk"), "{text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        let served: Vec<u64> = fleet
            .servers
            .iter()
            .map(|s| s.state.stats().requests)
            .collect();
        assert_eq!(served, [1, 1], "round robin: one request each");
    }
}
