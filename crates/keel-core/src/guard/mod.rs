//! PII and secret detection: one pass over a text finds emails, phone numbers, payment cards,
//! IBANs, US social security numbers, IP addresses, URLs carrying credentials, API keys and
//! tokens, plus operator-defined patterns and word lists.
//!
//! **One pass, prefiltered.** [`Guard::scan`] walks the bytes once with a lookup table of the
//! bytes an entity can start at (`@`, `:`, `+`, digits) and one Aho-Corasick pass over the
//! literal prefixes of secrets (`AKIA`, `sk-`, `ghp_`, `xox`, `eyJ`, `-----BEGIN` ...). Only
//! there does a detector look closer; prose without such bytes costs a table lookup per byte.
//! Operator patterns are regexes run over the whole text (the regex crate prefilters on their
//! literals); operator word lists are one case-insensitive Aho-Corasick automaton.
//!
//! **Checksums keep look-alikes out.** Cards must pass Luhn and sit in a known issuer range
//! with a length that issuer uses, IBANs must pass ISO 7064 mod 97 with their country's length,
//! SSNs exclude areas never issued (000, 666, 900-999), group 00 and serial 0000. Order numbers,
//! hex digests and version strings fail these checks.
//!
//! Pure: text in, findings out; the masking of findings and the per-request placeholder map are
//! in [`mask`], policies in [`policy`].

pub mod answer;
pub mod body;
mod custom;
mod detect;
pub mod eval;
pub mod mask;
pub mod policy;
pub mod stream;
mod validate;

use std::fmt;
use std::ops::Range;

pub use custom::{CustomError, CustomSpec};
pub use validate::{iban_valid, luhn_valid, ssn_valid};

/// A kind of sensitive value. Built-in kinds have fixed names; operator kinds carry the index
/// of their pattern or word list in the [`Guard`] that found them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Entity {
    Email,
    Phone,
    Card,
    Iban,
    Ssn,
    Ip,
    UrlCredentials,
    /// Every secret kind: cloud and model API keys, GitHub and Slack tokens, JWTs, PEM private
    /// key blocks.
    Secret,
    /// The operator pattern or word list at this index of the guard's custom list.
    Custom(u16),
}

impl Entity {
    /// The built-in entities, in the order reports list them.
    pub const BUILTIN: [Entity; 8] = [
        Entity::Email,
        Entity::Phone,
        Entity::Card,
        Entity::Iban,
        Entity::Ssn,
        Entity::Ip,
        Entity::UrlCredentials,
        Entity::Secret,
    ];

    /// The config and report name of a built-in entity; `None` for operator kinds (their name
    /// lives in the [`Guard`]: [`Guard::entity_name`]).
    pub fn builtin_name(self) -> Option<&'static str> {
        Some(match self {
            Entity::Email => "email",
            Entity::Phone => "phone",
            Entity::Card => "card",
            Entity::Iban => "iban",
            Entity::Ssn => "ssn",
            Entity::Ip => "ip",
            Entity::UrlCredentials => "url_credentials",
            Entity::Secret => "secret",
            Entity::Custom(_) => return None,
        })
    }

    /// Parses a built-in entity name.
    pub fn parse_builtin(name: &str) -> Option<Entity> {
        Entity::BUILTIN
            .into_iter()
            .find(|e| e.builtin_name() == Some(name))
    }
}

/// One sensitive value: its kind and where it sits in the scanned text (a byte range on char
/// boundaries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub entity: Entity,
    pub range: Range<usize>,
}

/// The detectors, with the operator's patterns and word lists compiled in. Build once at config
/// load; [`Guard::scan`] takes `&self` and is safe to share across threads.
#[derive(Debug, Clone)]
pub struct Guard {
    custom: custom::Custom,
}

impl Default for Guard {
    fn default() -> Self {
        Guard::builtin()
    }
}

impl Guard {
    /// The built-in detectors only.
    pub fn builtin() -> Guard {
        Guard {
            custom: custom::Custom::default(),
        }
    }

    /// The built-in detectors plus operator patterns and word lists. Each spec is validated:
    /// its name must be a new lowercase identifier, its regex must compile and must not match
    /// the empty string, its word list must not be empty; the error names the spec.
    pub fn with_custom(specs: &[CustomSpec]) -> Result<Guard, CustomError> {
        Ok(Guard {
            custom: custom::Custom::compile(specs)?,
        })
    }

    /// The config and report name of an entity found by this guard.
    pub fn entity_name(&self, entity: Entity) -> &str {
        match entity {
            Entity::Custom(i) => self.custom.name(i),
            e => e.builtin_name().unwrap_or("unknown"),
        }
    }

    /// Parses an entity name: a built-in one or one of this guard's operator kinds.
    pub fn parse_entity(&self, name: &str) -> Option<Entity> {
        Entity::parse_builtin(name).or_else(|| self.custom.find(name).map(Entity::Custom))
    }

    /// The operator kinds' names, in index order.
    pub fn custom_names(&self) -> impl Iterator<Item = &str> {
        self.custom.names()
    }

    /// Every sensitive value in `text`, sorted by start, never overlapping (where two detectors
    /// claim overlapping bytes the earlier start wins, then the longer span).
    pub fn scan(&self, text: &str) -> Vec<Finding> {
        let mut out = Vec::new();
        detect::builtin(text, &mut out);
        self.custom.scan(text, &mut out);
        resolve_overlaps(&mut out);
        out
    }
}

/// Sorts by start (longer first on a tie) and drops any finding overlapping a kept one.
fn resolve_overlaps(found: &mut Vec<Finding>) {
    found.sort_by(|a, b| {
        a.range
            .start
            .cmp(&b.range.start)
            .then(b.range.end.cmp(&a.range.end))
    });
    let mut end = 0;
    found.retain(|f| {
        if f.range.start < end {
            return false;
        }
        end = f.range.end;
        true
    });
}

impl fmt::Display for Entity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.builtin_name() {
            Some(n) => f.write_str(n),
            None => match self {
                Entity::Custom(i) => write!(f, "custom#{i}"),
                _ => Ok(()),
            },
        }
    }
}

#[cfg(test)]
mod stream_tests;
#[cfg(test)]
mod tests;
