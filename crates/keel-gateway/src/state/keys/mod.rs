//! Virtual keys: who may call keel, on which pools, within which limits.
//!
//! * this module: the key registry and authentication. A client presents its key as
//!   `Authorization: Bearer …` or `x-api-key`; keel hashes it (SHA-256) and compares the hash
//!   with every configured one in constant time, so neither the comparison nor the config holds
//!   or leaks the secret.
//! * [`limits`]: what admission takes for a keyed request (rpm, tpm, budgets, a concurrency
//!   slot), held in a [`Grant`] that reconciles with the real usage when the request ends.
//! * `observe::meter`: the tokens each attempt used, which limits reconcile with.
//! * [`headers`]: the rate-limit headers in the client's protocol.
//! * [`admin`]: `GET /keel/keys/{id}/usage`.

pub mod headers;
pub mod limits;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use http::HeaderMap;

use keel_core::protocol::ErrorKind;

use crate::config::{Config, KeyConfig};
use crate::wire::errors::GatewayError;
use crate::wire::routes::Access;

pub use limits::Grant;

pub use crate::config::{hash_secret, hash_text};

/// Equal without an early exit: the time taken does not say how much of a hash matched.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The key a client presented: `Authorization: Bearer …` or `x-api-key`.
pub fn presented(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        });
    bearer
        .or_else(|| {
            headers
                .get(crate::wire::X_API_KEY)
                .and_then(|v| v.to_str().ok())
        })
        .map(str::trim)
        .filter(|k| !k.is_empty())
}

/// A fresh key: `sk-keel-` and 43 URL-safe base64 characters of 32 random bytes.
pub fn new_secret() -> Result<String, String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness available: {e}"))?;
    Ok(format!("sk-keel-{}", base64url(&bytes)))
}

/// Unpadded URL-safe base64.
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (*b as u32) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// The configured keys, and the admin key's hash.
pub struct Keys {
    keys: Vec<Arc<KeyConfig>>,
    admin: Option<[u8; 32]>,
    /// When the last "quota store unavailable" line was logged (Unix seconds), so that an
    /// outage logs once a minute rather than once a request.
    last_store_log: AtomicU64,
}

impl Keys {
    pub fn new(cfg: &Config) -> Keys {
        Keys {
            keys: cfg.keys.iter().cloned().map(Arc::new).collect(),
            admin: cfg.admin_key_hash,
            last_store_log: AtomicU64::new(0),
        }
    }

    /// Whether keys are configured (otherwise keel runs open).
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    pub fn by_id(&self, id: &str) -> Option<&Arc<KeyConfig>> {
        self.keys.iter().find(|k| k.id == id)
    }

    /// The key whose hash matches `secret`'s; every key is compared, whatever matches.
    fn find(&self, secret: &str) -> Option<&Arc<KeyConfig>> {
        let h = hash_secret(secret);
        self.keys.iter().fold(
            None,
            |found, k| if ct_eq(&k.hash, &h) { Some(k) } else { found },
        )
    }

    /// The client's key: `Ok(None)` when keel runs open, 401 when missing or unknown.
    pub fn authenticate(
        &self,
        headers: &HeaderMap,
    ) -> Result<Option<Arc<KeyConfig>>, GatewayError> {
        if !self.enabled() {
            return Ok(None);
        }
        let secret = presented(headers).ok_or_else(|| {
            GatewayError::new(
                ErrorKind::Authentication,
                "missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`",
            )
        })?;
        let key = self
            .find(secret)
            .ok_or_else(|| GatewayError::new(ErrorKind::Authentication, "invalid API key"))?;
        if !key.tenant_role {
            return Err(GatewayError::new(
                ErrorKind::Permission,
                format!(
                    "key `{}` is an operations key (roles = [\"ops\"]): it reads /keel and /metrics, and calls no model",
                    key.id
                ),
            ));
        }
        Ok(Some(key.clone()))
    }

    /// Whether the operations plane is closed to outsiders: keys or an admin key are
    /// configured. With neither, keel runs open (a local or fully trusted deployment).
    pub fn secured(&self) -> bool {
        self.enabled() || self.admin.is_some()
    }

    /// Whether the request may use a route of `access` (see `routes::Access`); the error to
    /// answer otherwise. Tenant routes are checked by their handlers, which need the key.
    pub fn authorize(
        &self,
        access: Access,
        headers: &HeaderMap,
        uri: &http::Uri,
    ) -> Result<(), GatewayError> {
        match access {
            Access::Anyone | Access::Tenant => Ok(()),
            Access::Ops if self.secured() => self.authenticate_ops(headers),
            Access::Admin if self.secured() => self.authenticate_admin(headers),
            Access::Ops => Ok(()),
            Access::Admin => same_site_json(headers, uri),
        }
    }

    /// The admin key, or a key with the `ops` role: 401 when missing or unknown, 403 for a
    /// tenant's key without the role.
    fn authenticate_ops(&self, headers: &HeaderMap) -> Result<(), GatewayError> {
        let secret = presented(headers).ok_or_else(|| {
            GatewayError::new(
                ErrorKind::Authentication,
                "missing key: the operations plane needs the admin key or a key with the `ops` role, as `Authorization: Bearer <key>`",
            )
        })?;
        let hash = hash_secret(secret);
        if self.admin.as_ref().is_some_and(|a| ct_eq(a, &hash)) {
            return Ok(());
        }
        match self.find(secret) {
            Some(k) if k.ops => Ok(()),
            Some(k) => Err(GatewayError::new(
                ErrorKind::Permission,
                format!(
                    "key `{}` may not read the operations plane (it needs roles = [\"ops\"], or the admin key)",
                    k.id
                ),
            )),
            None => Err(GatewayError::new(ErrorKind::Authentication, "invalid key")),
        }
    }

    /// Checks the admin key: 401 when missing, 403 when not the admin's (or none is set).
    pub fn authenticate_admin(&self, headers: &HeaderMap) -> Result<(), GatewayError> {
        let secret = presented(headers).ok_or_else(|| {
            GatewayError::new(
                ErrorKind::Authentication,
                "missing admin key: send it as `Authorization: Bearer <admin key>`",
            )
        })?;
        match &self.admin {
            Some(admin) if ct_eq(admin, &hash_secret(secret)) => Ok(()),
            Some(_) => Err(GatewayError::new(
                ErrorKind::Permission,
                "this key is not the admin key",
            )),
            None => Err(GatewayError::new(
                ErrorKind::Permission,
                "no admin key is configured ([admin] key_hash)",
            )),
        }
    }

    /// Whether a store error should be logged now (at most once a minute).
    pub(crate) fn should_log_store_error(&self) -> bool {
        let now = limits::unix_now();
        let last = self.last_store_log.load(Ordering::Relaxed);
        now >= last + 60
            && self
                .last_store_log
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// An admin change on a gateway without keys must come as JSON and from no foreign web origin.
/// A web page can make a browser send a cross-site POST with a form's content types and no
/// preflight, but not `application/json`; and a browser always names the page's origin in
/// `Origin`, which must then be keel's own (the host the request was sent to: `Host`, or
/// HTTP/2's `:authority`).
fn same_site_json(headers: &HeaderMap, uri: &http::Uri) -> Result<(), GatewayError> {
    let json = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(GatewayError::new(
            ErrorKind::UnsupportedMediaType,
            "admin requests must be sent with `content-type: application/json` (a web page cannot send that across sites)",
        ));
    }
    let Some(origin) = headers.get(http::header::ORIGIN) else {
        return Ok(());
    };
    let host = headers
        .get(http::header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| uri.authority().map(|a| a.as_str()));
    let origin_host = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .map(|(_, rest)| rest.trim_end_matches('/'));
    match (origin_host, host) {
        (Some(o), Some(h)) if o.eq_ignore_ascii_case(h.trim()) => Ok(()),
        _ => Err(GatewayError::new(
            ErrorKind::Permission,
            "admin requests from a web page of another origin are refused",
        )),
    }
}

/// 403 for a pool the key may not use.
pub fn check_pool(key: &KeyConfig, pool: &str) -> Result<(), GatewayError> {
    if key.allows(pool) {
        return Ok(());
    }
    Err(GatewayError::new(
        ErrorKind::Permission,
        format!(
            "key `{}` may not use model `{pool}`; it may use: {}",
            key.id,
            key.pools.join(", ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_fresh_url_safe_and_hash_as_sha256() {
        let a = new_secret().unwrap();
        let b = new_secret().unwrap();
        assert_ne!(a, b);
        let tail = a.strip_prefix("sk-keel-").unwrap();
        assert_eq!(tail.len(), 43);
        assert!(tail
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'));
        // The SHA-256 of "abc", a published test vector.
        assert_eq!(
            hash_text(&hash_secret("abc")),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
    }

    #[test]
    fn keys_come_as_bearer_or_x_api_key() {
        let mut h = HeaderMap::new();
        assert_eq!(presented(&h), None);
        h.insert("x-api-key", "k1".parse().unwrap());
        assert_eq!(presented(&h), Some("k1"));
        h.insert("authorization", "Bearer k2".parse().unwrap());
        assert_eq!(presented(&h), Some("k2"));
        assert!(ct_eq(&hash_secret("x"), &hash_secret("x")));
        assert!(!ct_eq(&hash_secret("x"), &hash_secret("y")));
    }
}
