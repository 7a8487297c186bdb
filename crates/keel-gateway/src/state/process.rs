//! The process around the config generations: draining, the cut of streams at the drain
//! deadline, and the handle that reloads the config. Every generation shares one `Process`;
//! the reload machinery itself is the operations plane's (`admin::live`), reached here through
//! [`Reloader`] so that a generation can hold its process without depending on it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::Value;
use tokio::sync::watch;

use keel_core::protocol::{ErrorKind, Protocol};

use crate::wire::errors::GatewayError;
use crate::{Body, Config};

/// The message of the error event that ends a stream still running at the drain deadline.
pub const CUT_MESSAGE: &str =
    "keel is shutting down and the drain deadline passed: the response is incomplete; retry it";

/// State of the process that every generation shares.
pub struct Process {
    draining: AtomicBool,
    /// Turns true at the drain deadline: streams still running end with an error event.
    cutoff: watch::Sender<bool>,
    /// The reload handle, once the gateway runs under one (the admin endpoint reaches it here).
    reloader: OnceLock<Weak<dyn Reloader>>,
}

impl Default for Process {
    fn default() -> Self {
        Process {
            draining: AtomicBool::new(false),
            cutoff: watch::Sender::new(false),
            reloader: OnceLock::new(),
        }
    }
}

impl Process {
    /// Whether shutdown has begun (readiness fails, new work is refused).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Shutdown begins: readiness fails from now on.
    pub fn begin_drain(&self) {
        if !self.draining.swap(true, Ordering::Relaxed) {
            tracing::info!("draining: readiness fails, no new requests");
        }
    }

    /// The drain deadline passed: every stream still running ends with an explicit error event.
    pub fn cut_streams(&self) {
        self.cutoff.send_replace(true);
    }

    /// The reload handle this gateway runs under, if any.
    pub fn reloader(&self) -> Option<Arc<dyn Reloader>> {
        self.reloader.get().and_then(Weak::upgrade)
    }

    /// Sets the reload handle (once: the first handle a process runs under keeps it).
    pub fn set_reloader(&self, reloader: Weak<dyn Reloader>) {
        let _ = self.reloader.set(reloader);
    }

    /// `body`, a stream in `protocol` made of whole events, ended at the drain deadline by the
    /// protocol's error event (instead of being cut off mid-answer by the process exit).
    pub fn cut_at_deadline(&self, body: Body, protocol: Protocol) -> Body {
        let cutoff = self.cutoff.subscribe();
        let stream = futures_util::stream::unfold(Some((body, cutoff)), move |st| async move {
            let (mut body, mut cutoff) = st?;
            let cut = async {
                // The sender lives as long as the process state; should it go, never cut.
                if cutoff.wait_for(|c| *c).await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                biased;
                _ = cut => {
                    let cut = GatewayError::new(ErrorKind::Overloaded, CUT_MESSAGE);
                    let ev = cut.to_event(protocol);
                    Some((Ok(Frame::data(Bytes::from(ev.raw))), None))
                }
                frame = body.frame() => frame.map(|f| (f, Some((body, cutoff)))),
            }
        });
        StreamBody::new(stream).boxed()
    }
}

/// What re-reads the config file and applies it (`admin::live::Live`).
pub trait Reloader: Send + Sync {
    /// Re-reads and applies the config; what changed, or why nothing was reloaded.
    fn reload(&self) -> Result<Value, ReloadError>;
    /// Makes `cfg` the next generation, unless it changes what only a restart can.
    fn apply(&self, cfg: Config) -> Result<Value, ReloadError>;
}

/// A refused reload: why, and how it is counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadError {
    /// `invalid` (the file cannot be read or has errors), `refused` (a change that needs a
    /// restart, such as `listen`), `unavailable` (no config file to re-read).
    pub outcome: &'static str,
    pub message: String,
}

impl std::fmt::Display for ReloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}
