//! How spans leave the process: OTLP/HTTP with protobuf bodies, sent by keel's own reqwest
//! client (the exporter crate's clients would pull a second HTTP stack into the build).
//!
//! The SDK's batch processor exports from its own thread, blocking on each export. The client
//! here runs its requests on a private single-threaded tokio runtime driven by that thread, so
//! exporting never borrows a worker of the gateway's runtime and cannot deadlock with it (a
//! flush or shutdown called from the gateway's runtime only waits for the export thread).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use opentelemetry_http::{HttpClient, HttpError};

/// Longest one export may take; a collector that is down costs the export thread no more.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// An [`HttpClient`] for the OTLP exporter over reqwest, on its own runtime.
#[derive(Clone)]
pub struct ExportClient {
    client: reqwest::Client,
    runtime: Arc<PrivateRuntime>,
}

/// The export runtime; dropped without blocking, wherever the last reference goes (dropping a
/// runtime normally panics inside another runtime).
struct PrivateRuntime(Option<tokio::runtime::Runtime>);

impl Drop for PrivateRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl std::fmt::Debug for ExportClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExportClient")
    }
}

impl ExportClient {
    pub fn new() -> std::io::Result<ExportClient> {
        crate::config::install_crypto();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // Never follow a redirect: it would carry the exporter's headers (a collector's
        // credentials) to wherever the answer points.
        let client = reqwest::Client::builder()
            .timeout(EXPORT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(std::io::Error::other)?;
        Ok(ExportClient {
            client,
            runtime: Arc::new(PrivateRuntime(Some(runtime))),
        })
    }

    async fn send(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let resp = self
            .client
            .request(parts.method, parts.uri.to_string())
            .headers(parts.headers)
            .body(body)
            .send()
            .await?;
        let mut out = Response::builder().status(resp.status());
        for (k, v) in resp.headers() {
            out = out.header(k, v);
        }
        let body = resp.bytes().await?;
        Ok(out.body(body)?)
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        // Called on the batch processor's thread (never inside a tokio runtime): drive the
        // request on the private runtime until it is done.
        match &self.runtime.0 {
            Some(rt) => rt.block_on(self.send(request)),
            None => Err("the export runtime is gone".into()),
        }
    }
}
