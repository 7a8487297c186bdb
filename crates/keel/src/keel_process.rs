//! `keel serve` as a child process of a benchmark, so that what is measured about the gateway
//! (resident memory, open file descriptors, CPU) is its own and not the load generator's.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A running `keel serve` on a free loopback port. Dropping it kills the process and removes
/// its generated config file.
pub struct KeelProcess {
    pub port: u16,
    child: Child,
    cfg_path: PathBuf,
}

impl KeelProcess {
    /// Starts the current executable as `keel serve` with `toml` (settings and pools, without
    /// `listen`), its output and log (`KEEL_BENCH_LOG`, default info) written to `log` or
    /// discarded, and returns once `/keel/ready` answers (its variants may still be warming up).
    pub async fn spawn(toml: &str, log: Option<std::fs::File>) -> Result<KeelProcess, String> {
        keel_gateway::Config::parse(toml, "<bench>", &Default::default())
            .map_err(|e| e.to_string())?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        // One file per child: a benchmark may run several gateways in one process.
        static N: AtomicU64 = AtomicU64::new(0);
        let cfg_path = std::env::temp_dir().join(format!(
            "keel-bench-{}-{}.toml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&cfg_path, format!("listen = \"127.0.0.1:{port}\"\n{toml}"))
            .map_err(|e| format!("{}: {e}", cfg_path.display()))?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let (stdout, stderr) = match log {
            // A file, not a terminal: no colour codes.
            Some(f) => (
                Stdio::from(f.try_clone().map_err(|e| e.to_string())?),
                Stdio::from(f),
            ),
            None => (Stdio::null(), Stdio::null()),
        };
        let child = Command::new(exe)
            .args(["serve", "--config"])
            .arg(&cfg_path)
            .env(
                "KEEL_LOG",
                std::env::var("KEEL_BENCH_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("NO_COLOR", "1")
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("cannot start keel serve: {e}"))?;
        let mut process = KeelProcess {
            port,
            child,
            cfg_path,
        };
        let probe = reqwest::Client::new();
        let url = format!("http://127.0.0.1:{port}/keel/ready");
        // A debug build on a loaded machine can take seconds to come up.
        for _ in 0..800 {
            if probe.get(&url).send().await.is_ok() {
                return Ok(process);
            }
            if let Ok(Some(status)) = process.child.try_wait() {
                return Err(format!("keel serve exited at start: {status}"));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Err("keel serve did not come up within 20 s".into())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process has exited (and how), without waiting.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for KeelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.cfg_path);
    }
}
