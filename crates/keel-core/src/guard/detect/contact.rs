//! Values around an `@`: email addresses and URLs that carry credentials
//! (`scheme://user:password@host`).

use super::finding;
use crate::guard::{Entity, Finding};

/// How far back from an `@` a URL's `://` may sit.
const MAX_USERINFO: usize = 256;

fn local_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'%' | b'+' | b'-')
}

fn domain_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'-'
}

/// The end of a host name starting at `s`: labels of letters, digits and dashes joined by dots,
/// at least two labels, the last all letters and at least two long. `None` when no such host.
fn host_end(b: &[u8], s: usize) -> Option<usize> {
    let mut e = s;
    let mut last_label;
    let mut dots = 0;
    loop {
        let ls = e;
        while e < b.len() && domain_byte(b[e]) {
            e += 1;
        }
        if e == ls {
            return None;
        }
        last_label = ls;
        if e + 1 < b.len() && b[e] == b'.' && domain_byte(b[e + 1]) {
            e += 1;
            dots += 1;
        } else {
            break;
        }
    }
    let tld = &b[last_label..e];
    let ok = dots >= 1 && tld.len() >= 2 && tld.iter().all(u8::is_ascii_alphabetic);
    ok.then_some(e)
}

/// The email address or credential-carrying URL around the `@` at `at`.
pub(super) fn at_sign(b: &[u8], at: usize) -> Option<Finding> {
    if let Some(f) = url_credentials(b, at) {
        return Some(f);
    }
    let mut s = at;
    while s > 0 && local_byte(b[s - 1]) && at - s < 64 {
        s -= 1;
    }
    while s < at && b[s] == b'.' {
        s += 1;
    }
    if s == at || b[at - 1] == b'.' || (s > 0 && (b[s - 1] == b'/' || b[s - 1] == b':')) {
        return None;
    }
    let e = host_end(b, at + 1)?;
    finding(Entity::Email, s, e)
}

/// `scheme://userinfo@host` where the userinfo holds a `:` (a password or token follows the
/// user name). The finding spans scheme to host.
fn url_credentials(b: &[u8], at: usize) -> Option<Finding> {
    let lo = at.saturating_sub(MAX_USERINFO);
    let mut k = at;
    let mut colon = false;
    let sep = loop {
        if k <= lo + 2 {
            return None;
        }
        k -= 1;
        match b[k] {
            b'/' if b[k - 1] == b'/' && b[k - 2] == b':' => break k - 2,
            b'/' | b' ' | b'\t' | b'\n' | b'\r' | b'"' | b'\'' | b'<' | b'>' | b'@' => return None,
            b':' => colon = true,
            _ => {}
        }
    };
    if !colon {
        return None;
    }
    let mut s = sep;
    while s > 0 && (b[s - 1].is_ascii_alphanumeric() || matches!(b[s - 1], b'+' | b'.' | b'-')) {
        s -= 1;
    }
    if s == sep || !b[s].is_ascii_alphabetic() {
        return None;
    }
    let mut e = at + 1;
    while e < b.len() && (domain_byte(b[e]) || b[e] == b'.') {
        e += 1;
    }
    while e > at + 1 && b[e - 1] == b'.' {
        e -= 1;
    }
    if e == at + 1 {
        return None;
    }
    finding(Entity::UrlCredentials, s, e)
}
