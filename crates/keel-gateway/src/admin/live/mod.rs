//! The running config and the process around it: hot reload, graceful drain, readiness.
//!
//! A [`Gateway`] is one immutable *generation* of the config. The server holds a [`Live`]
//! handle (an `ArcSwap` of the current generation) and each request loads the generation once
//! at its start, so a request or stream finishes on the config it started with, however many
//! reloads happen meanwhile; the old generation is freed when its last request ends.
//!
//! A reload (`SIGHUP`, `POST /keel/admin/reload`, or the `[reload] watch` file watch) reads and
//! validates the whole file first; on any error the current generation stays, and the error is
//! logged, answered to the admin call and counted (`keel_config_reloads_total{outcome}`). A
//! change of `listen` is refused (the socket is bound once), and so is turning `[tls]` on or
//! off; its certificate files are read again, and connections accepted after the reload get
//! the new certificate. A valid config becomes the next
//! generation, built with the lasting state of the current one (see `Gateway::build`), and the
//! background tasks (monitor, events) move to it.
//!
//! Graceful restart: on shutdown the server stops accepting, marks the process draining
//! (`/keel/ready` answers 503 at once, a new generation request on a connection still open
//! gets 503), lets in-flight requests run for `drain_ms`, then ends every stream still running
//! with an explicit error event in its protocol ([`Process::cut_streams`]) before exiting.

pub mod admin;
pub mod changes;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

pub use crate::state::process::{Process, ReloadError, Reloader, CUT_MESSAGE};
use crate::{Config, Gateway};

/// How often `[reload] watch` looks at the config file.
const WATCH_POLL: Duration = Duration::from_secs(1);

/// Where a reload reads the config, and what the command line overrides in it.
pub struct ConfigSource {
    pub path: PathBuf,
    /// Applied to every config read (`keel serve --listen`, `--log-format`).
    pub adjust: Box<dyn Fn(&mut Config) + Send + Sync>,
}

/// The running generation, and the tasks that follow it.
pub struct Live {
    current: ArcSwap<Gateway>,
    source: Option<ConfigSource>,
    /// One reload at a time (they are rare; the request path never takes it).
    reloading: Mutex<()>,
    /// The monitor and events tasks of the current generation, once serving.
    tasks: Mutex<Option<Vec<JoinHandle<()>>>>,
}

impl Live {
    /// A handle over `gw`; `source`: the file a reload re-reads (none: only [`Live::apply`]).
    pub fn new(gw: Arc<Gateway>, source: Option<ConfigSource>) -> Arc<Live> {
        let live = Arc::new(Live {
            current: ArcSwap::new(gw.clone()),
            source,
            reloading: Mutex::new(()),
            tasks: Mutex::new(None),
        });
        gw.process
            .set_reloader(Arc::downgrade(&live) as Weak<dyn Reloader>);
        live
    }

    /// The current generation (each request loads it once, at its start).
    pub fn current(&self) -> Arc<Gateway> {
        self.current.load_full()
    }

    /// Starts the background tasks for the current generation (the server does, once).
    pub fn start_tasks(&self) {
        let gw = self.current();
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        *tasks = Some(spawn_tasks(&gw));
    }

    /// Stops the background tasks (shutdown).
    pub fn stop_tasks(&self) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        for t in tasks.take().into_iter().flatten() {
            t.abort();
        }
    }

    /// Re-reads the config file and applies it (see [`Live::apply`]).
    pub fn reload(&self) -> Result<Value, ReloadError> {
        let result = self.read_source().and_then(|cfg| self.apply(cfg));
        if let Err(e) = &result {
            self.count(e.outcome);
            tracing::error!(outcome = e.outcome, error = %e.message, "config reload refused; the running config stays");
        }
        result
    }

    fn read_source(&self) -> Result<Config, ReloadError> {
        let source = self.source.as_ref().ok_or_else(|| ReloadError {
            outcome: "unavailable",
            message:
                "this gateway was not started from a config file, so there is nothing to re-read"
                    .into(),
        })?;
        let mut cfg = Config::load(&source.path.to_string_lossy()).map_err(|e| ReloadError {
            outcome: "invalid",
            message: e.to_string(),
        })?;
        (source.adjust)(&mut cfg);
        Ok(cfg)
    }

    /// Makes `cfg` the next generation, unless it changes what only a restart can: returns
    /// what changed (generation number, per-pool changes, settings that wait for a restart).
    /// Errors are returned, not counted or logged ([`Live::reload`] does both); a successful
    /// apply is counted and logged here.
    pub fn apply(&self, cfg: Config) -> Result<Value, ReloadError> {
        let started = Instant::now();
        let _one = self.reloading.lock().unwrap_or_else(|e| e.into_inner());
        let old = self.current();
        if cfg.listen != old.cfg.listen {
            return Err(ReloadError {
                outcome: "refused",
                message: format!(
                    "listen: changing the listen address ({} to {}) needs a restart; nothing was reloaded",
                    old.cfg.listen, cfg.listen
                ),
            });
        }
        if cfg.admin_listen != old.cfg.admin_listen {
            return Err(ReloadError {
                outcome: "refused",
                message: "admin_listen: changing the operations plane's address needs a restart; nothing was reloaded".into(),
            });
        }
        guard_auth(&old.cfg, &cfg)?;
        if cfg.tls.is_some() != old.cfg.tls.is_some() {
            let (from, to) = if cfg.tls.is_some() {
                ("plain HTTP", "TLS")
            } else {
                ("TLS", "plain HTTP")
            };
            return Err(ReloadError {
                outcome: "refused",
                message: format!(
                    "tls: switching the listener from {from} to {to} needs a restart (its clients would all fail at once); nothing was reloaded"
                ),
            });
        }
        if cfg.log != old.cfg.log {
            // Found now, not after the swap: a destination that cannot be written is an error.
            crate::observe::access_log::AccessLog::open(&cfg.log).map_err(|e| ReloadError {
                outcome: "invalid",
                message: e.to_string(),
            })?;
        }
        let mut restart_only = Vec::new();
        if cfg.worker_threads != old.cfg.worker_threads {
            restart_only.push("worker_threads");
        }
        if cfg.listen_backlog != old.cfg.listen_backlog {
            restart_only.push("listen_backlog");
        }
        if cfg.header_read_timeout_ms != old.cfg.header_read_timeout_ms {
            restart_only.push("header_read_timeout_ms");
        }
        if cfg.idle_timeout_ms != old.cfg.idle_timeout_ms {
            restart_only.push("idle_timeout_ms");
        }
        if cfg.client_write_timeout_ms != old.cfg.client_write_timeout_ms {
            restart_only.push("client_write_timeout_ms");
        }
        if cfg.max_connections != old.cfg.max_connections {
            restart_only.push("max_connections");
        }
        for w in &cfg.warnings {
            tracing::warn!("{w}");
        }
        let changes = changes::changes(&old.cfg, &cfg);
        let next = Gateway::build(cfg, Some(&old));
        self.current.store(next.clone());
        // The tasks follow the current generation (requests on the old one need none).
        {
            let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(running) = tasks.take() {
                running.iter().for_each(JoinHandle::abort);
                *tasks = Some(spawn_tasks(&next));
            }
        }
        self.count("ok");
        let took_ms = started.elapsed().as_secs_f64() * 1000.0;
        let summary = serde_json::to_string(&changes).unwrap_or_default();
        tracing::info!(
            generation = next.generation,
            took_ms,
            changes = %summary,
            "config reloaded"
        );
        for s in &restart_only {
            tracing::warn!(
                setting = s,
                "changed in the reloaded config; it takes effect at the next restart"
            );
        }
        Ok(json!({
            "generation": next.generation,
            "pools": changes,
            "restart_needed_for": restart_only,
            "took_ms": took_ms,
        }))
    }

    fn count(&self, outcome: &str) {
        self.current()
            .metrics
            .counter("keel_config_reloads_total", &[("outcome", outcome)])
            .increment(1);
    }

    /// With a config file: reloads when it changes while the current config has
    /// `[reload] watch = true` (polled every second; turning it on or off in the file takes
    /// effect at the next reload). Runs until the handle is dropped.
    ///
    /// Only a complete file is read: a change is acted on once the file's modification time
    /// and length have stayed the same for a whole poll (an editor or a config manager
    /// writing in place is done by then; one that renames a finished file into place is seen
    /// complete at once, and also waits one poll). A file caught half written anyway fails to
    /// parse, or, if it parses without its keys, is refused by the rule of [`guard_auth`].
    pub fn watch_source(self: &Arc<Self>) {
        let Some(path) = self.source.as_ref().map(|s| s.path.clone()) else {
            return;
        };
        let stamp = move || {
            std::fs::metadata(&path)
                .ok()
                .map(|m| (m.modified().ok(), m.len()))
        };
        let live = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut applied: Option<(Option<SystemTime>, u64)> = stamp();
            let mut changing: Option<Option<(Option<SystemTime>, u64)>> = None;
            loop {
                tokio::time::sleep(WATCH_POLL).await;
                let Some(live) = live.upgrade() else { return };
                let now = stamp();
                if now == applied || !live.current().cfg.reload_watch {
                    applied = now;
                    changing = None;
                    continue;
                }
                if changing != Some(now) {
                    // Changed since the last poll: wait until it stays the same for one.
                    changing = Some(now);
                    continue;
                }
                applied = now;
                changing = None;
                tracing::info!("config file changed: reloading");
                let _ = live.reload();
            }
        });
    }
}

impl Reloader for Live {
    fn reload(&self) -> Result<Value, ReloadError> {
        Live::reload(self)
    }

    fn apply(&self, cfg: Config) -> Result<Value, ReloadError> {
        Live::apply(self, cfg)
    }
}

/// A reload must not turn authentication off by accident (a file half written, a section
/// lost in a merge): dropping every key, or the admin key, needs `auth = "open"` in the new
/// file.
fn guard_auth(old: &Config, new: &Config) -> Result<(), ReloadError> {
    if new.auth_open {
        return Ok(());
    }
    let lost = if !old.keys.is_empty() && new.keys.is_empty() {
        "every [[keys]] entry"
    } else if old.admin_key_hash.is_some() && new.admin_key_hash.is_none() {
        "the admin key ([admin] key_hash)"
    } else {
        return Ok(());
    };
    Err(ReloadError {
        outcome: "refused",
        message: format!(
            "the new config removes {lost}, which would open keel to anyone who reaches it; if that is meant, say so with auth = \"open\" in the file; nothing was reloaded"
        ),
    })
}

/// The monitor and events tasks of `gw`.
fn spawn_tasks(gw: &Arc<Gateway>) -> Vec<JoinHandle<()>> {
    let mut tasks = vec![
        tokio::spawn(crate::pipeline::monitor::run(gw.clone())),
        tokio::spawn(crate::admin::events::run(gw.clone())),
    ];
    // Shared signals (`[redis] share_signals`) follow the current generation's pools too.
    tasks.extend(crate::state::signals::spawn(gw.signals_generation()));
    tasks
}
