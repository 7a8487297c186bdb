//! Digit-led values: IPv4 and IPv6 addresses, US SSNs, payment cards, IBANs and phone numbers.

use super::{finding, is_word};
use crate::guard::validate::{card_issuer_ok, iban_length, iban_valid, luhn_valid, ssn_valid};
use crate::guard::{Entity, Finding};

/// At most this many digit groups make one number.
const MAX_GROUPS: usize = 8;

/// The separators that join digit groups into one number, longest first.
const GAPS: &[&[u8]] = &[b") ", b")-", b" (", b" ", b"-", b".", b")"];

/// A run of digits and the separator bytes that follow it before the next run.
#[derive(Debug, Clone, Copy)]
struct Group {
    start: usize,
    end: usize,
}

/// Consecutive digit groups from `i` (a digit), joined by short separators of spaces, dashes,
/// dots and parentheses: "415-555-0132", "(415) 555 0132", "4111 1111 1111 1111".
fn groups(b: &[u8], i: usize) -> Vec<Group> {
    let mut out = Vec::with_capacity(4);
    let mut s = i;
    loop {
        let mut e = s;
        while e < b.len() && b[e].is_ascii_digit() {
            e += 1;
        }
        out.push(Group { start: s, end: e });
        if out.len() == MAX_GROUPS {
            break;
        }
        let Some(len) = GAPS.iter().find(|g| b[e..].starts_with(g)).map(|g| g.len()) else {
            break;
        };
        let j = e + len;
        if !b.get(j).is_some_and(u8::is_ascii_digit) {
            break;
        }
        s = j;
    }
    out
}

fn gap<'a>(b: &'a [u8], g: &[Group], k: usize) -> &'a [u8] {
    &b[g[k].end..g[k + 1].start]
}

fn lens(g: &[Group]) -> Vec<usize> {
    g.iter().map(|g| g.end - g.start).collect()
}

fn digits_of(b: &[u8], g: &[Group]) -> Vec<u8> {
    g.iter().flat_map(|g| &b[g.start..g.end]).copied().collect()
}

/// Whether the value may end at `end`: no word byte follows, and no separator-and-digit (the
/// number would go on).
fn ends_clean(b: &[u8], end: usize) -> bool {
    match b.get(end) {
        None => true,
        Some(&c) if is_word(c) => false,
        Some(b'.' | b'-') => !b.get(end + 1).is_some_and(u8::is_ascii_digit),
        Some(_) => true,
    }
}

/// The detectors for a digit at `i`.
pub(super) fn digits(b: &[u8], i: usize) -> Option<Finding> {
    if i > 0 {
        let p = b[i - 1];
        if is_word(p) {
            return iban(b, i);
        }
        // A digit, then one separator: this run continues a number that did not qualify.
        if p == b'+' || (matches!(p, b'.' | b'-' | b' ') && i >= 2 && b[i - 2].is_ascii_digit()) {
            return None;
        }
    }
    let g = groups(b, i);
    ipv4(b, &g)
        .or_else(|| ssn(b, &g))
        .or_else(|| card(b, &g))
        .or_else(|| phone_national(b, i, &g))
}

/// The longest prefix of `g` (as many groups as `k`) that `accept` takes and that may end where
/// it ends; a shorter prefix only where a space follows it.
fn longest_prefix(b: &[u8], g: &[Group], accept: impl Fn(&[Group]) -> bool) -> Option<usize> {
    (1..=g.len()).rev().find(|&k| {
        let end = g[k - 1].end;
        let cut_ok = k == g.len() || b[end] == b' ';
        cut_ok && ends_clean(b, end) && accept(&g[..k])
    })
}

fn ipv4(b: &[u8], g: &[Group]) -> Option<Finding> {
    if g.len() < 4 {
        return None;
    }
    let g = &g[..4];
    let ok = (0..3).all(|k| gap(b, g, k) == b".")
        && g.iter().all(|x| {
            let d = &b[x.start..x.end];
            d.len() <= 3
                && (d.len() == 1 || d[0] != b'0')
                && d.iter().fold(0u32, |a, &c| a * 10 + u32::from(c - b'0')) <= 255
        });
    let end = g[3].end;
    let clean = ends_clean(b, end)
        && !(b.get(end) == Some(&b'.') && b.get(end + 1).is_some_and(u8::is_ascii_digit));
    (ok && clean).then(|| Finding {
        entity: Entity::Ip,
        range: g[0].start..end,
    })
}

fn ssn(b: &[u8], g: &[Group]) -> Option<Finding> {
    if g.len() < 3 || lens(&g[..3]) != [3, 2, 4] {
        return None;
    }
    let sep = gap(b, g, 0);
    let ok = (sep == b"-" || sep == b" ")
        && gap(b, g, 1) == sep
        && (g.len() == 3 || b[g[2].end] == b' ')
        && ends_clean(b, g[2].end)
        && ssn_valid(&digits_of(b, &g[..3]));
    ok.then(|| Finding {
        entity: Entity::Ssn,
        range: g[0].start..g[2].end,
    })
}

fn card(b: &[u8], g: &[Group]) -> Option<Finding> {
    let k = longest_prefix(b, g, |g| {
        let total: usize = g.iter().map(|x| x.end - x.start).sum();
        if !(12..=19).contains(&total) {
            return false;
        }
        let sep = if g.len() > 1 { gap(b, g, 0) } else { b"" };
        let seps_ok = (sep == b" " || sep == b"-" || g.len() == 1)
            && (1..g.len().saturating_sub(1)).all(|k| gap(b, g, k) == sep)
            && g.iter().all(|x| x.end - x.start >= 3);
        let d = digits_of(b, g);
        seps_ok && luhn_valid(&d) && card_issuer_ok(&d)
    })?;
    Some(Finding {
        entity: Entity::Card,
        range: g[0].start..g[k - 1].end,
    })
}

/// National phone formats: US "(415) 555-0132" / "415-555-0132" / "415.555.0132", and
/// trunk-prefixed European numbers "020 7946 0958", "030 12345678", "06 12 34 56 78", plus
/// Spanish "612 345 678" and "91 123 45 67".
fn phone_national(b: &[u8], start: usize, g: &[Group]) -> Option<Finding> {
    let k = longest_prefix(b, g, |g| national_shape(b, g))?;
    Some(Finding {
        entity: Entity::Phone,
        range: start..g[k - 1].end,
    })
}

fn national_shape(b: &[u8], g: &[Group]) -> bool {
    let l = lens(g);
    let total: usize = l.iter().sum();
    if g.len() < 2 || !(9..=12).contains(&total) {
        return false;
    }
    if (0..g.len() - 1).any(|k| gap(b, g, k).contains(&b'(')) {
        return false;
    }
    let first = b[g[0].start];
    let all_gaps = |s: &[u8]| (0..g.len() - 1).all(|k| gap(b, g, k) == s);
    let us = l == [3, 3, 4]
        && (all_gaps(b"-") || all_gaps(b".") || all_gaps(b" ") || gap(b, g, 0) == b") ")
        && first != b'0';
    let trunk =
        first == b'0' && total >= 10 && (2..=5).contains(&l[0]) && l.iter().all(|&n| n >= 2);
    let spanish = (l == [3, 3, 3] && matches!(first, b'6' | b'7' | b'9') && all_gaps(b" "))
        || (l == [2, 3, 2, 2] && matches!(first, b'8' | b'9') && all_gaps(b" "));
    us || trunk || spanish
}

/// A phone number led by `+` (international, E.164: 8 to 15 digits, the first not zero) or by
/// `(` (US area code in parentheses).
pub(super) fn phone_lead(b: &[u8], i: usize) -> Option<Finding> {
    if i > 0 && (is_word(b[i - 1]) || b[i - 1] == b'+') {
        return None;
    }
    let d = i + 1;
    if !b.get(d).is_some_and(u8::is_ascii_digit) {
        return None;
    }
    let g = groups(b, d);
    let k = if b[i] == b'+' {
        longest_prefix(b, &g, |g| {
            let total: usize = g.iter().map(|x| x.end - x.start).sum();
            b[d] != b'0' && (8..=15).contains(&total)
        })?
    } else {
        longest_prefix(b, &g, |g| {
            g.len() >= 2 && lens(g) == [3, 3, 4] && gap(b, g, 0).starts_with(b")")
        })?
    };
    Some(Finding {
        entity: Entity::Phone,
        range: i..g[k - 1].end,
    })
}

/// An IBAN whose check digits start at `i` after two capital letters: compact
/// ("DE89370400440532013000") or in groups of four ("DE89 3704 0044 0532 0130 00").
fn iban(b: &[u8], i: usize) -> Option<Finding> {
    if i < 2 || !b[i - 2].is_ascii_uppercase() || !b[i - 1].is_ascii_uppercase() {
        return None;
    }
    let start = i - 2;
    if start > 0 && is_word(b[start - 1]) {
        return None;
    }
    let want = iban_length(&b[start..i])?;
    let mut compact = Vec::with_capacity(want);
    compact.extend_from_slice(&b[start..i]);
    let mut j = i;
    while compact.len() < want && j < b.len() {
        let c = b[j];
        if c.is_ascii_digit() || c.is_ascii_uppercase() {
            compact.push(c);
        } else if !(c == b' ' && b.get(j + 1).is_some_and(|n| n.is_ascii_alphanumeric())) {
            break;
        }
        j += 1;
    }
    let ok =
        compact.len() == want && !b.get(j).is_some_and(|&c| is_word(c)) && iban_valid(&compact);
    if ok {
        finding(Entity::Iban, start, j)
    } else {
        None
    }
}

/// An IPv6 address around the `:` at `i`: at least two colons, a digit, word boundaries on
/// both sides, and what std's parser accepts.
pub(super) fn ipv6(b: &[u8], i: usize) -> Option<Finding> {
    let mut s = i;
    while s > 0 && (b[s - 1].is_ascii_hexdigit() || b[s - 1] == b':') && i - s < 40 {
        s -= 1;
    }
    if s > 0 && (is_word(b[s - 1]) || b[s - 1] == b'.') {
        return None;
    }
    let mut e = i;
    while e < b.len() && (b[e].is_ascii_hexdigit() || b[e] == b':' || b[e] == b'.') && e - s < 46 {
        e += 1;
    }
    while e > i && b[e - 1] == b'.' {
        e -= 1;
    }
    if b.get(e).is_some_and(|&c| is_word(c)) {
        return None;
    }
    let tok = &b[s..e];
    let colons = tok.iter().filter(|&&c| c == b':').count();
    if colons < 2 || !tok.iter().any(u8::is_ascii_digit) {
        return None;
    }
    let parsed = std::str::from_utf8(tok)
        .ok()
        .and_then(|t| t.parse::<std::net::Ipv6Addr>().ok());
    parsed.and_then(|_| finding(Entity::Ip, s, e))
}
