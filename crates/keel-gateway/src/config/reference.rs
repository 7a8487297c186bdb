//! The configuration reference (`docs/src/reference.md`), drawn from two sources that cannot
//! drift apart unnoticed: the keys keel's parsers actually ask for ([`read::catalog`], with what
//! each takes, in the words its errors use) and the annotated examples in the documentation,
//! whose trailing comments say what each key means. A key the parsers read that no example
//! explains is an error, named; so is a reference file that differs from what this draws (the
//! test command checks both).

use std::collections::{HashMap, HashSet};

use super::read::{self, Asked};

/// A key as an example in the documentation writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Example {
    value: String,
    meaning: String,
}

/// Every ```` ```toml ```` block of a Markdown text.
pub(crate) fn toml_blocks(markdown: &str) -> Vec<&str> {
    let mut blocks = Vec::new();
    let mut rest = markdown;
    while let Some(at) = rest.find("```toml\n") {
        let body = &rest[at + 8..];
        let Some(end) = body.find("\n```") else { break };
        blocks.push(&body[..end + 1]);
        rest = &body[end + 4..];
    }
    blocks
}

/// `key = value  # meaning` (or the same behind a leading `#`, for a key shown commented out),
/// with the comment lines that continue it at the same indentation.
fn examples(block: &str, into: &mut HashMap<(String, String), Example>) {
    let mut table = String::new();
    let mut last: Option<(String, String)> = None;
    for line in block.lines() {
        let trimmed = line.trim_start();
        if let Some(header) = table_header(trimmed) {
            table = header;
            last = comment_at(line).map(|_| (table.clone(), String::new()));
            continue;
        }
        if let Some((key, value, comment)) = assignment(trimmed) {
            let entry = (table.clone(), key.to_owned());
            let text = comment.map(|c| &trimmed[c..]);
            let meaning = text.map(|t| t.trim_start_matches('#').trim().to_owned());
            // `#   more` (indented past the `#`) also continues the meaning above, as a comment
            // line would.
            if let (Some(text), Some(previous)) = (text, &last) {
                if text.starts_with("#  ") && previous != &entry {
                    if let Some(known) = into.get_mut(previous) {
                        known.meaning.push(' ');
                        known.meaning.push_str(text.trim_start_matches('#').trim());
                    }
                }
            }
            let known = into.entry(entry.clone()).or_insert(Example {
                value: value.to_owned(),
                meaning: String::new(),
            });
            if known.meaning.is_empty() {
                known.meaning = meaning.unwrap_or_default();
                last = comment.map(|_| entry);
            } else {
                last = None;
            }
            continue;
        }
        // A comment line indented into the comment column continues the key's meaning.
        match (&last, trimmed.starts_with('#')) {
            (Some(entry), true) if line.len() - trimmed.len() >= CONTINUED => {
                let more = trimmed.trim_start_matches('#').trim();
                if let Some(known) = into.get_mut(entry) {
                    if !known.meaning.is_empty() {
                        known.meaning.push(' ');
                    }
                    known.meaning.push_str(more);
                }
            }
            _ => last = None,
        }
    }
}

/// The least indentation of a comment line that continues the meaning above it (the examples
/// align their comments in a column well to the right).
const CONTINUED: usize = 8;

/// `[a.b]` or `[[a.b]]` (a trailing comment allowed) → `a.b`.
fn table_header(line: &str) -> Option<String> {
    let line = line.strip_prefix('[')?;
    let line = line.strip_prefix('[').unwrap_or(line);
    let end = line.find(']')?;
    let name = &line[..end];
    name.chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        .then(|| name.to_owned())
}

/// The byte column of a line's trailing `#` comment, outside strings.
fn comment_at(line: &str) -> Option<usize> {
    let mut quoted = false;
    for (i, c) in line.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '#' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// `key = value # comment`, or `# key = value # comment`: the key, the value as written, and
/// the comment's byte column in `line`.
fn assignment(line: &str) -> Option<(&str, &str, Option<usize>)> {
    let (body, offset) = match line.strip_prefix('#') {
        Some(rest) => {
            let rest_trimmed = rest.trim_start();
            (rest_trimmed, line.len() - rest_trimmed.len())
        }
        None => (line, 0),
    };
    let eq = body.find('=')?;
    let key = body[..eq].trim();
    if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return None;
    }
    let after = &body[eq + 1..];
    let comment = comment_at(after).map(|c| offset + eq + 1 + c);
    let value = match comment {
        Some(c) => &line[offset + eq + 1..c],
        None => after,
    };
    Some((key, value.trim(), comment))
}

/// A table's keys in the order first asked, each once, with what it takes.
struct Section {
    name: String,
    array: bool,
    keys: Vec<(&'static str, Option<String>)>,
}

fn sections(asked: &[Asked]) -> Vec<Section> {
    let arrays: HashSet<String> = asked
        .iter()
        .filter(|a| a.takes.as_deref() == Some("an array of tables"))
        .map(|a| join(&a.table, a.key))
        .collect();
    let mut out: Vec<Section> = Vec::new();
    for a in asked {
        let at = match out.iter().position(|s| s.name == a.table) {
            Some(i) => i,
            None => {
                out.push(Section {
                    name: a.table.clone(),
                    array: arrays.contains(&a.table),
                    keys: Vec::new(),
                });
                out.len() - 1
            }
        };
        let keys = &mut out[at].keys;
        match keys.iter_mut().find(|(k, _)| *k == a.key) {
            Some((_, takes)) if takes.is_none() => takes.clone_from(&a.takes),
            Some(_) => {}
            None => keys.push((a.key, a.takes.clone())),
        }
    }
    out
}

fn join(table: &str, key: &str) -> String {
    if table.is_empty() {
        key.to_owned()
    } else {
        format!("{table}.{key}")
    }
}

/// The reference in Markdown, from the documentation's Markdown texts; or every key the parsers
/// read that no example explains (as `table.key`).
pub(crate) fn reference(docs: &[&str]) -> Result<String, Vec<String>> {
    let blocks: Vec<&str> = docs.iter().flat_map(|d| toml_blocks(d)).collect();
    let mut documented = HashMap::new();
    for block in &blocks {
        examples(block, &mut documented);
    }
    let asked = read::catalog(&blocks);
    let mut out = String::from(HEADER);
    let mut missing = Vec::new();
    let all = sections(&asked);
    for (i, section) in all.iter().enumerate() {
        out.push_str(&match (section.name.as_str(), section.array) {
            ("", _) => "\n## Top level\n\n".to_owned(),
            (name, true) => format!("\n## `[[{name}]]`\n\n"),
            (name, false) => format!("\n## `[{name}]`\n\n"),
        });
        // A table read by the same parser as an earlier one (shadow variants are variants).
        if let Some(same) = all[..i].iter().find(|s| s.keys == section.keys) {
            out.push_str(&format!("The keys of `{}`.\n", same.name));
            continue;
        }
        out.push_str("| key | takes | example | meaning |\n| --- | --- | --- | --- |\n");
        for (key, takes) in &section.keys {
            // A table of its own is a section below, not a row.
            let path = join(&section.name, key);
            if all.iter().any(|s| s.name == path) {
                continue;
            }
            let example = explained(&documented, &section.name, key);
            let Some(example) = example.filter(|e| !e.meaning.is_empty()) else {
                missing.push(path);
                continue;
            };
            out.push_str(&format!(
                "| `{key}` | {} | {} | {} |\n",
                cell(takes.as_deref().unwrap_or("see meaning")),
                if example.value.is_empty() {
                    String::new()
                } else {
                    format!("`{}`", example.value.replace('|', "\\|").replace('`', "'"))
                },
                cell(&example.meaning),
            ));
        }
    }
    if missing.is_empty() {
        Ok(out)
    } else {
        Err(missing)
    }
}

/// A key's example, or, for a key of an inline table (`semantic = { … }`), its parent's.
fn explained<'d>(
    documented: &'d HashMap<(String, String), Example>,
    table: &str,
    key: &str,
) -> Option<&'d Example> {
    let own = documented
        .get(&(table.to_owned(), key.to_owned()))
        .filter(|e| !e.meaning.is_empty());
    own.or_else(|| {
        let (parent, last) = table.rsplit_once('.').unwrap_or(("", table));
        documented
            .get(&(parent.to_owned(), last.to_owned()))
            .filter(|e| !e.meaning.is_empty() && e.value.contains(key))
    })
}

/// Text for a Markdown table cell: pipes escaped, and angle brackets, which would read as
/// HTML tags.
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

const HEADER: &str = "# Configuration reference

Every key keel reads from `keel.toml`, table by table: what it takes (in the words keel's errors
use) and what it means, with an example. This page is generated from the parsers themselves and
the annotated examples in this book, and the test command fails when it is out of date; to
regenerate it: `KEEL_UPDATE_CONFIG_REFERENCE=1 cargo nextest run -p keel-gateway config_reference`.
Environment variables are written `${VAR}` inside strings.
";
