//! README's command table and `--help` are both read from the CLI definition's point of view:
//! every command and flag is in the table, every one in the table exists, and every one says
//! what it does in `--help`. The table is written by hand (it groups and explains); these tests
//! keep it from drifting away from the code.

use std::collections::{BTreeMap, BTreeSet};

use clap::CommandFactory;

use crate::bench::ScenarioArgs;
use crate::Cli;

const README: &str = include_str!("../../../README.md");

/// The scenario form of `keel bench` (an external subcommand with a parser of its own).
const SCENARIO_PATH: &str = "keel bench <scenario>";

/// Every command that does something (a leaf, or a command with flags of its own), by path
/// (`keel sim load`), with its long flags.
fn cli_commands() -> BTreeMap<String, BTreeSet<String>> {
    fn walk(cmd: &clap::Command, path: &str, out: &mut BTreeMap<String, BTreeSet<String>>) {
        let flags: BTreeSet<String> = cmd
            .get_arguments()
            .filter(|a| !a.is_hide_set())
            .filter_map(|a| a.get_long())
            .filter(|l| !["help", "version"].contains(l))
            .map(|l| format!("--{l}"))
            .collect();
        let subs: Vec<&clap::Command> = cmd
            .get_subcommands()
            .filter(|s| !s.is_hide_set() && s.get_name() != "help")
            .collect();
        if subs.is_empty() || !flags.is_empty() {
            out.insert(path.to_owned(), flags);
        }
        for s in subs {
            walk(s, &format!("{path} {}", s.get_name()), out);
        }
    }
    let mut out = BTreeMap::new();
    let root = Cli::command();
    for s in root
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
    {
        walk(s, &format!("keel {}", s.get_name()), &mut out);
    }
    walk(&ScenarioArgs::command(), SCENARIO_PATH, &mut out);
    out
}

/// A row of README's "Commands" table.
struct Row {
    /// The command path, `keel sim load`.
    path: String,
    /// The flags the command cell shows.
    synopsis: BTreeSet<String>,
    /// The flags the description names (its own, or another command's it refers to).
    described: BTreeSet<String>,
}

/// README's "Commands" table, row by row.
fn readme_rows() -> Vec<Row> {
    let section = README
        .split_once("\n## Commands\n")
        .expect("README has a Commands section")
        .1;
    let section = section.split("\n## ").next().unwrap_or(section);
    section
        .lines()
        .filter(|l| l.starts_with("| `keel"))
        .map(|row| {
            let cell = row[3..].split('`').next().unwrap_or("");
            let mut path = Vec::new();
            for word in cell.split_whitespace() {
                if word.starts_with("<scenario>") {
                    path.push("<scenario>");
                    break;
                }
                if word.starts_with('-')
                    || !word
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                {
                    break;
                }
                path.push(word);
            }
            let description = row[3 + cell.len()..].split_once('|').map_or("", |d| d.1);
            Row {
                path: path.join(" "),
                synopsis: flags_in(cell),
                described: flags_in(description),
            }
        })
        .collect()
}

/// Every `--flag` in a line of text.
fn flags_in(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let mut flags = BTreeSet::new();
    let mut i = 0;
    while let Some(at) = text[i..].find("--") {
        let start = i + at;
        let name_start = start + 2;
        let mut end = name_start;
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'-')
        {
            end += 1;
        }
        let preceded =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'-');
        let named = bytes.get(name_start).is_some_and(u8::is_ascii_lowercase);
        if named && !preceded {
            flags.insert(text[start..end].to_owned());
        }
        i = end.max(start + 2);
    }
    flags
}

#[test]
fn readme_command_table_matches_the_cli() {
    let cli = cli_commands();
    let every_flag: BTreeSet<&String> = cli.values().flatten().collect();
    let mut documented: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for row in readme_rows() {
        let path = &row.path;
        let Some(known) = cli.get(path) else {
            panic!("README's command table has `{path}`, which keel does not have");
        };
        let unknown: Vec<&String> = row.synopsis.difference(known).collect();
        assert!(
            unknown.is_empty(),
            "README's command table gives `{path}` flags it does not have: {unknown:?}"
        );
        let nowhere: Vec<&String> = row
            .described
            .iter()
            .filter(|f| !every_flag.contains(f))
            .collect();
        assert!(
            nowhere.is_empty(),
            "README's command table describes `{path}` with flags no command has: {nowhere:?}"
        );
        let own = row.described.intersection(known).cloned();
        documented
            .entry(row.path.clone())
            .or_default()
            .extend(row.synopsis.iter().cloned().chain(own));
    }
    for (path, flags) in &cli {
        let Some(shown) = documented.get(path) else {
            panic!("`{path}` is missing from README's command table");
        };
        let missing: Vec<&String> = flags.difference(shown).collect();
        assert!(
            missing.is_empty(),
            "README's command table does not mention {missing:?} of `{path}`"
        );
    }
}

#[test]
fn every_command_and_flag_says_what_it_does() {
    fn check(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
        if cmd
            .get_about()
            .is_none_or(|a| a.to_string().trim().is_empty())
        {
            missing.push(path.to_owned());
        }
        for a in cmd.get_arguments() {
            let id = a.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            if a.get_help().is_none_or(|h| h.to_string().trim().is_empty()) {
                missing.push(format!("{path} {id}"));
            }
        }
        for s in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
            check(s, &format!("{path} {}", s.get_name()), missing);
        }
    }
    let mut missing = Vec::new();
    check(&Cli::command(), "keel", &mut missing);
    check(&ScenarioArgs::command(), SCENARIO_PATH, &mut missing);
    assert!(missing.is_empty(), "no help for: {missing:?}");
}

#[test]
fn flags_are_found_where_the_table_writes_them() {
    assert_eq!(
        flags_in("`keel x [--a-b N] [--c]` with `--d 1`; not a--e or ---"),
        ["--a-b", "--c", "--d"].map(String::from).into()
    );
}
