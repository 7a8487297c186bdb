//! The answer direction: values a model emits (a secret, someone's PII) redacted before the
//! client sees them, in a stream with a bounded hold-back.
//!
//! A [`Redactor`] holds back the tail of a stream's text that could still be the start of a
//! value: everything after the last *quiet* space, one that follows a word without digits
//! after a word without digits (built-in values hold no such space: phone numbers, cards and
//! IBANs are digit groups, the rest hold no space at all), at most [`HOLD`] bytes; an
//! unfinished PEM block is held from its `-----BEGIN` until its end, up to [`MAX_HOLD`] bytes.
//! When the policy names an operator pattern (whose matches may hold any space), the last
//! [`HOLD`] bytes are held. Text before the cut is scanned with the held tail as context (a
//! value crossing the cut moves the cut to its start) and sent with the policy applied.

use super::mask::{apply, Counts, Masker};
use super::policy::Policy;
use super::Guard;

/// Bytes of a stream's text held back while an answer policy is on.
pub const HOLD: usize = 256;
/// The most a value may hold back before it is sent redacted as far as it has come.
pub const MAX_HOLD: usize = 64 * 1024;

/// Redacts one stream channel's text.
#[derive(Debug, Default)]
pub struct Redactor {
    held: String,
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl Redactor {
    /// The text that can be sent after `delta`, the policy applied; the rest is held.
    pub fn push(
        &mut self,
        guard: &Guard,
        policy: &Policy,
        delta: &str,
        counts: &mut Counts,
    ) -> String {
        self.held.push_str(delta);
        let mut cut = if custom_in(policy) {
            floor_boundary(&self.held, self.held.len().saturating_sub(HOLD))
        } else {
            quiet_cut(&self.held)
        };
        if self.held.len() <= MAX_HOLD {
            let len = self.held.len();
            for f in guard.scan(&self.held) {
                // A value reaching the end of what arrived may still grow.
                let open = f.range.end > cut || f.range.end == len;
                if f.range.start < cut && open && policy.action(f.entity).is_some() {
                    cut = f.range.start;
                }
            }
        }
        if cut == 0 {
            return String::new();
        }
        let rest = self.held.split_off(cut);
        let ready = std::mem::replace(&mut self.held, rest);
        emit(guard, policy, &ready, counts)
    }

    /// Everything still held, the policy applied (the channel ended).
    pub fn finish(&mut self, guard: &Guard, policy: &Policy, counts: &mut Counts) -> String {
        let rest = std::mem::take(&mut self.held);
        emit(guard, policy, &rest, counts)
    }

    pub fn held(&self) -> usize {
        self.held.len()
    }
}

/// Whether `policy` acts on an operator pattern.
fn custom_in(policy: &Policy) -> bool {
    policy.names_custom()
}

/// Where the sendable text ends: after the last quiet space (see the module doc), never more
/// than [`HOLD`] bytes before the end, never after an unfinished `-----BEGIN`.
fn quiet_cut(s: &str) -> usize {
    let b = s.as_bytes();
    let floor = floor_boundary(s, s.len().saturating_sub(HOLD));
    let mut cut = floor;
    let mut i = b.len();
    while i > floor {
        i -= 1;
        if matches!(b[i], b' ' | b'\n' | b'\t') && quiet(b, i) {
            cut = i + 1;
            break;
        }
    }
    if let Some(begin) = s.rfind("-----BEGIN") {
        if !s[begin..].contains("-----END") && s.len() - begin <= MAX_HOLD {
            cut = cut.min(begin);
        }
    }
    cut
}

/// Whether the space at `i` follows two words without digits (a `)` counts as a digit: the
/// area code of a phone number).
fn quiet(b: &[u8], i: usize) -> bool {
    let mut j = i;
    for _ in 0..2 {
        while j > 0 && b[j - 1].is_ascii_whitespace() {
            j -= 1;
        }
        if j == 0 {
            return true;
        }
        while j > 0 && !b[j - 1].is_ascii_whitespace() {
            if b[j - 1].is_ascii_digit() || b[j - 1] == b')' {
                return false;
            }
            j -= 1;
        }
    }
    true
}

/// `text` with `policy` applied (an answer policy redacts or detects; it never masks).
pub fn emit(guard: &Guard, policy: &Policy, text: &str, counts: &mut Counts) -> String {
    let mut unused = Masker::default();
    apply(guard, policy, text, &mut unused, counts).unwrap_or_else(|| text.to_owned())
}
