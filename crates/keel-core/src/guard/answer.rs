//! The answer direction: values a model emits (a secret, someone's PII) redacted before the
//! client sees them, in a stream with a bounded hold-back.
//!
//! A [`Redactor`] keeps the last [`HOLD`] bytes of a stream's text unsent, so that a value
//! still arriving is seen whole before anything of it leaves; text before that is scanned
//! (with the held tail as context, so a value crossing the line is seen whole too) and sent
//! with the policy applied. A value longer than the hold (a PEM key block) is held until it is
//! complete, up to [`MAX_HOLD`] bytes.

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
        if self.held.len() <= HOLD {
            return String::new();
        }
        let mut cut = floor_boundary(&self.held, self.held.len() - HOLD);
        if self.held.len() <= MAX_HOLD {
            for f in guard.scan(&self.held) {
                if f.range.start < cut && f.range.end > cut && policy.action(f.entity).is_some() {
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

/// `text` with `policy` applied (an answer policy redacts or detects; it never masks).
pub fn emit(guard: &Guard, policy: &Policy, text: &str, counts: &mut Counts) -> String {
    let mut unused = Masker::default();
    apply(guard, policy, text, &mut unused, counts).unwrap_or_else(|| text.to_owned())
}
