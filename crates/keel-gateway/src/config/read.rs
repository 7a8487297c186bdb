//! Reading the spanned TOML tree: typed look-ups that record a problem and carry on instead of
//! stopping, and a [`Table`] that remembers which keys its section asked for, so that whatever
//! is left over is an unknown field (with a suggestion among the keys that were asked for).

use std::cell::RefCell;
use std::collections::HashMap;

use serde_json::{Map, Number, Value};
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::{ConfigIssue, Position};

/// Every problem found so far, each with the byte offset it points at.
pub(super) struct Issues<'a> {
    text: &'a str,
    origin: &'a str,
    found: Vec<(usize, ConfigIssue)>,
}

impl<'a> Issues<'a> {
    pub(super) fn new(text: &'a str, origin: &'a str) -> Self {
        Issues {
            text,
            origin,
            found: Vec::new(),
        }
    }

    /// Records a problem with `field` at byte `offset`.
    pub(super) fn report(&mut self, offset: usize, field: &str, message: impl Into<String>) {
        let issue = ConfigIssue {
            file: self.origin.to_owned(),
            at: Some(position(self.text, offset)),
            field: field.to_owned(),
            message: message.into(),
        };
        self.found.push((offset, issue));
    }

    /// Records that `value` (at `field`) is not what was `expected`.
    pub(super) fn expected(&mut self, value: &Spanned<DeValue<'_>>, field: &str, expected: &str) {
        let got = self.got(value);
        self.report(
            value.span().start,
            field,
            format!("expected {expected}, got {got}"),
        );
    }

    /// Describes a value as written: `string "5000"`, `integer -1`, `a table`.
    pub(super) fn got(&self, value: &Spanned<DeValue<'_>>) -> String {
        let kind = value.get_ref().type_str();
        match value.get_ref() {
            DeValue::Table(_) => "a table".into(),
            DeValue::Array(_) => "an array".into(),
            _ => {
                let written = self
                    .text
                    .get(value.span())
                    .unwrap_or("")
                    .lines()
                    .next()
                    .unwrap_or("");
                let short: String = written.chars().take(40).collect();
                let more = if short.len() < written.len() {
                    "…"
                } else {
                    ""
                };
                format!("{kind} {short}{more}")
            }
        }
    }

    pub(super) fn count(&self) -> usize {
        self.found.len()
    }

    /// The problems in file order, each once.
    pub(super) fn into_sorted(mut self) -> Vec<ConfigIssue> {
        self.found.sort_by_key(|(offset, _)| *offset);
        self.found.dedup();
        self.found.into_iter().map(|(_, issue)| issue).collect()
    }
}

/// Line and column (1-based) of a byte offset.
pub(super) fn position(text: &str, offset: usize) -> Position {
    let offset = offset.min(text.len());
    let before = &text.as_bytes()[..offset];
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map(|i| i + 1)
        .unwrap_or(0);
    let column = String::from_utf8_lossy(&before[line_start..])
        .chars()
        .count()
        + 1;
    Position { line, column }
}

/// The closest of `options` to `got`, if close enough to be a likely typo (case is ignored; at
/// most one edit per three characters, and one for short names).
pub(super) fn did_you_mean<'o>(
    got: &str,
    options: impl IntoIterator<Item = &'o str>,
) -> Option<&'o str> {
    let got = got.to_lowercase();
    options
        .into_iter()
        .map(|o| (strsim::damerau_levenshtein(&got, o), o))
        .filter(|&(d, o)| d <= (o.chars().count() / 3).max(1))
        .min_by_key(|&(d, _)| d)
        .map(|(_, o)| o)
}

/// "`a`", "`a` or `b`", "`a`, `b` or `c`".
pub(super) fn one_of<'o>(options: impl IntoIterator<Item = &'o str>) -> String {
    let quoted: Vec<String> = options.into_iter().map(|o| format!("`{o}`")).collect();
    match quoted.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// A value read from the file, with where it was written.
#[derive(Debug, Clone)]
pub(super) struct Val<T> {
    pub(super) value: T,
    /// Byte offset of the value in the file.
    pub(super) at: usize,
    /// The field's path, e.g. `pools[0].variants[1].url`.
    pub(super) path: String,
}

/// A scalar type a setting can have.
pub(super) trait Kind: Sized {
    /// What a value of this type looks like, for messages.
    const EXPECTED: &'static str;
    fn from_toml(value: &DeValue<'_>) -> Option<Self>;
}

fn integer(value: &DeValue<'_>) -> Option<i128> {
    let i = value.as_integer()?;
    i128::from_str_radix(i.as_str(), i.radix()).ok()
}

impl Kind for u64 {
    const EXPECTED: &'static str = "a non-negative integer";
    fn from_toml(value: &DeValue<'_>) -> Option<Self> {
        integer(value)?.try_into().ok()
    }
}

impl Kind for usize {
    const EXPECTED: &'static str = "a non-negative integer";
    fn from_toml(value: &DeValue<'_>) -> Option<Self> {
        integer(value)?.try_into().ok()
    }
}

impl Kind for u32 {
    const EXPECTED: &'static str = "an integer from 0 to 4294967295";
    fn from_toml(value: &DeValue<'_>) -> Option<Self> {
        integer(value)?.try_into().ok()
    }
}

impl Kind for u8 {
    const EXPECTED: &'static str = "an integer from 0 to 255";
    fn from_toml(value: &DeValue<'_>) -> Option<Self> {
        integer(value)?.try_into().ok()
    }
}

impl Kind for f64 {
    const EXPECTED: &'static str = "a number";
    fn from_toml(value: &DeValue<'_>) -> Option<Self> {
        match value {
            // As serde would: an integer is accepted where a float is expected.
            DeValue::Integer(_) => integer(value).map(|i| i as f64),
            DeValue::Float(f) => f.as_str().parse().ok(),
            _ => None,
        }
    }
}

impl Kind for bool {
    const EXPECTED: &'static str = "true or false";
    fn from_toml(value: &DeValue<'_>) -> Option<Self> {
        value.as_bool()
    }
}

impl Kind for String {
    const EXPECTED: &'static str = "a string";
    fn from_toml(value: &DeValue<'_>) -> Option<Self> {
        value.as_str().map(str::to_owned)
    }
}

/// A key some section's parser asked for, as [`catalog`] records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Asked {
    /// The table's path with array indexes dropped: `pools.variants` for
    /// `pools[0].variants[1]`; empty for the top level.
    pub(crate) table: String,
    pub(crate) key: &'static str,
    /// What the key takes, in the words errors use (`a non-negative integer`, `` `p2c` or
    /// `round_robin` ``); `None` where the parser reads the raw value and checks it itself.
    pub(crate) takes: Option<String>,
}

thread_local! {
    /// While [`catalog`] runs on this thread: every key asked for.
    static ASKED: RefCell<Option<Vec<Asked>>> = const { RefCell::new(None) };
}

/// Every key the parsers ask for while reading `texts` (problems in them are ignored), in the
/// order they were asked. The configuration reference is drawn from this, so it lists exactly
/// the keys keel reads: a new key cannot be read without appearing there.
#[cfg(test)]
pub(crate) fn catalog(texts: &[&str]) -> Vec<Asked> {
    ASKED.with(|a| *a.borrow_mut() = Some(Vec::new()));
    let env = HashMap::new();
    for text in texts {
        let _ = super::Config::parse(text, "catalog", &env);
    }
    ASKED.with(|a| a.borrow_mut().take()).unwrap_or_default()
}

/// `pools[0].variants[1]` → `pools.variants`.
fn without_indexes(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut depth = 0;
    for c in path.chars() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

/// One TOML table of the config, read by one section's parser. Each key the parser asks for is
/// remembered; [`Table::finish`] reports every other key as unknown.
pub(super) struct Table<'t, 'i> {
    path: String,
    at: usize,
    entries: &'t DeTable<'i>,
    asked: Vec<&'static str>,
}

impl<'t, 'i> Table<'t, 'i> {
    /// `path` is empty for the document's root; `at` is where the table starts (its header).
    pub(super) fn new(path: String, at: usize, entries: &'t DeTable<'i>) -> Self {
        Table {
            path,
            at,
            entries,
            asked: Vec::new(),
        }
    }

    pub(super) fn path(&self) -> &str {
        &self.path
    }

    /// Byte offset of the table's header (or first key).
    pub(super) fn at(&self) -> usize {
        self.at
    }

    pub(super) fn field_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// The value of `key` as written, if present.
    pub(super) fn raw(&mut self, key: &'static str) -> Option<&'t Spanned<DeValue<'i>>> {
        self.lookup(key, None)
    }

    /// The value of `key` as written, if present; `takes` says what it may be, for
    /// [`catalog`].
    fn lookup(
        &mut self,
        key: &'static str,
        takes: Option<&dyn Fn() -> String>,
    ) -> Option<&'t Spanned<DeValue<'i>>> {
        self.asked.push(key);
        ASKED.with(|a| {
            if let Some(asked) = a.borrow_mut().as_mut() {
                asked.push(Asked {
                    table: without_indexes(&self.path),
                    key,
                    takes: takes.map(|f| f()),
                });
            }
        });
        self.entries
            .iter()
            .find(|(k, _)| k.get_ref() == key)
            .map(|(_, v)| v)
    }

    /// The value of `key`, if present and of type `T`; a value of another type is reported.
    pub(super) fn get<T: Kind>(
        &mut self,
        key: &'static str,
        issues: &mut Issues,
    ) -> Option<Val<T>> {
        let raw = self.lookup(key, Some(&|| T::EXPECTED.to_owned()))?;
        let path = self.field_path(key);
        match T::from_toml(raw.get_ref()) {
            Some(value) => Some(Val {
                value,
                at: raw.span().start,
                path,
            }),
            None => {
                issues.expected(raw, &path, T::EXPECTED);
                None
            }
        }
    }

    /// Like [`Table::get`], without the position.
    pub(super) fn value<T: Kind>(&mut self, key: &'static str, issues: &mut Issues) -> Option<T> {
        self.get(key, issues).map(|v| v.value)
    }

    /// Like [`Table::get`]; a missing key is reported at the table's header.
    pub(super) fn required<T: Kind>(
        &mut self,
        key: &'static str,
        what: &str,
        issues: &mut Issues,
    ) -> Option<Val<T>> {
        if self.entries.iter().any(|(k, _)| k.get_ref() == key) {
            return self.get(key, issues);
        }
        self.lookup(key, Some(&|| T::EXPECTED.to_owned()));
        issues.report(
            self.at,
            &self.field_path(key),
            format!("missing; expected {what}"),
        );
        None
    }

    /// A string that must be one of `options` (an unknown one gets a suggestion).
    pub(super) fn choice<T: Copy>(
        &mut self,
        key: &'static str,
        options: &[(&'static str, T)],
        issues: &mut Issues,
    ) -> Option<Val<T>> {
        let names = || options.iter().map(|(n, _)| *n);
        let raw = self.lookup(key, Some(&|| one_of(names())))?;
        let path = self.field_path(key);
        let Some(s) = raw.get_ref().as_str() else {
            issues.expected(raw, &path, &one_of(names()));
            return None;
        };
        match options.iter().find(|(n, _)| *n == s) {
            Some(&(_, value)) => Some(Val {
                value,
                at: raw.span().start,
                path,
            }),
            None => {
                let hint = did_you_mean(s, names())
                    .map(|m| format!("; did you mean `{m}`?"))
                    .unwrap_or_default();
                issues.report(
                    raw.span().start,
                    &path,
                    format!("expected {}, got `{s}`{hint}", one_of(names())),
                );
                None
            }
        }
    }

    /// Like [`Table::choice`]; a missing key is reported at the table's header.
    pub(super) fn required_choice<T: Copy>(
        &mut self,
        key: &'static str,
        options: &[(&'static str, T)],
        issues: &mut Issues,
    ) -> Option<Val<T>> {
        if !self.entries.iter().any(|(k, _)| k.get_ref() == key) {
            self.lookup(key, Some(&|| one_of(options.iter().map(|(n, _)| *n))));
            let names = one_of(options.iter().map(|(n, _)| *n));
            issues.report(
                self.at,
                &self.field_path(key),
                format!("missing; expected {names}"),
            );
            return None;
        }
        self.choice(key, options, issues)
    }

    /// A sub-table (`[section]`, `key = { … }` or dotted keys).
    pub(super) fn table(
        &mut self,
        key: &'static str,
        issues: &mut Issues,
    ) -> Option<Table<'t, 'i>> {
        let raw = self.lookup(key, Some(&|| "a table".to_owned()))?;
        let path = self.field_path(key);
        match raw.get_ref() {
            DeValue::Table(t) => Some(Table::new(path, raw.span().start, t)),
            _ => {
                issues.expected(raw, &path, "a table");
                None
            }
        }
    }

    /// An array of tables (`[[key]]`); elements that are not tables are reported and skipped.
    pub(super) fn tables(&mut self, key: &'static str, issues: &mut Issues) -> Vec<Table<'t, 'i>> {
        let Some(raw) = self.lookup(key, Some(&|| "an array of tables".to_owned())) else {
            return Vec::new();
        };
        let path = self.field_path(key);
        let Some(items) = raw.get_ref().as_array() else {
            issues.expected(raw, &path, &format!("an array of tables ([[{path}]])"));
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let item_path = format!("{path}[{i}]");
            match item.get_ref() {
                DeValue::Table(t) => out.push(Table::new(item_path, item.span().start, t)),
                _ => issues.expected(item, &item_path, "a table"),
            }
        }
        out
    }

    /// An array of strings; other elements are reported and skipped.
    pub(super) fn strings(&mut self, key: &'static str, issues: &mut Issues) -> Vec<Val<String>> {
        let Some(raw) = self.lookup(key, Some(&|| "an array of strings".to_owned())) else {
            return Vec::new();
        };
        let path = self.field_path(key);
        let Some(items) = raw.get_ref().as_array() else {
            issues.expected(raw, &path, "an array of strings");
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let item_path = format!("{path}[{i}]");
            match item.get_ref().as_str() {
                Some(s) => out.push(Val {
                    value: s.to_owned(),
                    at: item.span().start,
                    path: item_path,
                }),
                None => issues.expected(item, &item_path, String::EXPECTED),
            }
        }
        out
    }

    /// `key = { name = "value", ... }`: each entry's name and string value (entries that are
    /// not strings are reported and skipped).
    pub(super) fn string_entries(
        &mut self,
        key: &'static str,
        issues: &mut Issues,
    ) -> Vec<(String, Val<String>)> {
        let Some(raw) = self.raw(key) else {
            return Vec::new();
        };
        let path = self.field_path(key);
        let DeValue::Table(t) = raw.get_ref() else {
            issues.expected(raw, &path, "a table of names and strings");
            return Vec::new();
        };
        let mut out = Vec::new();
        for (k, v) in t.iter() {
            let name: &str = k.get_ref();
            let item_path = format!("{path}.{name}");
            match v.get_ref().as_str() {
                Some(s) => out.push((
                    name.to_owned(),
                    Val {
                        value: s.to_owned(),
                        at: v.span().start,
                        path: item_path,
                    },
                )),
                None => issues.expected(v, &item_path, String::EXPECTED),
            }
        }
        out
    }

    /// A table of request fields, as JSON (None when absent or not a table).
    pub(super) fn json_table(
        &mut self,
        key: &'static str,
        issues: &mut Issues,
    ) -> Option<Map<String, Value>> {
        let raw = self.lookup(key, Some(&|| "a table of request fields".to_owned()))?;
        let path = self.field_path(key);
        let DeValue::Table(t) = raw.get_ref() else {
            issues.expected(raw, &path, "a table of request fields");
            return None;
        };
        Some(json_object(t, &path, issues))
    }

    /// Reports every key no parser asked for, with a suggestion when one is close.
    pub(super) fn finish(self, issues: &mut Issues) {
        let mut known: Vec<&str> = self.asked.clone();
        known.sort_unstable();
        known.dedup();
        for (key, _) in self.entries.iter() {
            let name: &str = key.get_ref();
            if known.contains(&name) {
                continue;
            }
            let hint = match did_you_mean(name, known.iter().copied()) {
                Some(m) => format!(", did you mean `{m}`?"),
                None => format!("; expected one of {}", one_of(known.iter().copied())),
            };
            issues.report(
                key.span().start,
                &self.field_path(name),
                format!("unknown field `{name}`{hint}"),
            );
        }
    }
}

fn json_object(t: &DeTable<'_>, path: &str, issues: &mut Issues) -> Map<String, Value> {
    t.iter()
        .map(|(k, v)| {
            let key: &str = k.get_ref();
            (
                key.to_owned(),
                json_value(v, &format!("{path}.{key}"), issues),
            )
        })
        .collect()
}

fn json_value(v: &Spanned<DeValue<'_>>, path: &str, issues: &mut Issues) -> Value {
    match v.get_ref() {
        DeValue::String(s) => Value::String(s.to_string()),
        DeValue::Boolean(b) => Value::Bool(*b),
        DeValue::Integer(_) => match integer(v.get_ref()) {
            Some(i) if i64::try_from(i).is_ok() => Value::from(i as i64),
            Some(i) if u64::try_from(i).is_ok() => Value::from(i as u64),
            _ => {
                issues.expected(v, path, "an integer that fits in 64 bits");
                Value::Null
            }
        },
        // NaN and infinities have no JSON form; serde_json writes them as null too.
        DeValue::Float(_) => f64::from_toml(v.get_ref())
            .and_then(Number::from_f64)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        DeValue::Datetime(d) => Value::String(d.to_string()),
        DeValue::Array(items) => Value::Array(
            items
                .iter()
                .enumerate()
                .map(|(i, item)| json_value(item, &format!("{path}[{i}]"), issues))
                .collect(),
        ),
        DeValue::Table(t) => Value::Object(json_object(t, path, issues)),
    }
}

/// `${VAR}` replaced by the variable's value; a missing variable is reported.
pub(super) fn interpolate(
    s: &Val<String>,
    env: &HashMap<String, String>,
    issues: &mut Issues,
) -> Option<String> {
    match substitute(&s.value, env) {
        Ok(out) => Some(out),
        Err(var) => {
            issues.report(
                s.at,
                &s.path,
                format!("environment variable `{var}` is not set"),
            );
            None
        }
    }
}

/// Replaces `${VAR}` with the variable's value; returns the missing variable's name on error.
fn substitute(s: &str, env: &HashMap<String, String>) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let Some(j) = after.find('}') else {
            out.push_str(&rest[i..]);
            return Ok(out);
        };
        let name = &after[..j];
        out.push_str(env.get(name).ok_or_else(|| name.to_owned())?);
        rest = &after[j + 1..];
    }
    out.push_str(rest);
    Ok(out)
}
