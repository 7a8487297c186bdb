//! The PEM files every TLS setting reads: the listener's certificate, key and client CA
//! (`[tls]`), a variant's CA bundle and client certificate (`ca_file`, `client_cert_file`,
//! `client_key_file`), Redis's CA (`[redis] ca_file`).
//!
//! The files are read and checked when the config is read (`keel check`, startup, each
//! reload), never on the request path: a certificate that cannot be read, holds no PEM block
//! of the right kind, or does not match its key is a config error that names the field and
//! the file, so a reload with a broken certificate is refused and the running one stays. A
//! reload that reads them again is how a rotated certificate takes effect: connections
//! accepted after it are served with the new one (those already open keep theirs).
//!
//! Everything runs on the ring provider, the listener and every client alike
//! ([`install_crypto`]).

use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig};

/// Installs the process-wide TLS crypto provider (ring) once.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// What the listener offers by ALPN, in keel's order of preference.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// A problem with one TLS file: the config key it came from and what is wrong (the message
/// names the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileError {
    /// The key that named the file, such as `cert_file`.
    pub key: &'static str,
    pub message: String,
}

impl FileError {
    fn new(key: &'static str, message: String) -> FileError {
        FileError { key, message }
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The file's bytes; the error names it.
pub fn read_file(path: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))
}

/// Every certificate in `pem` (read from `path`): at least one.
pub fn certificates(pem: &[u8], path: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{path}: not a valid PEM certificate file: {e}"))?;
    if certs.is_empty() {
        return Err(format!(
            "{path}: no certificate in it (expected a PEM `BEGIN CERTIFICATE` block)"
        ));
    }
    Ok(certs)
}

/// The private key in `pem` (read from `path`): PKCS#8, PKCS#1 (RSA) or SEC1.
pub fn private_key(pem: &[u8], path: &str) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| {
        format!(
            "{path}: no usable private key in it (expected a PEM `PRIVATE KEY`, `RSA PRIVATE KEY` or `EC PRIVATE KEY` block): {e}"
        )
    })
}

/// The certificates in `pem` as a trust store (a CA bundle read from `path`).
pub fn roots(pem: &[u8], path: &str) -> Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    for cert in certificates(pem, path)? {
        store
            .add(cert)
            .map_err(|e| format!("{path}: a certificate in it cannot be trusted as a CA: {e}"))?;
    }
    Ok(store)
}

/// A certificate chain (from `cert_key`'s file) and the private key (from `key_key`'s file)
/// read and checked to belong together.
fn certified(
    cert_key: &'static str,
    cert_file: &str,
    key_key: &'static str,
    key_file: &str,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), FileError> {
    let chain = read_file(cert_file)
        .and_then(|pem| certificates(&pem, cert_file))
        .map_err(|m| FileError::new(cert_key, m))?;
    let key = read_file(key_file)
        .and_then(|pem| private_key(&pem, key_file))
        .map_err(|m| FileError::new(key_key, m))?;
    let signing = provider()
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| FileError::new(key_key, format!("{key_file}: unusable private key: {e}")))?;
    match CertifiedKey::new(chain.clone(), signing).keys_match() {
        Ok(()) => Ok((chain, key)),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => Ok((chain, key)),
        Err(e) => Err(FileError::new(
            key_key,
            format!(
                "{key_file}: the private key does not match the certificate in {cert_file} ({e})"
            ),
        )),
    }
}

/// The listener's TLS settings from `[tls]`'s files: the certificate chain, its key, and the
/// CA that client certificates must be signed by (mutual TLS), when there is one.
pub fn server_config(
    cert_file: &str,
    key_file: &str,
    client_ca_file: Option<&str>,
) -> Result<ServerConfig, FileError> {
    let (chain, key) = certified("cert_file", cert_file, "key_file", key_file)?;
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| FileError::new("cert_file", e.to_string()))?;
    let builder = match client_ca_file {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let roots = read_file(path)
                .and_then(|pem| roots(&pem, path))
                .map_err(|m| FileError::new("client_ca_file", m))?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| FileError::new("client_ca_file", format!("{path}: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| FileError::new("key_file", format!("{key_file}: {e}")))?;
    config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A client certificate and its key for mutual TLS towards an upstream, checked to belong
/// together: the chain's PEM followed by the key's (the form reqwest's `Identity` takes).
pub fn client_identity(cert_file: &str, key_file: &str) -> Result<Vec<u8>, FileError> {
    certified("client_cert_file", cert_file, "client_key_file", key_file)?;
    let mut pem = read_file(cert_file).map_err(|m| FileError::new("client_cert_file", m))?;
    pem.push(b'\n');
    pem.extend(read_file(key_file).map_err(|m| FileError::new("client_key_file", m))?);
    Ok(pem)
}

/// A CA bundle's PEM, checked to hold at least one usable certificate.
pub fn ca_bundle(path: &str) -> Result<Vec<u8>, String> {
    let pem = read_file(path)?;
    roots(&pem, path)?;
    Ok(pem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_without_a_certificate_is_named() {
        let e = certificates(b"hello", "/x/cert.pem").unwrap_err();
        assert!(e.starts_with("/x/cert.pem: no certificate"), "{e}");
        let e = private_key(b"hello", "/x/key.pem").unwrap_err();
        assert!(e.starts_with("/x/key.pem: no usable private key"), "{e}");
    }
}
