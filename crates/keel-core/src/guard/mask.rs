//! Applying a policy to texts, and undoing `mask` in answers.
//!
//! A [`Masker`] lives for one request. `mask` replaces each value with a placeholder such as
//! `<EMAIL_1>`, the same value getting the same placeholder everywhere in the request; the
//! value-to-placeholder map stays in the `Masker` (request memory) and is never serialized.
//! `redact` writes `[REDACTED_EMAIL]`, which nothing restores. `detect` and `block` leave the
//! text as it is and only count.
//!
//! [`Restorer`] puts values back into a streamed answer: it holds back a tail that could still
//! grow into a placeholder (at most the longest placeholder issued, minus one byte), so a
//! placeholder split across deltas is never emitted half-restored.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use super::policy::{Action, Policy};
use super::Guard;

/// Findings per (action, entity name), in a stable order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts(BTreeMap<(Action, String), u32>);

impl Counts {
    pub fn add(&mut self, action: Action, entity: &str, n: u32) {
        *self.0.entry((action, entity.to_string())).or_default() += n;
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn merge(&mut self, other: &Counts) {
        for ((a, e), n) in &other.0 {
            self.add(*a, e, *n);
        }
    }

    /// `(action, entity, count)` in action then entity order.
    pub fn iter(&self) -> impl Iterator<Item = (Action, &str, u32)> {
        self.0.iter().map(|((a, e), n)| (*a, e.as_str(), *n))
    }

    /// The entities an action applied to, with counts: `email:2,card:1`.
    pub fn of(&self, action: Action) -> Vec<(&str, u32)> {
        self.iter()
            .filter(|(a, _, _)| *a == action)
            .map(|(_, e, n)| (e, n))
            .collect()
    }

    /// The `x-keel-guard` header value: `masked=card:1,email:2;detected=ip:1` (types and
    /// counts only, never values). Empty when nothing was found.
    pub fn header(&self) -> String {
        let mut out = String::new();
        for a in Action::ALL {
            let of = self.of(a);
            if of.is_empty() {
                continue;
            }
            if !out.is_empty() {
                out.push(';');
            }
            let _ = write!(out, "{}=", a.done());
            for (k, (e, n)) in of.iter().enumerate() {
                let sep = if k == 0 { "" } else { "," };
                let _ = write!(out, "{sep}{e}:{n}");
            }
        }
        out
    }
}

/// One request's placeholder map.
#[derive(Debug, Default)]
pub struct Masker {
    /// (value, placeholder), in issue order.
    pairs: Vec<(String, String)>,
    /// Index into `pairs` by value and by placeholder (a request may carry many values).
    by_value: HashMap<String, usize>,
    by_placeholder: HashMap<String, usize>,
    /// Placeholders issued per entity name, for numbering.
    issued: BTreeMap<String, u32>,
    longest: usize,
}

fn tag(entity: &str) -> String {
    entity.to_ascii_uppercase()
}

impl Masker {
    /// The placeholder for `value` of `entity`: the one issued before for the same value, else
    /// a new `<ENTITY_n>`.
    fn placeholder(&mut self, entity: &str, value: &str) -> &str {
        if let Some(&i) = self.by_value.get(value) {
            return &self.pairs[i].1;
        }
        let n = self.issued.entry(entity.to_string()).or_default();
        *n += 1;
        let p = format!("<{}_{}>", tag(entity), n);
        self.longest = self.longest.max(p.len());
        let i = self.pairs.len();
        self.by_value.insert(value.to_string(), i);
        self.by_placeholder.insert(p.clone(), i);
        self.pairs.push((value.to_string(), p));
        &self.pairs[i].1
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// The length in bytes of the longest placeholder issued.
    pub fn longest(&self) -> usize {
        self.longest
    }

    /// The value a placeholder stands for.
    pub fn value_of(&self, placeholder: &str) -> Option<&str> {
        self.by_placeholder
            .get(placeholder)
            .map(|&i| self.pairs[i].0.as_str())
    }

    /// `text` with every issued placeholder replaced by its value.
    pub fn restore<'a>(&self, text: &'a str) -> Cow<'a, str> {
        self.restore_with(text, |out, v| out.push_str(v))
    }

    /// [`Masker::restore`] inside JSON text (a whole answer's body, an event's data): each value
    /// is written JSON-escaped, as the placeholder stood inside a JSON string.
    pub fn restore_json<'a>(&self, text: &'a str) -> Cow<'a, str> {
        self.restore_with(text, |out, v| {
            let quoted = serde_json::Value::from(v).to_string();
            out.push_str(&quoted[1..quoted.len() - 1]);
        })
    }

    fn restore_with<'a>(&self, text: &'a str, put: impl Fn(&mut String, &str)) -> Cow<'a, str> {
        if self.pairs.is_empty() || !text.contains('<') {
            return Cow::Borrowed(text);
        }
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(lt) = rest.find('<') {
            out.push_str(&rest[..lt]);
            let tail = &rest[lt..];
            let hit = tail
                .find('>')
                .filter(|&gt| gt < self.longest)
                .and_then(|gt| self.value_of(&tail[..=gt]).map(|v| (v, gt)));
            match hit {
                Some((v, gt)) => {
                    put(&mut out, v);
                    rest = &tail[gt + 1..];
                }
                None => {
                    out.push('<');
                    rest = &tail[1..];
                }
            }
        }
        out.push_str(rest);
        Cow::Owned(out)
    }

    /// `text` with every issued value replaced by its placeholder (the masked form of text the
    /// client already received, e.g. a partial answer carried into a continuation).
    pub fn remask<'a>(&self, text: &'a str) -> Cow<'a, str> {
        let mut out = Cow::Borrowed(text);
        for (v, p) in &self.pairs {
            if out.contains(v.as_str()) {
                out = Cow::Owned(out.replace(v.as_str(), p));
            }
        }
        out
    }
}

/// Scans `text` and applies `policy`: returns the new text when `mask` or `redact` changed it,
/// and adds every finding the policy acts on to `counts`.
pub fn apply(
    guard: &Guard,
    policy: &Policy,
    text: &str,
    masker: &mut Masker,
    counts: &mut Counts,
) -> Option<String> {
    if policy.is_empty() {
        return None;
    }
    let findings = guard.scan(text);
    let mut out: Option<String> = None;
    let mut last = 0;
    for f in findings {
        let Some(action) = policy.action(f.entity) else {
            continue;
        };
        let name = guard.entity_name(f.entity);
        counts.add(action, name, 1);
        let replacement = match action {
            Action::Detect | Action::Block => continue,
            Action::Mask => masker.placeholder(name, &text[f.range.clone()]).to_string(),
            Action::Redact => format!("[REDACTED_{}]", tag(name)),
        };
        let o = out.get_or_insert_with(|| String::with_capacity(text.len()));
        o.push_str(&text[last..f.range.start]);
        o.push_str(&replacement);
        last = f.range.end;
    }
    out.map(|mut o| {
        o.push_str(&text[last..]);
        o
    })
}

/// Restores placeholders in a stream of text deltas, holding back only a tail that may be the
/// start of a placeholder.
#[derive(Debug, Default)]
pub struct Restorer {
    held: String,
    /// The deltas are JSON text (tool-call arguments): values are written JSON-escaped.
    json: bool,
}

impl Restorer {
    /// A restorer for deltas of JSON text (streamed tool-call arguments).
    pub fn json() -> Restorer {
        Restorer {
            held: String::new(),
            json: true,
        }
    }

    fn restore(&self, masker: &Masker, s: &str) -> String {
        if self.json {
            masker.restore_json(s).into_owned()
        } else {
            masker.restore(s).into_owned()
        }
    }

    /// The restored text that can be emitted after `delta`; the rest is held.
    pub fn push(&mut self, masker: &Masker, delta: &str) -> String {
        if masker.is_empty() {
            return delta.to_string();
        }
        self.held.push_str(delta);
        let cut = hold_from(masker, &self.held);
        let ready: String = self.held.drain(..cut).collect();
        self.restore(masker, &ready)
    }

    /// Whatever is still held, restored (the stream ended).
    pub fn finish(&mut self, masker: &Masker) -> String {
        let rest = std::mem::take(&mut self.held);
        self.restore(masker, &rest)
    }

    /// Bytes held back now.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

/// Where the held-back tail starts: at the last `<` whose tail is shorter than the longest
/// placeholder, has no `>` and could still become a placeholder; `s.len()` when none.
fn hold_from(masker: &Masker, s: &str) -> usize {
    let Some(lt) = s.rfind('<') else {
        return s.len();
    };
    let tail = &s[lt..];
    let could_be = tail.len() < masker.longest()
        && !tail.contains('>')
        && tail[1..]
            .bytes()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == b'_');
    if could_be {
        lt
    } else {
        s.len()
    }
}
