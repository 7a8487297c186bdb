//! The HTTP server: accept loop (each connection served by [`crate::http::connection`]: HTTP/1.1 and
//! h2c, or HTTPS through [`crate::http::tls`] with `[tls]`; a header-read timeout so slow clients
//! cannot hold connections; at most `max_connections` open, see [`crate::http::conn_limit`]), graceful
//! shutdown with a drain deadline, and routing.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::time::Instant;

use keel_core::protocol::{Endpoint, ErrorKind, Protocol};

use crate::admin::live::Live;
use crate::http::conn_limit::ConnLimit;
use crate::http::connection::Http;
use crate::http::graceful::GracefulShutdown;
use crate::pipeline::delivery;
use crate::wire::errors::GatewayError;
use crate::wire::routes::{self, Plane, Resolved, Target};
use crate::{full_body, Body, Gateway};

/// Serves until `shutdown` resolves, then stops accepting and lets in-flight requests (streams
/// included) finish for up to `drain_ms` (see [`serve_live`]). The config cannot be reloaded.
pub async fn serve(
    gw: Arc<Gateway>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    serve_live(Live::new(gw, None), listener, shutdown).await
}

/// The sockets keel serves: the main one and, with `admin_listen`, the operations plane's own.
pub struct Listeners {
    pub main: TcpListener,
    /// When set, `/keel/*` and `/metrics` are served here only, and `/v1/*` only on `main`.
    pub admin: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    fn from(main: TcpListener) -> Listeners {
        Listeners { main, admin: None }
    }
}

/// Which routes a listener serves (see `routes::Plane`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serves {
    /// Every route: keel has one listener.
    All,
    /// The data plane, beside an admin listener.
    Data,
    /// The operations plane (`admin_listen`).
    Ops,
}

impl Serves {
    fn serves(self, plane: Plane) -> bool {
        match (self, plane) {
            (Serves::All, _) | (_, Plane::Both) => true,
            (Serves::Data, p) => p == Plane::Data,
            (Serves::Ops, p) => p == Plane::Ops,
        }
    }
}

/// The next connection on `listener`, or never when there is none.
async fn accept_on(
    listener: Option<&TcpListener>,
) -> std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// A listening socket on `addr` whose kernel queue holds `backlog` connections not yet
/// accepted (see `Config::listen_backlog`): a burst of new connections waits there while the
/// workers are busy, instead of having its SYNs dropped and retried a second or more later.
pub fn listen(addr: std::net::SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As the runtime's own `bind` does: a restart may bind while the last process's
    // connections linger in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// How long streams cut at the drain deadline get to send their error event before exit.
const CUT_FLUSH: Duration = Duration::from_secs(2);

/// Serves the current generation of `live` until `shutdown` resolves; then drains: stops
/// accepting, fails readiness, lets in-flight requests (streams included) finish for up to
/// `drain_ms`, then ends the streams still running with an explicit error event (see `live`).
pub async fn serve_live(
    live: Arc<Live>,
    listeners: impl Into<Listeners>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let Listeners {
        main: listener,
        admin,
    } = listeners.into();
    let main_serves = if admin.is_some() {
        Serves::Data
    } else {
        Serves::All
    };
    let first = live.current();
    let graceful = GracefulShutdown::new();
    let http = Arc::new(Http::new(
        Duration::from_millis(first.cfg.header_read_timeout_ms),
        Duration::from_millis(first.cfg.idle_timeout_ms),
        Some(Duration::from_millis(first.cfg.client_write_timeout_ms)),
        &first.metrics,
    ));
    let connections = ConnLimit::new(first.cfg.max_connections, &first.metrics);
    tokio::pin!(shutdown);
    live.start_tasks();
    live.watch_source();
    loop {
        let (accepted, serves) = tokio::select! {
            a = listener.accept() => (a, main_serves),
            a = accept_on(admin.as_ref()) => (a, Serves::Ops),
            _ = &mut shutdown => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(slot) = connections.take() else {
            connections.refuse(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        // The certificate of the generation current at accept (a reload rotates it for the
        // connections that follow).
        let tls = live.current().cfg.tls.as_ref().map(|t| t.acceptor.clone());
        let live = live.clone();
        // Each request runs on the generation current at its start.
        let svc = hyper::service::service_fn(move |req| handle(live.current(), req, serves));
        // Taken here, not in the task: a shutdown that starts while the connection's first
        // bytes are awaited still waits for it (and tells it to close).
        let watcher = graceful.watcher();
        let http = http.clone();
        // The task lives as long as the connection, and its future is as large as the largest
        // of its branches: TLS (a handshake and a TLS stream) is boxed, so a plain connection's
        // task holds only what plain HTTP needs.
        tokio::spawn(async move {
            match tls {
                Some(tls) => Box::pin(crate::http::tls::serve(http, tls, tcp, svc, watcher)).await,
                None => http.serve(tcp, svc, watcher).await,
            }
            drop(slot);
        });
    }
    let process = first.process.clone();
    process.begin_drain();
    drop(listener);
    drop(admin);
    live.stop_tasks();
    let drain_ms = live.current().cfg.drain_ms;
    tracing::info!(drain_ms, "shutting down: draining in-flight requests");
    let all_closed = graceful.shutdown();
    tokio::pin!(all_closed);
    tokio::select! {
        _ = &mut all_closed => tracing::info!("drained"),
        _ = tokio::time::sleep(Duration::from_millis(drain_ms)) => {
            tracing::warn!("drain deadline reached; streams still running end with an error event");
            process.cut_streams();
            if tokio::time::timeout(CUT_FLUSH, &mut all_closed).await.is_err() {
                tracing::warn!("closing the connections still open");
            }
        }
    }
    Ok(())
}

/// Routes one request. A panic anywhere in its handling is answered with a 500 in the
/// client's protocol (and counted, see `access_log`), never a dropped connection with no word.
pub async fn handle(
    gw: Arc<Gateway>,
    req: Request<Incoming>,
    serves: Serves,
) -> Result<Response<Body>, Infallible> {
    let protocol = client_protocol(&req);
    // Boxed: hyper keeps one allocation of the service future's size per connection for as
    // long as the connection lives (a live stream's included, long after its head was sent).
    // Inline, the four stages made that 18 KB a connection; boxed, it is this 0.5 KB frame
    // and the stages' memory is freed once the response head is out
    // (bench/history/2026-12-01-overhead-stops-1-5.md).
    let handled = std::panic::AssertUnwindSafe(Box::pin(route(gw, req, serves)))
        .catch_unwind()
        .await;
    Ok(handled.unwrap_or_else(|_| {
        tracing::error!("a request handler panicked; answered 500");
        GatewayError::new(
            ErrorKind::Internal,
            "keel: internal error while handling the request",
        )
        .to_response(protocol)
    }))
}

/// The protocol a client speaks, by path (or `anthropic-version` for shared paths).
fn client_protocol(req: &Request<Incoming>) -> Protocol {
    let anthropic_client = req
        .headers()
        .contains_key(crate::wire::ANTHROPIC_VERSION_HEADER);
    Endpoint::from_path(req.uri().path())
        .map(Endpoint::protocol)
        .unwrap_or(if anthropic_client {
            Protocol::Anthropic
        } else {
            Protocol::OpenAi
        })
}

/// Answers one request by its route: authorized for its plane, then the generation pipeline
/// (`phases::run`) or one of keel's own endpoints.
///
/// An async block capturing the request once: an async fn keeps a by-value argument twice in
/// its state, and the state is copied into its box once a request.
#[allow(clippy::manual_async_fn)] // an async fn would hold its arguments twice
fn route(
    gw: Arc<Gateway>,
    req: Request<Incoming>,
    serves: Serves,
) -> impl std::future::Future<Output = Response<Body>> {
    async move {
        let started = Instant::now();
        let path = req.uri().path().to_owned();
        let anthropic_client = req
            .headers()
            .contains_key(crate::wire::ANTHROPIC_VERSION_HEADER);
        let protocol = client_protocol(&req);
        let _json = |body: String| full_body(StatusCode::OK, "application/json", Bytes::from(body));
        let resolved = match routes::resolve(req.method(), &path) {
            // The other listener's routes do not exist on this one.
            Resolved::Route(t, _) if !serves.serves(t.plane()) => Resolved::NotFound,
            r => r,
        };
        if let Resolved::Route(target, _) = resolved {
            if let Err(e) = gw.keys.authorize(target.access(), req.headers(), req.uri()) {
                return own_answer(e.to_response(protocol));
            }
        }
        if let Resolved::Route(Target::Generation(api), _) = resolved {
            if gw.process.draining() {
                // A request on a connection still open after shutdown began.
                return GatewayError::new(
                    ErrorKind::Overloaded,
                    "keel is shutting down: send the request again (another replica will take it)",
                )
                .with_retry_after(1000)
                .to_response(protocol);
            }
            return crate::pipeline::phases::run(&gw, api, req, started).await;
        }
        let resp = match resolved {
            Resolved::Route(Target::Generation(_), _) => unreachable!("handled above"),
            Resolved::Route(Target::Models, _) => match gw.keys.authenticate(req.headers()) {
                Ok(key) => crate::http::models::list(&gw, key.as_deref(), anthropic_client),
                Err(e) => e.to_response(protocol),
            },
            Resolved::Route(Target::Model, id) => match gw.keys.authenticate(req.headers()) {
                Ok(key) => crate::http::models::one(
                    &gw,
                    key.as_deref(),
                    anthropic_client,
                    id.unwrap_or_default(),
                    protocol,
                ),
                Err(e) => e.to_response(protocol),
            },
            // Everything else is the operations plane's (authorized above).
            Resolved::Route(target, arg) => {
                crate::admin::answer(&gw, target, arg, req, protocol).await
            }
            Resolved::MethodNotAllowed => {
                let mut r = GatewayError::new(
                    ErrorKind::InvalidRequest,
                    format!("method {} is not allowed on {path}", req.method()),
                )
                .to_response(protocol);
                *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
                r
            }
            Resolved::NotFound => GatewayError::new(
                ErrorKind::NotFound,
                format!("no route for {} {path}", req.method()),
            )
            .to_response(protocol),
        };
        own_answer(resp)
    }
}

/// keel's own answers carry a request id and a route too.
fn own_answer(mut resp: Response<Body>) -> Response<Body> {
    let id = crate::wire::request_id::new();
    let route = delivery::own_route(resp.status());
    delivery::keel_headers(resp.headers_mut(), &id, route, "none", 0);
    resp
}
