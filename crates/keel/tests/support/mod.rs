//! What the process-level tests share: child processes that die with the test, free loopback
//! ports, and waiting for a port to listen.

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

pub fn wait_listening(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not start on port {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `keel serve --config cfg`, logging at `KEEL_LOG=log`, its stdout to `stdout` and its stderr
/// nowhere; returns once it listens on `port`.
pub fn keel_serve(cfg: &Path, port: u16, log: &str, stdout: Stdio) -> Proc {
    let child = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["serve", "--config", cfg.to_str().unwrap()])
        .env("KEEL_LOG", log)
        .stdout(stdout)
        .stderr(Stdio::null())
        .spawn()
        .expect("start keel serve");
    wait_listening(port, "keel serve");
    Proc(child)
}
