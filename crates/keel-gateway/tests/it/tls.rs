//! TLS with real certificates made here (a test CA, server and client certificates, by rcgen)
//! and real clients: curl against keel's listener over HTTP/1.1 and HTTP/2 (ALPN), mutual TLS
//! (no client certificate is refused in the handshake, one from the CA is served), a rotated
//! certificate served to new connections after a reload and a broken one refused, a client
//! that never handshakes dropped; and keel towards an https upstream with a private CA and a
//! client certificate (a TLS front before keel-sim). Verification is never turned off.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use keel_sim::{Fleet, ServerConfig};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

/// A test certificate authority and the files it signs, in a directory of their own.
pub struct Pki {
    pub dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, as files.
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pki {
    pub fn new(name: &str) -> Pki {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("keel test CA {name}"));
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        Pki { dir, ca }
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A certificate for `127.0.0.1` and `localhost` named `cn`, with `serial`, written as
    /// `{stem}.pem` and `{stem}.key`: for a server, or a client (`client`).
    pub fn leaf(&self, stem: &str, cn: &str, serial: u64, client: bool) -> Leaf {
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.serial_number = Some(serial.into());
        params.extended_key_usages = vec![if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        let leaf = Leaf {
            cert: self.dir.join(format!("{stem}.pem")),
            key: self.dir.join(format!("{stem}.key")),
        };
        std::fs::write(&leaf.cert, cert.pem()).unwrap();
        std::fs::write(&leaf.key, key.serialize_pem()).unwrap();
        leaf
    }
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `[tls]` for `leaf`, requiring client certificates from `client_ca` when given.
fn tls_section(leaf: &Leaf, client_ca: Option<&Path>) -> String {
    let mut s = format!(
        "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        path(&leaf.cert),
        path(&leaf.key)
    );
    if let Some(ca) = client_ca {
        s.push_str(&format!("client_ca_file = \"{}\"\n", path(ca)));
    }
    s
}

/// What curl got: its exit code, the HTTP status and version (`%{http_code} %{http_version}`).
struct Curl {
    code: i32,
    out: String,
    err: String,
}

/// curl with `args`, run off the async workers.
async fn curl(args: Vec<String>) -> Curl {
    tokio::task::spawn_blocking(move || {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "20", "-o", "/dev/null"])
            .args(["-w", "%{http_code} %{http_version}"])
            .args(&args)
            .output()
            .expect("curl runs (apt-get install -y curl)");
        Curl {
            code: out.status.code().unwrap_or(-1),
            out: String::from_utf8_lossy(&out.stdout).into_owned(),
            err: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    })
    .await
    .unwrap()
}

/// A chat request to keel at `addr` over HTTPS, trusting `ca`, with `extra` curl arguments.
async fn curl_chat(addr: SocketAddr, ca: &Path, extra: &[&str]) -> Curl {
    let mut args: Vec<String> = vec![
        "--cacert".into(),
        path(ca).into(),
        "-H".into(),
        "content-type: application/json".into(),
        "-d".into(),
        chat_body("hello over tls").to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args.push(format!("https://{addr}/v1/chat/completions"));
    curl(args).await
}

#[tokio::test]
async fn curl_gets_answers_over_https_in_http1_and_http2() {
    let pki = Pki::new("inbound");
    let server = pki.leaf("server", "keel", 1, false);
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "{}\n{}",
        tls_section(&server, None),
        pool_over(&fleet, "p", "openai", 1, "")
    );
    let h = Harness::start(fleet, &cfg).await;

    let h1 = curl_chat(h.addr, &pki.ca_file(), &["--http1.1"]).await;
    assert_eq!(h1.out, "200 1.1", "{}", h1.err);
    let h2 = curl_chat(h.addr, &pki.ca_file(), &["--http2"]).await;
    assert_eq!(h2.out, "200 2", "{}", h2.err);
    // Plain HTTP on the TLS listener is not served.
    let plain = curl(vec![format!("http://{}/keel/health", h.addr)]).await;
    assert_ne!(plain.out.split(' ').next(), Some("200"), "{}", plain.out);
    assert_eq!(h.server(0).state.stats().requests, 2);
}

#[tokio::test]
async fn mutual_tls_refuses_a_client_without_a_certificate_from_the_ca() {
    let pki = Pki::new("mtls");
    let server = pki.leaf("server", "keel", 1, false);
    let client = pki.leaf("client", "a client", 2, true);
    let other = Pki::new("mtls-other");
    let stranger = other.leaf("client", "a stranger", 3, true);
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "{}\n{}",
        tls_section(&server, Some(&pki.ca_file())),
        pool_over(&fleet, "p", "openai", 1, "")
    );
    let h = Harness::start(fleet, &cfg).await;
    let ca = pki.ca_file();

    let none = curl_chat(h.addr, &ca, &[]).await;
    assert_ne!(
        none.code, 0,
        "served without a client certificate: {}",
        none.out
    );
    assert!(!none.out.starts_with("200"), "{}", none.out);
    let wrong = curl_chat(
        h.addr,
        &ca,
        &["--cert", path(&stranger.cert), "--key", path(&stranger.key)],
    )
    .await;
    assert_ne!(
        wrong.code, 0,
        "served a certificate from another CA: {}",
        wrong.out
    );
    // Both refusals are counted (read in-process: this listener speaks only TLS).
    let refused = || {
        parse_metric(
            &h.gw.metrics.render(),
            "keel_tls_handshake_failures_total",
            &[("reason", "refused")],
        )
    };
    wait_for!("both refused handshakes counted", refused() >= 2.0);
    for version in ["--http1.1", "--http2"] {
        let ok = curl_chat(
            h.addr,
            &ca,
            &[
                "--cert",
                path(&client.cert),
                "--key",
                path(&client.key),
                version,
            ],
        )
        .await;
        assert!(
            ok.out.starts_with("200 "),
            "{version}: {} {}",
            ok.out,
            ok.err
        );
    }
    assert_eq!(h.server(0).state.stats().requests, 2);
}

/// The certificate keel presents to a new connection (verified against `ca`).
async fn served_certificate(addr: SocketAddr, ca: &Path) -> CertificateDer<'static> {
    keel_gateway::install_crypto();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let tls = connector.connect(name, tcp).await.expect("handshake");
    tls.get_ref().1.peer_certificates().unwrap()[0].clone()
}

fn der_of(file: &Path) -> CertificateDer<'static> {
    CertificateDer::from_pem_file(file).unwrap()
}

#[tokio::test]
async fn a_reload_rotates_the_certificate_for_new_connections_and_refuses_a_broken_one() {
    let pki = Pki::new("rotate");
    let first = pki.leaf("server", "keel first", 1, false);
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let config = pki.dir.join("keel.toml");
    std::fs::write(
        &config,
        format!(
            "{}\n{}",
            tls_section(&first, None),
            pool_over(&fleet, "p", "openai", 1, "")
        ),
    )
    .unwrap();
    let (addr, live, _stop) = start_from_file(config).await;
    let ca = pki.ca_file();
    let old = served_certificate(addr, &ca).await;
    assert_eq!(old, der_of(&first.cert));

    // The certificate is renewed in place (same files), then keel is told to reload.
    let kept = std::fs::read(&first.cert).unwrap();
    let renewed = pki.leaf("server", "keel renewed", 2, false);
    let new = der_of(&renewed.cert);
    assert_ne!(new, old);
    live.reload().expect("the renewed certificate is accepted");
    assert_eq!(served_certificate(addr, &ca).await, new);
    let ok = curl_chat(addr, &ca, &[]).await;
    assert!(ok.out.starts_with("200 "), "{} {}", ok.out, ok.err);

    // A certificate that does not match the key (the old one back, the new key kept) is
    // refused, naming the file, and the running certificate stays.
    std::fs::write(&renewed.cert, &kept).unwrap();
    let e = live.reload().expect_err("a certificate without its key");
    assert_eq!(e.outcome, "invalid");
    assert!(
        e.message.contains("tls.key_file") && e.message.contains(path(&renewed.key)),
        "{}",
        e.message
    );
    assert_eq!(served_certificate(addr, &ca).await, new);
    // So is one that cannot be read.
    std::fs::write(&renewed.cert, "not a certificate").unwrap();
    let e = live.reload().expect_err("not a certificate");
    assert!(
        e.message.contains("tls.cert_file") && e.message.contains(path(&renewed.cert)),
        "{}",
        e.message
    );
    assert_eq!(served_certificate(addr, &ca).await, new);
    let ok = curl_chat(addr, &ca, &["--http2"]).await;
    assert_eq!(ok.out, "200 2", "{}", ok.err);
}

#[tokio::test]
async fn a_client_that_never_handshakes_is_dropped() {
    let pki = Pki::new("silent");
    let server = pki.leaf("server", "keel", 1, false);
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let cfg = format!(
        "header_read_timeout_ms = 200\n{}\n{}",
        tls_section(&server, None),
        pool_over(&fleet, "p", "openai", 1, "")
    );
    let h = Harness::start(fleet, &cfg).await;
    let mut tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    // Half a ClientHello's record header, then silence.
    tcp.write_all(&[0x16, 0x03]).await.unwrap();
    let mut buf = [0u8; 64];
    // The bound is for a broken build only: keel closes after 200 ms.
    let read = tokio::time::timeout(Duration::from_secs(30), tcp.read(&mut buf))
        .await
        .expect("keel closed the connection");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    let late = parse_metric(
        &h.gw.metrics.render(),
        "keel_tls_handshake_failures_total",
        &[("reason", "timeout")],
    );
    assert_eq!(late, 1.0);
}

/// A TLS front for an upstream: terminates TLS with `leaf` (asking for a client certificate
/// from `client_ca`, when given) and relays the bytes to `upstream`. Returns its address.
async fn tls_front(leaf: &Leaf, client_ca: Option<&Path>, upstream: SocketAddr) -> SocketAddr {
    keel_gateway::install_crypto();
    let chain: Vec<_> = CertificateDer::pem_file_iter(&leaf.cert)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&leaf.key).unwrap();
    let builder = rustls::ServerConfig::builder();
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).unwrap() {
                roots.add(c.unwrap()).unwrap();
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .unwrap();
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
            });
        }
    });
    addr
}

/// A chat through a pool `p` of one variant, an https upstream (keel-sim behind a TLS front
/// with `front_cert`, asking for a client certificate from `client_ca` when given), with
/// `keys` (the variant's TLS settings): the status, the body, and the requests keel-sim saw.
async fn chat_through(
    front_cert: &Leaf,
    client_ca: Option<&Path>,
    keys: &str,
) -> (u16, Value, u64) {
    let fleet = Fleet::start_n(1, ServerConfig::fast("s")).await.unwrap();
    let front = tls_front(front_cert, client_ca, fleet.get(0).addr).await;
    let url = format!("https://127.0.0.1:{}/v1", front.port());
    let cfg = format!(
        "max_attempts = 1\n[[pools]]\nname = \"p\"\n[pools.health]\nprewarm_requests = 0\nrefresh_after_ms = 0\n{}{keys}",
        variant("up", &url, "openai", 1)
    );
    let h = Harness::start(fleet, &cfg).await;
    let (status, _, body) = h.chat(&chat_body("hello upstream")).await;
    (status, body, h.server(0).state.stats().requests)
}

#[tokio::test]
async fn an_https_upstream_with_a_private_ca_and_a_client_certificate() {
    let pki = Pki::new("upstream");
    let front = pki.leaf("front", "upstream", 1, false);
    let client = pki.leaf("keel-client", "keel", 2, true);
    let ca = pki.ca_file();
    let with_ca = format!("ca_file = \"{}\"\n", path(&ca));
    let with_identity = format!(
        "{with_ca}client_cert_file = \"{}\"\nclient_key_file = \"{}\"\n",
        path(&client.cert),
        path(&client.key)
    );

    // A server certificate from a private CA: not trusted without `ca_file`, served with it.
    let (status, body, served) = chat_through(&front, None, "").await;
    assert_ne!(
        status, 200,
        "a private CA's certificate was trusted: {body}"
    );
    assert!(body.to_string().contains("UnknownIssuer"), "{body}");
    assert_eq!(served, 0);
    let (status, body, served) = chat_through(&front, None, &with_ca).await;
    assert_eq!((status, served), (200, 1), "{body}");

    // The upstream asks for a client certificate: refused without one, served with it.
    let (status, body, served) = chat_through(&front, Some(&ca), &with_ca).await;
    assert_ne!(status, 200, "served without a client certificate: {body}");
    assert!(body.to_string().contains("CertificateRequired"), "{body}");
    assert_eq!(served, 0);
    let (status, body, served) = chat_through(&front, Some(&ca), &with_identity).await;
    assert_eq!((status, served), (200, 1), "{body}");
}
