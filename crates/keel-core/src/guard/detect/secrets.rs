//! API keys, tokens and private keys, found by their literal prefixes: AWS access key ids,
//! OpenAI and Anthropic keys, Google API keys, GitHub and Slack tokens, JWTs and PEM private
//! key blocks. One Aho-Corasick pass finds the prefixes; each is then checked for its body's
//! alphabet and length.

use std::sync::OnceLock;

use aho_corasick::{AhoCorasick, MatchKind};

use super::{finding, is_word};
use crate::guard::{Entity, Finding};

#[derive(Debug, Clone, Copy)]
enum Kind {
    /// `AKIA`/`ASIA`/`ABIA`/`ACCA` + 16 of [A-Z0-9].
    Aws,
    /// `AIza` + 35 of [A-Za-z0-9_-].
    Google,
    /// `sk-` (OpenAI, `sk-proj-`, Anthropic `sk-ant-`) + at least 32 of [A-Za-z0-9_-], with a
    /// digit and a letter.
    SkKey,
    /// `ghp_`/`gho_`/`ghu_`/`ghs_`/`ghr_` + at least 36 of [A-Za-z0-9].
    GitHub,
    /// `github_pat_` + at least 50 of [A-Za-z0-9_].
    GitHubPat,
    /// `xoxb-`/`xoxp-`/`xoxa-`/`xoxr-`/`xoxs-`/`xapp-` + at least 10 of [A-Za-z0-9-] with a digit.
    Slack,
    /// Three base64url segments, the first `eyJ` (a JSON header).
    Jwt,
    /// `-----BEGIN ... PRIVATE KEY-----` through its `-----END ... PRIVATE KEY-----`.
    Pem,
}

const PREFIXES: &[(&str, Kind)] = &[
    ("AKIA", Kind::Aws),
    ("ASIA", Kind::Aws),
    ("ABIA", Kind::Aws),
    ("ACCA", Kind::Aws),
    ("AIza", Kind::Google),
    ("sk-", Kind::SkKey),
    ("ghp_", Kind::GitHub),
    ("gho_", Kind::GitHub),
    ("ghu_", Kind::GitHub),
    ("ghs_", Kind::GitHub),
    ("ghr_", Kind::GitHub),
    ("github_pat_", Kind::GitHubPat),
    ("xoxb-", Kind::Slack),
    ("xoxp-", Kind::Slack),
    ("xoxa-", Kind::Slack),
    ("xoxr-", Kind::Slack),
    ("xoxs-", Kind::Slack),
    ("xapp-", Kind::Slack),
    ("eyJ", Kind::Jwt),
    ("-----BEGIN ", Kind::Pem),
];

fn automaton() -> &'static AhoCorasick {
    static AC: OnceLock<AhoCorasick> = OnceLock::new();
    AC.get_or_init(|| {
        AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostFirst)
            .build(PREFIXES.iter().map(|(p, _)| p))
            .expect("fixed secret prefixes compile")
    })
}

fn b64url(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'-'
}

/// The end of the run of `ok` bytes from `s`.
fn run(b: &[u8], s: usize, ok: impl Fn(u8) -> bool) -> usize {
    let mut e = s;
    while e < b.len() && ok(b[e]) {
        e += 1;
    }
    e
}

pub(super) fn scan(b: &[u8], out: &mut Vec<Finding>) {
    let mut from = 0;
    while from < b.len() {
        let Some(m) = automaton().find(&b[from..]) else {
            break;
        };
        let (s, p) = (from + m.start(), from + m.end());
        let kind = PREFIXES[m.pattern().as_usize()].1;
        let boundary = s == 0 || !(is_word(b[s - 1]) || b[s - 1] == b'-');
        match boundary.then(|| body_end(b, p, kind)).flatten() {
            Some(e) => {
                out.extend(finding(Entity::Secret, s, e));
                from = e;
            }
            None => from = s + 1,
        }
    }
}

/// Where the secret whose prefix ends at `p` ends, if its body has the right shape.
fn body_end(b: &[u8], p: usize, kind: Kind) -> Option<usize> {
    let ends = |e: usize, ok: &dyn Fn(u8) -> bool| !b.get(e).is_some_and(|&c| ok(c));
    let e = match kind {
        Kind::Aws => {
            let e = run(b, p, |c| c.is_ascii_uppercase() || c.is_ascii_digit());
            (e - p == 16 && ends(e, &is_word)).then_some(e)?
        }
        Kind::Google => {
            let e = run(b, p, b64url);
            (e - p == 35).then_some(e)?
        }
        Kind::SkKey => {
            let e = run(b, p, b64url);
            let body = &b[p..e];
            let ok = body.len() >= 32
                && body.iter().any(u8::is_ascii_digit)
                && body.iter().any(u8::is_ascii_alphabetic);
            ok.then_some(e)?
        }
        Kind::GitHub => {
            let e = run(b, p, |c| c.is_ascii_alphanumeric());
            ((36..=255).contains(&(e - p)) && ends(e, &is_word)).then_some(e)?
        }
        Kind::GitHubPat => {
            let e = run(b, p, is_word);
            (e - p >= 50).then_some(e)?
        }
        Kind::Slack => {
            let e = run(b, p, |c| c.is_ascii_alphanumeric() || c == b'-');
            let body = &b[p..e];
            (body.len() >= 10 && body.iter().any(u8::is_ascii_digit)).then_some(e)?
        }
        Kind::Jwt => jwt_end(b, p)?,
        Kind::Pem => pem_end(b, p)?,
    };
    Some(e)
}

fn jwt_end(b: &[u8], p: usize) -> Option<usize> {
    let h = run(b, p, b64url);
    if h - p < 7 || b.get(h) != Some(&b'.') {
        return None;
    }
    let pl = run(b, h + 1, b64url);
    if pl - (h + 1) < 8 || b.get(pl) != Some(&b'.') {
        return None;
    }
    let sig = run(b, pl + 1, b64url);
    (sig - (pl + 1) >= 8).then_some(sig)
}

/// A PEM private key block: the header must name a private key on its line; the block ends
/// after the matching footer, or at the end of the text when the footer is missing (a cut-off
/// key is still a key).
fn pem_end(b: &[u8], p: usize) -> Option<usize> {
    let line_end = run(b, p, |c| c != b'\n').min(p + 64);
    let header = &b[p..line_end];
    let tag = b"PRIVATE KEY-----";
    if !header.windows(tag.len()).any(|w| w == tag) {
        return None;
    }
    let rest = &b[line_end..];
    let footer = memchr::memmem::find(rest, b"-----END ")
        .and_then(|f| memchr::memmem::find(&rest[f..], tag).map(|t| line_end + f + t + tag.len()));
    Some(footer.unwrap_or(b.len()))
}
