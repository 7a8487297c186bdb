//! Prompt templates: the prompt with its variable spans replaced, mined into groups the way log
//! parsers group log lines (Drain: He et al., ICWS 2017), so that "Summarize order 123 for
//! Alice" and "Summarize order 456 for Bob" share one template and one stable 64-bit id.
//!
//! **Masking.** The text is cut into whitespace-separated tokens; a token is a variable (`<*>`)
//! when it holds a digit (numbers, dates, versions, most identifiers and UUIDs), is long
//! ([`LONG_TOKEN`] characters: hashes, base64, unique words), holds `@` or `://` (addresses,
//! URLs) or is hexadecimal of 8 or more characters; a quoted span (`"…"`, `“…”`, `` `…` `` and
//! fenced code blocks) is one variable whatever its length.
//!
//! **Mining.** Prompts are grouped by token count and their first [`PREFIX_DEPTH`] tokens (a
//! variable token goes down the `<*>` branch); within a group, a prompt joins the template it
//! is most similar to (the share of the template's constant tokens it repeats at the same
//! position) when that share reaches [`SIMILARITY`], and the positions where they differ
//! become variables; otherwise it starts a template of its own. A template's id is the stable
//! hash of its token sequence, variables included, so the same traffic gets the same ids in
//! every process; a template's first member may get the id of the still-specific template
//! before a second member generalizes it.
//!
//! **No text is kept**: tokens are held as 64-bit hashes, and the miner is bounded (at most
//! [`MAX_TOKENS`] tokens of a prompt are read, at most `max_templates` templates are kept; past
//! that bound a new prompt's id is the hash of its masked tokens, unmerged).

use std::collections::HashMap;

use crate::rng::hash_bytes;

/// How many leading tokens choose a prompt's group (after its token count).
pub const PREFIX_DEPTH: usize = 2;
/// The share of a template's constant tokens a prompt must repeat to join it.
pub const SIMILARITY: f64 = 0.5;
/// A token this long (in characters) is taken for a unique value.
pub const LONG_TOKEN: usize = 24;
/// Tokens read from one prompt: the template is the prompt's head.
pub const MAX_TOKENS: usize = 160;
/// A quoted span longer than this (bytes) is not taken for one value.
const MAX_QUOTE: usize = 4096;

/// A masked token: a variable, or a constant's hash.
const WILD: u64 = 0;

/// The masked tokens of a prompt (at most [`MAX_TOKENS`]).
pub fn mask(text: &str) -> Vec<u64> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() && out.len() < MAX_TOKENS {
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if let Some(end) = quoted_end(text, i) {
            out.push(WILD);
            i = end;
            continue;
        }
        let start = i;
        while i < bytes.len() && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        out.push(token(&text[start..i]));
    }
    out
}

/// Where a quoted span starting at `i` ends (just past its closer), when `i` opens one whose
/// closer is near.
fn quoted_end(text: &str, i: usize) -> Option<usize> {
    let rest = &text[i..];
    let (open, close) = if rest.starts_with("```") {
        ("```", "```")
    } else if rest.starts_with('"') {
        ("\"", "\"")
    } else if rest.starts_with('\u{201c}') {
        ("\u{201c}", "\u{201d}")
    } else if rest.starts_with('`') {
        ("`", "`")
    } else {
        return None;
    };
    let body = &rest[open.len()..];
    let window = &body[..floor_boundary(body, MAX_QUOTE)];
    let at = window.find(close)?;
    let mut end = i + open.len() + at + close.len();
    // Punctuation glued to the closer belongs to the span (`"x",` `"x".`).
    let b = text.as_bytes();
    while end < b.len() && !b[end].is_ascii_whitespace() && b[end].is_ascii_punctuation() {
        end += 1;
    }
    Some(end)
}

/// The largest char boundary of `s` at or below `n`.
fn floor_boundary(s: &str, n: usize) -> usize {
    if n >= s.len() {
        return s.len();
    }
    let mut n = n;
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    n
}

/// One token: [`WILD`] when it looks like a value, else its hash (never 0).
fn token(t: &str) -> u64 {
    let variable = t.bytes().any(|b| b.is_ascii_digit())
        || t.chars().count() >= LONG_TOKEN
        || t.contains('@')
        || t.contains("://")
        || (t.len() >= 8 && t.bytes().all(|b| b.is_ascii_hexdigit()));
    if variable {
        WILD
    } else {
        hash_bytes(0x7e4a, t.as_bytes()).max(1)
    }
}

/// The stable id of a masked token sequence.
pub fn id_of(tokens: &[u64]) -> u64 {
    let mut bytes = Vec::with_capacity(tokens.len() * 8 + 8);
    bytes.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    hash_bytes(0x7e4b, &bytes)
}

/// One mined template.
#[derive(Debug, Clone)]
struct Template {
    tokens: Vec<u64>,
    id: u64,
}

impl Template {
    /// The share of this template's constant tokens that `t` repeats at the same position.
    fn similarity(&self, t: &[u64]) -> f64 {
        let (mut constant, mut same) = (0usize, 0usize);
        for (a, b) in self.tokens.iter().zip(t) {
            if *a != WILD {
                constant += 1;
                same += usize::from(a == b);
            }
        }
        if constant == 0 {
            1.0
        } else {
            same as f64 / constant as f64
        }
    }

    /// Makes every position where `t` differs a variable.
    fn absorb(&mut self, t: &[u64]) {
        let mut changed = false;
        for (a, b) in self.tokens.iter_mut().zip(t) {
            if *a != *b && *a != WILD {
                *a = WILD;
                changed = true;
            }
        }
        if changed {
            self.id = id_of(&self.tokens);
        }
    }
}

/// The template miner (see the module doc).
#[derive(Debug, Clone)]
pub struct Miner {
    groups: HashMap<u64, Vec<Template>>,
    templates: usize,
    max_templates: usize,
}

impl Default for Miner {
    fn default() -> Self {
        Miner::new(4096)
    }
}

impl Miner {
    /// A miner that keeps at most `max_templates` templates.
    pub fn new(max_templates: usize) -> Miner {
        Miner {
            groups: HashMap::new(),
            templates: 0,
            max_templates,
        }
    }

    /// Templates kept.
    pub fn len(&self) -> usize {
        self.templates
    }

    pub fn is_empty(&self) -> bool {
        self.templates == 0
    }

    /// The template id of a prompt's text, learning from it.
    pub fn observe(&mut self, text: &str) -> u64 {
        self.observe_tokens(&mask(text))
    }

    /// The template id of masked tokens, learning from them.
    pub fn observe_tokens(&mut self, tokens: &[u64]) -> u64 {
        let mut key = vec![tokens.len() as u64];
        key.extend(tokens.iter().take(PREFIX_DEPTH));
        let group = id_of(&key);
        let full = self.templates >= self.max_templates;
        let list = self.groups.entry(group).or_default();
        let best = list
            .iter_mut()
            .map(|t| (t.similarity(tokens), t))
            .filter(|(s, _)| *s >= SIMILARITY)
            .max_by(|a, b| a.0.total_cmp(&b.0));
        if let Some((_, t)) = best {
            t.absorb(tokens);
            return t.id;
        }
        let id = id_of(tokens);
        if !full {
            list.push(Template {
                tokens: tokens.to_vec(),
                id,
            });
            self.templates += 1;
        }
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn values_are_masked() {
        let a = mask("Summarize order 123 placed 2024-05-01 by \"Jane Doe\", id 9f8e7d6c-aaaa");
        let b = mask("Summarize order 98 placed 2025-12-31 by \"Max\", id 0b1c2d3e-bbbb");
        assert_eq!(a, b);
        assert_eq!(a.iter().filter(|t| **t == WILD).count(), 4);
        assert_ne!(mask("Summarize order 1"), mask("Translate order 1"));
        // Long unique tokens, URLs, addresses, hex.
        assert_eq!(
            mask("see https://x.example/a and a@b.c deadbeefcafe"),
            mask("see http://y/b and z@q.r 0123abcdef12")
        );
        // An unclosed quote is an ordinary character.
        assert_eq!(mask("say \"hi").len(), 2);
    }

    #[test]
    fn names_merge_by_similarity_and_ids_are_stable() {
        let mut m = Miner::default();
        let first = m.observe("Write a haiku about Alice and her cat");
        let second = m.observe("Write a haiku about Bob and her cat");
        assert_ne!(first, second, "the second member generalizes the template");
        let third = m.observe("Write a haiku about Carol and her cat");
        assert_eq!(second, third);
        // Another process sees the same traffic: same ids.
        let mut other = Miner::default();
        other.observe("Write a haiku about Dan and her cat");
        assert_eq!(other.observe("Write a haiku about Eve and her cat"), third);
        // A different template of the same shape stays apart.
        assert_ne!(
            m.observe("Explain quantum tunnelling to a small child now"),
            third
        );
    }

    #[test]
    fn the_miner_is_bounded() {
        let mut m = Miner::new(3);
        for w in ["alpha", "beta", "gamma", "delta", "epsilon"] {
            m.observe(&format!("{w} {w} {w}"));
        }
        assert_eq!(m.len(), 3);
        let long = "word ".repeat(10_000);
        assert_eq!(mask(&long).len(), MAX_TOKENS);
    }

    /// Labelled prompts: each template's variables drawn at random.
    fn labelled(n: usize, seed: u64) -> Vec<(usize, String)> {
        let names = [
            "Alice", "Bob", "Carol", "Dmitri", "Esme", "Farid", "Grace", "Hiro",
        ];
        let cities = ["Paris", "Lagos", "Lima", "Osaka", "Quito", "Oslo"];
        let langs = ["French", "German", "Spanish", "Japanese"];
        let mut rng = Rng::new(seed);
        let mut pick = |xs: &[&'static str]| xs[(rng.next_u64() % xs.len() as u64) as usize];
        let mut out = Vec::with_capacity(n);
        let mut r = Rng::new(seed ^ 1);
        for i in 0..n {
            let t = (r.next_u64() % 10) as usize;
            let num = r.next_u64() % 100_000;
            let text = match t {
                0 => format!("Summarize order {num} for customer {}.", pick(&names)),
                1 => format!("Translate the following text into {}: \"hello number {num}\"", pick(&langs)),
                2 => format!("What is the weather in {} on 2026-0{}-1{}?", pick(&cities), num % 9 + 1, num % 10),
                3 => format!("system: You are a support agent.\nuser: My ticket {num} about the router is still open, {} says hi", pick(&names)),
                4 => format!("Classify the sentiment of review #{num}: `the product was {} and arrived late`", pick(&cities)),
                5 => format!("Write a short poem about {} in the style of {}", pick(&cities), pick(&names)),
                6 => format!("Extract the invoice total from document {:x}{:x} and return JSON", num + 0x1000_0000, i),
                7 => format!("user: Hi {}, can you reset the password for account {num}?", pick(&names)),
                8 => format!("Give me three facts about {} and keep it brief please", pick(&cities)),
                _ => format!("Draft an email to {} declining the meeting on Tuesday at {num}", pick(&names)),
            };
            out.push((t, text));
        }
        out
    }

    /// The share of prompts assigned to their true template: a prompt counts when its id is the
    /// one its template's prompts got most often, and that id belongs to no other template.
    fn accuracy(assigned: &[(usize, u64)]) -> f64 {
        let mut by_true: HashMap<usize, HashMap<u64, usize>> = HashMap::new();
        for (t, id) in assigned {
            *by_true.entry(*t).or_default().entry(*id).or_default() += 1;
        }
        let dominant: HashMap<usize, u64> = by_true
            .iter()
            .map(|(t, ids)| {
                (
                    *t,
                    *ids.iter()
                        .max_by_key(|(_, n)| **n)
                        .map(|(id, _)| id)
                        .unwrap(),
                )
            })
            .collect();
        let mut owners: HashMap<u64, usize> = HashMap::new();
        for id in dominant.values() {
            *owners.entry(*id).or_default() += 1;
        }
        let right = assigned
            .iter()
            .filter(|(t, id)| dominant[t] == *id && owners[id] == 1)
            .count();
        right as f64 / assigned.len() as f64
    }

    #[test]
    fn labelled_prompts_land_in_their_true_template() {
        for seed in [1, 2, 3] {
            let set = labelled(2000, seed);
            let mut m = Miner::default();
            let assigned: Vec<(usize, u64)> =
                set.iter().map(|(t, text)| (*t, m.observe(text))).collect();
            let acc = accuracy(&assigned);
            println!("template accuracy, seed {seed}: {acc:.4}");
            assert!(
                acc >= 0.95,
                "seed {seed}: {acc:.3} assigned to their template"
            );
        }
    }

    #[test]
    fn the_accuracy_measure_punishes_merges_and_splits() {
        // Two templates merged into one id: neither owns it alone.
        assert_eq!(accuracy(&[(0, 1), (1, 1)]), 0.0);
        // One template split over many ids: only the dominant one counts.
        assert_eq!(accuracy(&[(0, 1), (0, 1), (0, 2), (0, 3)]), 0.5);
    }
}
