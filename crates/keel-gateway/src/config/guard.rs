//! `[pools.guard]` and a key's `guard = { ... }`: PII and secret policies (applied by the
//! pipeline's guard).
//!
//! ```toml
//! [pools.guard]
//! request = { default = "mask", secret = "block" }   # entity or "default" -> detect|mask|redact|block
//! answer  = { default = "redact" }                   # detect | redact
//! [[pools.guard.patterns]]
//! name = "ticket"
//! regex = "TCK-[0-9]{6}"
//! [[pools.guard.patterns]]
//! name = "codename"
//! words = ["bluebird", "night owl"]
//! ```
//!
//! Only the operator writes these (the config file); nothing a client sends changes them. A
//! pattern is validated at load (its regex compiles and cannot match the empty string, its name
//! is new); a policy names known entities and actions; each error names the key.

use std::sync::Arc;

use keel_core::guard::policy::{Action, Policy};
use keel_core::guard::{CustomSpec, Guard};

use super::read::{Issues, Table};

/// A pool's guard: its detectors and its two policies.
#[derive(Debug, Clone)]
pub struct PoolGuard {
    pub guard: Guard,
    pub request: Policy,
    pub answer: Policy,
    /// The patterns as written (for equality between configs).
    specs: Vec<CustomSpec>,
}

impl PartialEq for PoolGuard {
    fn eq(&self, other: &Self) -> bool {
        self.specs == other.specs && self.request == other.request && self.answer == other.answer
    }
}

/// A key's own policies, as entity name -> action pairs: resolved against the pool's entities
/// when a request is admitted (an entry naming a pattern the pool lacks does not apply there).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KeyGuard {
    pub request: Vec<(String, Action)>,
    pub answer: Vec<(String, Action)>,
}

impl KeyGuard {
    /// The key's entries as a policy over `guard`'s entities.
    pub fn policy(pairs: &[(String, Action)], guard: &Guard) -> Policy {
        let known = pairs
            .iter()
            .filter(|(e, _)| e == "default" || guard.parse_entity(e).is_some())
            .map(|(e, a)| (e.as_str(), a.name()));
        Policy::parse(guard, known).unwrap_or_default()
    }
}

/// The actions an answer may take: a streamed answer cannot be masked or refused after the
/// fact, only shown or redacted.
const ANSWER_ACTIONS: [Action; 2] = [Action::Detect, Action::Redact];

/// `[pools.guard]`; `None` when absent or wrong (the error is in `issues`).
pub(super) fn read_pool(t: Option<Table>, issues: &mut Issues) -> Option<Arc<PoolGuard>> {
    let mut t = t?;
    let specs = read_patterns(&mut t, issues);
    let guard = match Guard::with_custom(&specs) {
        Ok(g) => g,
        Err(e) => {
            issues.report(t.at(), &t.field_path("patterns"), e.to_string());
            Guard::builtin()
        }
    };
    let request = read_policy(&mut t, "request", &guard, &Action::ALL, issues);
    let answer = read_policy(&mut t, "answer", &guard, &ANSWER_ACTIONS, issues);
    t.finish(issues);
    Some(Arc::new(PoolGuard {
        guard,
        request: request.unwrap_or_default(),
        answer: answer.unwrap_or_default(),
        specs,
    }))
}

/// A key's `guard = { request = {...}, answer = {...} }`: entity names are checked against
/// the built-in ones and `patterns` (every pool's pattern names).
pub(super) fn read_key(
    t: Option<Table>,
    patterns: &[String],
    issues: &mut Issues,
) -> Option<KeyGuard> {
    let mut t = t?;
    let mut names = |key: &'static str, allowed: &[Action], issues: &mut Issues| {
        pairs(&mut t, key, allowed, issues)
            .into_iter()
            .filter_map(|(e, a, at, path)| {
                let known = e == "default"
                    || keel_core::guard::Entity::parse_builtin(&e).is_some()
                    || patterns.contains(&e);
                if !known {
                    issues.report(at, &path, unknown_entity(&e));
                }
                known.then_some((e, a))
            })
            .collect()
    };
    let request = names("request", &Action::ALL, issues);
    let answer = names("answer", &ANSWER_ACTIONS, issues);
    t.finish(issues);
    Some(KeyGuard { request, answer })
}

fn unknown_entity(e: &str) -> String {
    format!("unknown entity `{e}`; expected default, email, phone, card, iban, ssn, ip, url_credentials, secret or a guard pattern's name")
}

/// `key = { entity = "action", ... }` read as (entity, action, position, path); an unknown or
/// disallowed action is reported.
fn pairs(
    t: &mut Table,
    key: &'static str,
    allowed: &[Action],
    issues: &mut Issues,
) -> Vec<(String, Action, usize, String)> {
    let mut out = Vec::new();
    for (entity, value) in t.string_entries(key, issues) {
        let action = Action::parse(&value.value).filter(|a| allowed.contains(a));
        match action {
            Some(a) => out.push((entity, a, value.at, value.path)),
            None => {
                let names: Vec<&str> = allowed.iter().map(|a| a.name()).collect();
                issues.report(
                    value.at,
                    &value.path,
                    format!(
                        "expected {}, got `{}`",
                        super::read::one_of(names),
                        value.value
                    ),
                );
            }
        }
    }
    out
}

fn read_policy(
    t: &mut Table,
    key: &'static str,
    guard: &Guard,
    allowed: &[Action],
    issues: &mut Issues,
) -> Option<Policy> {
    let mut ok = Vec::new();
    for (entity, action, at, path) in pairs(t, key, allowed, issues) {
        if entity != "default" && guard.parse_entity(&entity).is_none() {
            issues.report(at, &path, unknown_entity(&entity));
            continue;
        }
        ok.push((entity, action));
    }
    Policy::parse(guard, ok.iter().map(|(e, a)| (e.as_str(), a.name()))).ok()
}

fn read_patterns(t: &mut Table, issues: &mut Issues) -> Vec<CustomSpec> {
    let mut specs = Vec::new();
    for mut pt in t.tables("patterns", issues) {
        let name = pt.required::<String>("name", "the pattern's entity name (a string)", issues);
        let regex = pt.value::<String>("regex", issues);
        let words: Vec<String> = pt
            .strings("words", issues)
            .into_iter()
            .map(|w| w.value)
            .collect();
        let at = pt.at();
        let path = pt.path().to_owned();
        pt.finish(issues);
        let Some(name) = name else { continue };
        let spec = CustomSpec {
            name: name.value,
            regex,
            words,
        };
        // Each pattern alone first, so the error points at its table.
        match Guard::with_custom(std::slice::from_ref(&spec)) {
            Ok(_) => specs.push(spec),
            Err(e) => issues.report(at, &path, e.to_string()),
        }
    }
    specs
}

/// Every pool's pattern names (a key's guard may name any of them).
pub(super) fn pattern_names(pools: &[super::PoolConfig]) -> Vec<String> {
    pools
        .iter()
        .filter_map(|p| p.guard.as_ref())
        .flat_map(|g| {
            g.guard
                .custom_names()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}
