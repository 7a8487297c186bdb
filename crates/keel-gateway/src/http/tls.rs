//! TLS on keel's own listener (`[tls]`): the handshake picks the HTTP version. keel offers
//! `h2` and `http/1.1` by ALPN and serves the one chosen (HTTP/1.1 when the client names none);
//! no h2c sniffing on a TLS connection. The handshake is held to `header_read_timeout_ms` like
//! a plain connection's first bytes, so a client that connects and never completes it is
//! dropped. With `client_ca_file`, every client must present a certificate signed by that CA
//! (mutual TLS): a client without one is refused in the handshake, before any request is read.
//! The certificate files are read when the config is (see `config::pem`).

use std::convert::Infallible;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::Service;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;

use crate::http::connection::{Http, Version};
use crate::http::graceful::Watcher;
use crate::wire::body::Body;

/// Serves one TLS client connection: the handshake (within the header-read timeout), then
/// HTTP/2 or HTTP/1.1 as ALPN chose. A failed or late handshake closes the connection (the
/// client sees the TLS alert, if any).
pub async fn serve<S>(
    http: Arc<Http>,
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    svc: S,
    watcher: Watcher,
) where
    S: Service<Request<Incoming>, Response = Response<Body>, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let stream = match tokio::time::timeout(http.header_read_timeout(), acceptor.accept(tcp)).await
    {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => {
            http.tls_failed(false);
            tracing::debug!(error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            http.tls_failed(true);
            return;
        }
    };
    let version = match stream.get_ref().1.alpn_protocol() {
        Some(b"h2") => Version::H2,
        _ => Version::H1,
    };
    http.serve_as(stream, version, svc, watcher).await
}
