//! `[tls]`: keel's listener speaks HTTPS (the files are read by [`super::pem`]; the handshake is
//! the HTTP server's).
//!
//! ```toml
//! [tls]
//! cert_file = "/etc/keel/tls/cert.pem"     # PEM chain, the server's certificate first
//! key_file = "/etc/keel/tls/key.pem"       # PEM private key (PKCS#8, RSA or SEC1)
//! client_ca_file = "/etc/keel/tls/ca.pem"  # optional: every client must present a certificate signed by it
//! ```
//!
//! The files are read here, so a config whose certificate is unreadable or does not match its
//! key is refused (at `keel check`, at startup, at a reload, which keeps the running one).

use std::fmt;

use tokio_rustls::TlsAcceptor;

use super::read::{Issues, Table};

/// The listener's TLS: where its files are, and the handshake settings read from them.
#[derive(Clone)]
pub struct TlsConfig {
    pub cert_file: String,
    pub key_file: String,
    /// Clients must present a certificate signed by this CA (mutual TLS).
    pub client_ca_file: Option<String>,
    /// The certificate, key and client verifier as the files were when the config was read.
    pub acceptor: TlsAcceptor,
}

/// Only the file names: the key itself never reaches a log.
impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("client_ca_file", &self.client_ca_file)
            .finish_non_exhaustive()
    }
}

pub(super) fn read(t: Option<Table>, issues: &mut Issues) -> Option<TlsConfig> {
    let mut t = t?;
    let cert = t.required::<String>("cert_file", "the path of a PEM certificate chain", issues);
    let key = t.required::<String>("key_file", "the path of a PEM private key", issues);
    let client_ca = t.get::<String>("client_ca_file", issues);
    let at = t.at();
    let path = t.path().to_owned();
    t.finish(issues);
    let (cert, key) = (cert?, key?);
    match crate::config::pem::server_config(
        &cert.value,
        &key.value,
        client_ca.as_ref().map(|c| c.value.as_str()),
    ) {
        Ok(server) => Some(TlsConfig {
            cert_file: cert.value,
            key_file: key.value,
            client_ca_file: client_ca.map(|c| c.value),
            acceptor: TlsAcceptor::from(std::sync::Arc::new(server)),
        }),
        Err(e) => {
            // Reported where the file is named.
            let at = match e.key {
                "cert_file" => cert.at,
                "key_file" => key.at,
                _ => client_ca.as_ref().map_or(at, |c| c.at),
            };
            issues.report(at, &format!("{path}.{}", e.key), e.message);
            None
        }
    }
}

/// A variant's TLS towards its upstream (`ca_file`, `client_cert_file` + `client_key_file`):
/// for private fleets whose servers have certificates from a private CA, or that ask keel
/// for a client certificate. Such a variant gets an HTTP client of its own (see `upstream`).
#[derive(Clone, PartialEq, Eq)]
pub struct UpstreamTls {
    pub ca_file: Option<String>,
    /// The CA bundle as read, trusted in addition to the system's roots.
    pub ca_pem: Option<Vec<u8>>,
    pub client_cert_file: Option<String>,
    /// The client certificate chain's PEM followed by its key's, checked to match.
    pub identity_pem: Option<Vec<u8>>,
}

/// File names only: never the key.
impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("ca_file", &self.ca_file)
            .field("client_cert_file", &self.client_cert_file)
            .finish_non_exhaustive()
    }
}

/// A variant's `ca_file`, `client_cert_file` and `client_key_file`, read and checked; `None`
/// when it sets none (or they are wrong, which is reported). `url` is the variant's base URL,
/// if valid: the settings need `https://`.
pub(super) fn read_upstream(
    t: &mut Table,
    url: Option<&str>,
    issues: &mut Issues,
) -> Option<UpstreamTls> {
    let ca = t.get::<String>("ca_file", issues);
    let cert = t.get::<String>("client_cert_file", issues);
    let key = t.get::<String>("client_key_file", issues);
    let first = ca.as_ref().or(cert.as_ref()).or(key.as_ref())?;
    if url.is_some_and(|u| !u.starts_with("https://")) {
        issues.report(
            first.at,
            &first.path,
            "TLS settings need an https:// url (this variant's is plain http://)",
        );
        return None;
    }
    let ca_pem = match &ca {
        Some(c) => match crate::config::pem::ca_bundle(&c.value) {
            Ok(pem) => Some(pem),
            Err(m) => {
                issues.report(c.at, &c.path, m);
                return None;
            }
        },
        None => None,
    };
    let identity_pem = match (&cert, &key) {
        (None, None) => None,
        (Some(c), Some(k)) => match crate::config::pem::client_identity(&c.value, &k.value) {
            Ok(pem) => Some(pem),
            Err(e) => {
                let at = if e.key == "client_cert_file" { c } else { k };
                issues.report(at.at, &at.path, e.message);
                return None;
            }
        },
        (Some(one), None) | (None, Some(one)) => {
            issues.report(
                one.at,
                &one.path,
                "set client_cert_file and client_key_file together (a client certificate needs its key)",
            );
            return None;
        }
    };
    Some(UpstreamTls {
        ca_file: ca.map(|c| c.value),
        ca_pem,
        client_cert_file: cert.map(|c| c.value),
        identity_pem,
    })
}
