//! Operator-defined entity kinds: regex patterns and word lists, validated at load.

use std::fmt;

use aho_corasick::{AhoCorasick, MatchKind};
use regex::Regex;

use super::detect::is_word;
use super::{Entity, Finding};

/// One operator kind as written in config: a name and either a regex or a list of words
/// (matched case-insensitively as whole words).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustomSpec {
    pub name: String,
    pub regex: Option<String>,
    pub words: Vec<String>,
}

/// Why an operator kind was refused; names the kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustomError {
    pub name: String,
    pub reason: String,
}

impl fmt::Display for CustomError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "guard pattern {:?}: {}", self.name, self.reason)
    }
}

impl std::error::Error for CustomError {}

/// Names an operator kind may not take: the built-in entities and the policy's fallback key.
const RESERVED: &[&str] = &["default"];

#[derive(Debug, Clone, Default)]
pub(super) struct Custom {
    names: Vec<String>,
    regexes: Vec<(u16, Regex)>,
    /// All word lists in one automaton; the pattern index maps to its kind.
    words: Option<(AhoCorasick, Vec<u16>)>,
}

impl Custom {
    pub(super) fn compile(specs: &[CustomSpec]) -> Result<Custom, CustomError> {
        let mut c = Custom::default();
        let mut words = Vec::new();
        let mut word_kind = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let err = |reason: String| CustomError {
                name: spec.name.clone(),
                reason,
            };
            check_name(&spec.name, &c.names).map_err(err)?;
            let idx = u16::try_from(i).map_err(|_| err("too many patterns".into()))?;
            match (&spec.regex, spec.words.is_empty()) {
                (Some(_), false) => return Err(err("give `regex` or `words`, not both".into())),
                (None, true) => return Err(err("needs `regex` or a non-empty `words`".into())),
                (Some(re), true) => {
                    let r =
                        Regex::new(re).map_err(|e| err(format!("regex does not compile: {e}")))?;
                    if r.is_match("") {
                        return Err(err("regex matches the empty string".into()));
                    }
                    c.regexes.push((idx, r));
                }
                (None, false) => {
                    for w in &spec.words {
                        if w.trim().is_empty() {
                            return Err(err("a word is empty".into()));
                        }
                        words.push(w.trim().to_string());
                        word_kind.push(idx);
                    }
                }
            }
            c.names.push(spec.name.clone());
        }
        if !words.is_empty() {
            let ac = AhoCorasick::builder()
                .ascii_case_insensitive(true)
                .match_kind(MatchKind::LeftmostLongest)
                .build(&words)
                .map_err(|e| CustomError {
                    name: "words".into(),
                    reason: e.to_string(),
                })?;
            c.words = Some((ac, word_kind));
        }
        Ok(c)
    }

    pub(super) fn name(&self, i: u16) -> &str {
        self.names.get(usize::from(i)).map_or("unknown", |s| s)
    }

    pub(super) fn find(&self, name: &str) -> Option<u16> {
        self.names
            .iter()
            .position(|n| n == name)
            .and_then(|i| u16::try_from(i).ok())
    }

    pub(super) fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    pub(super) fn scan(&self, text: &str, out: &mut Vec<Finding>) {
        for (idx, re) in &self.regexes {
            for m in re.find_iter(text) {
                if !m.is_empty() {
                    out.push(Finding {
                        entity: Entity::Custom(*idx),
                        range: m.range(),
                    });
                }
            }
        }
        let Some((ac, kinds)) = &self.words else {
            return;
        };
        let b = text.as_bytes();
        for m in ac.find_iter(text) {
            let whole = (m.start() == 0 || !is_word(b[m.start() - 1]))
                && !b.get(m.end()).is_some_and(|&c| is_word(c));
            if whole {
                out.push(Finding {
                    entity: Entity::Custom(kinds[m.pattern().as_usize()]),
                    range: m.range(),
                });
            }
        }
    }
}

fn check_name(name: &str, taken: &[String]) -> Result<(), String> {
    let ident = !name.is_empty()
        && name.len() <= 32
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_');
    if !ident {
        return Err("the name must be a lowercase identifier ([a-z][a-z0-9_]*, at most 32)".into());
    }
    if Entity::parse_builtin(name).is_some() || RESERVED.contains(&name) {
        return Err("the name is a built-in entity's".into());
    }
    if taken.iter().any(|t| t == name) {
        return Err("the name is used twice".into());
    }
    Ok(())
}
