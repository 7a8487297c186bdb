//! The built-in detectors and the one pass that drives them.

mod contact;
pub(super) mod numbers;
mod secrets;

use super::{Entity, Finding};

/// Bytes where a built-in detector may start looking: `@` (emails, URL credentials), `:`
/// (IPv6), `+` (international phone numbers) and digits (phones, cards, IBANs, SSNs, IPv4).
const TRIGGER: [bool; 256] = {
    let mut t = [false; 256];
    t[b'@' as usize] = true;
    t[b':' as usize] = true;
    t[b'+' as usize] = true;
    t[b'(' as usize] = true;
    let mut d = b'0';
    while d <= b'9' {
        t[d as usize] = true;
        d += 1;
    }
    t
};

/// Whether `b` continues a word: ASCII letters, digits and `_`. Bytes of non-ASCII characters
/// do not, so a value written right after a CJK character still has a boundary.
pub(super) fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Runs every built-in detector over `text`, appending findings (possibly overlapping; the
/// caller resolves overlaps).
pub(super) fn builtin(text: &str, out: &mut Vec<Finding>) {
    let b = text.as_bytes();
    secrets::scan(b, out);
    let mut i = 0;
    // Everything before `covered` belongs to a finding already; detectors do not restart there.
    let mut covered = 0;
    while i < b.len() {
        let Some(off) = b[i..].iter().position(|&c| TRIGGER[c as usize]) else {
            break;
        };
        i += off;
        let hit = if i < covered { None } else { at(b, i) };
        match hit {
            Some(f) => {
                covered = f.range.end;
                i = f.range.end.max(i + 1);
                out.push(f);
            }
            None => i = skip_run(b, i),
        }
    }
}

/// The detectors for the trigger byte at `i`.
fn at(b: &[u8], i: usize) -> Option<Finding> {
    match b[i] {
        b'@' => contact::at_sign(b, i),
        b':' => numbers::ipv6(b, i),
        b'+' | b'(' => numbers::phone_lead(b, i),
        _ => numbers::digits(b, i),
    }
}

/// Where to look next after a trigger byte at `i` found nothing: past a run of digits (only its
/// start can begin a value), else the next byte.
fn skip_run(b: &[u8], i: usize) -> usize {
    if b[i].is_ascii_digit() {
        let mut j = i + 1;
        while j < b.len() && b[j].is_ascii_digit() {
            j += 1;
        }
        j
    } else {
        i + 1
    }
}

pub(super) fn finding(entity: Entity, start: usize, end: usize) -> Option<Finding> {
    Some(Finding {
        entity,
        range: start..end,
    })
}
