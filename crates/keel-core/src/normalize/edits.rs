//! What normalization changed, for the decision record: each change as the text around it
//! before and after, so an operator can see exactly what reached the model differently from
//! what the client sent.
//!
//! Recorded only when a text changed and the caller asked for edits (the gateway does, unless
//! `decision_prompt_edits = false`). Bounded so that a record stays small whatever the prompt:
//! at most [`MAX_EDITS`] edits per request, each side at most [`MAX_SIDE`] characters, with
//! [`CONTEXT`] unchanged characters on each side. Characters that cannot be seen (zero-width
//! and other format characters, exotic spaces, CR, tab) are written as `\u{…}`, `\r`, `\t`, so
//! the difference is visible.
//!
//! The diff is linear in the text: equal stretches are skipped by comparing characters, and
//! only a window of [`WINDOW`] characters from each difference is diffed (Myers, `similar`),
//! up to the first equal run of [`RESYNC`] characters, where the next stretch begins.

use serde::Serialize;
use similar::{capture_diff_slices, Algorithm, DiffOp};

/// Edits kept per request.
pub const MAX_EDITS: usize = 8;
/// Characters of each side of an edit, context included (longer sides are cut with `…`).
pub const MAX_SIDE: usize = 160;
/// Unchanged characters shown before and after a change.
pub const CONTEXT: usize = 12;
/// Characters diffed from the start of a difference.
const WINDOW: usize = 192;
/// Equal characters that end a change: enough for both contexts, so that changes closer than
/// that are one edit and every context shown is text both sides share.
const RESYNC: usize = 2 * CONTEXT + 1;

/// One change to one text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Edit {
    /// Which text: `system`, `messages[2]`, or `messages[2].text[1]` (the second text part).
    pub at: String,
    pub before: String,
    pub after: String,
}

/// The edits of one request (collects nothing unless made with [`Edits::kept`]).
#[derive(Debug, Default, Clone)]
pub struct Edits {
    keep: bool,
    list: Vec<Edit>,
}

impl Edits {
    /// A collector that keeps edits.
    pub fn kept() -> Edits {
        Edits {
            keep: true,
            list: Vec::new(),
        }
    }

    pub fn into_list(self) -> Vec<Edit> {
        self.list
    }

    /// Records how `before` became `after` (the text named by `at()`).
    pub fn record(&mut self, at: impl FnOnce() -> String, before: &str, after: &str) {
        if !self.keep || self.list.len() >= MAX_EDITS || before == after {
            return;
        }
        let at = at();
        let (a, b): (Vec<char>, Vec<char>) = (before.chars().collect(), after.chars().collect());
        let (mut i, mut j) = (0, 0);
        while self.list.len() < MAX_EDITS {
            while i < a.len() && j < b.len() && a[i] == b[j] {
                i += 1;
                j += 1;
            }
            if i == a.len() && j == b.len() {
                break;
            }
            let (wa, wb) = (
                &a[i..(i + WINDOW).min(a.len())],
                &b[j..(j + WINDOW).min(b.len())],
            );
            let (ea, eb) = change_end(wa, wb);
            self.list.push(Edit {
                at: at.clone(),
                before: side(&a, i, ea),
                after: side(&b, j, eb),
            });
            i += ea;
            j += eb;
        }
    }
}

/// Where the change at the start of two windows ends: before the first run of [`RESYNC`]
/// equal characters, else at the windows' ends.
fn change_end(wa: &[char], wb: &[char]) -> (usize, usize) {
    for op in capture_diff_slices(Algorithm::Myers, wa, wb) {
        if let DiffOp::Equal {
            old_index,
            new_index,
            len,
        } = op
        {
            let at_end = old_index + len == wa.len() && new_index + len == wb.len();
            if (old_index > 0 || new_index > 0) && (len >= RESYNC || at_end) {
                return (old_index, new_index);
            }
        }
    }
    (wa.len(), wb.len())
}

/// One side of an edit: the change of `len` characters at `at` with its context, as one visible
/// string cut to [`MAX_SIDE`] characters.
fn side(text: &[char], at: usize, len: usize) -> String {
    let from = at.saturating_sub(CONTEXT);
    let to = (at + len + CONTEXT).min(text.len());
    let mut out = String::new();
    for (n, &c) in text[from..to].iter().enumerate() {
        if n == MAX_SIDE {
            out.push('…');
            break;
        }
        match c {
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push('\n'),
            c if invisible(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// Characters that show as nothing or as a plain space.
fn invisible(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{00A0}' | '\u{00AD}' | '\u{1680}' | '\u{2000}'..='\u{200F}' | '\u{2028}'..='\u{202F}'
            | '\u{205F}'..='\u{206F}' | '\u{3000}' | '\u{FEFF}')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edits(before: &str, after: &str) -> Vec<Edit> {
        let mut e = Edits::kept();
        e.record(|| "messages[0]".into(), before, after);
        e.into_list()
    }

    #[test]
    fn each_change_is_shown_with_its_context_and_invisibles_are_visible() {
        let got = edits(
            "Don\u{2019}t use markdown.\u{200B} Answer in  one line please.",
            "Don't use markdown. Answer in one line please.",
        );
        let pairs: Vec<(&str, &str)> = got
            .iter()
            .map(|e| (e.before.as_str(), e.after.as_str()))
            .collect();
        // Changes closer than two contexts are one edit.
        assert_eq!(
            pairs,
            vec![(
                "Don\u{2019}t use markdown.\\u{200b} Answer in  one line pl",
                "Don't use markdown. Answer in one line pl"
            )]
        );
        assert!(got.iter().all(|e| e.at == "messages[0]"));
    }

    #[test]
    fn crlf_everywhere_stays_bounded() {
        let before = "line\r\n".repeat(10_000);
        let after = "line\n".repeat(10_000);
        let got = edits(&before, &after);
        assert_eq!(got.len(), MAX_EDITS);
        assert!(got[0].before.starts_with("line\\r\nline\\r\n"));
        assert!(got[0].after.starts_with("line\nline\n"));
        // Cut at MAX_SIDE characters of text (the escapes of invisible ones are longer).
        assert!(got.iter().all(|e| e.after.chars().count() == MAX_SIDE + 1
            && e.before.ends_with('…')
            && e.after.ends_with('…')));
    }

    #[test]
    fn an_appended_constraint_is_one_edit_and_nothing_is_kept_unless_asked() {
        let got = edits(
            "List three birds",
            "List three birds\n\nOutput one item per line.",
        );
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].before, " three birds");
        assert_eq!(got[0].after, " three birds\n\nOutput one item per line.");
        let mut off = Edits::default();
        off.record(|| unreachable!("not named when off"), "a", "b");
        assert!(off.into_list().is_empty());
        assert!(edits("same", "same").is_empty());
    }

    #[test]
    fn a_long_change_is_cut() {
        let before = "x".repeat(1000);
        let got = edits(&before, "");
        assert_eq!(got[0].before.chars().count(), MAX_SIDE + 1);
        assert!(got[0].before.ends_with('…'));
    }
}
