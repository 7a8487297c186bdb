//! A real `redis-server` for the tests: a child process on a free loopback port, with no
//! persistence, killed when dropped; plain, or TLS only (`rediss://`) with a certificate from
//! a test CA made here. A missing binary fails the test (it must not pass by skipping):
//! `scripts/test.sh` installs it.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    /// TLS only: the directory of `ca.pem`, `server.pem` and `server.key`.
    tls: Option<PathBuf>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        // Ask the OS for a free port, then give it to redis-server.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let mut server = RedisServer {
            port,
            child: None,
            tls: None,
        };
        server.restart();
        server
    }

    /// A server that speaks only TLS, with a certificate for 127.0.0.1 from a CA made here
    /// (see [`RedisServer::ca_pem`]); clients need no certificate.
    pub fn start_tls() -> RedisServer {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let dir = std::env::temp_dir().join(format!("keel-rediss-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.join("server.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
        let mut server = RedisServer {
            port,
            child: None,
            tls: Some(dir),
        };
        server.restart();
        server
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The test CA's certificate (PEM) of a TLS server.
    pub fn ca_pem(&self) -> Option<Vec<u8>> {
        let dir = self.tls.as_ref()?;
        Some(std::fs::read(dir.join("ca.pem")).unwrap())
    }

    /// Kills the server (its state is lost: nothing is saved).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server (again) on the same port and waits until it accepts connections.
    pub fn restart(&mut self) {
        self.kill();
        let port = self.port.to_string();
        let mut command = Command::new("redis-server");
        match &self.tls {
            None => command.args(["--port", &port]),
            Some(dir) => {
                let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
                command
                    .args(["--port", "0", "--tls-port", &port])
                    .args(["--tls-cert-file", &file("server.pem")])
                    .args(["--tls-key-file", &file("server.key")])
                    .args(["--tls-ca-cert-file", &file("ca.pem")])
                    .args(["--tls-auth-clients", "no"])
            }
        };
        let child = command
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start `redis-server` ({e}): these tests need a real one; install it \
                     (`apt-get install -y redis-server`, which scripts/test.sh does)"
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "redis-server exited at start ({status}); port {}",
                    self.port
                );
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not listen on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
