//! keel-gateway's folders are layers, and imports run only downward: a module may use its own
//! folder and the folders below it, never one above. This test reads every `crate::` path in
//! the source (outside test modules) and fails on an upward import, naming the file and what
//! it took; so a cycle spanning folders cannot come back unnoticed.
//!
//! There are none: where a lower layer needs something of a higher one, the higher one hands
//! it down behind a trait the lower one defines (`state::process::Reloader`,
//! `observe::access_log::PoolRecords`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// From the top down. `root` is the crate root (`lib.rs`: the `Gateway` that holds one
/// generation's state).
const LAYERS: &[(&str, &str)] = &[
    ("fuzzing", "entry points for the fuzz targets"),
    ("http", "accepting connections and routing"),
    ("admin", "the operations plane"),
    ("pipeline", "one request's phases"),
    ("root", "the gateway: one generation's state"),
    ("state", "what outlives a request"),
    ("observe", "metrics, traces, logs, records"),
    ("upstream", "calling model servers"),
    ("wire", "what the client sees"),
    ("config", "keel.toml"),
    ("per_thread", "a utility"),
    ("hooks", "test fault injection"),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rank(layer: &str) -> usize {
    LAYERS
        .iter()
        .position(|(l, _)| *l == layer)
        .unwrap_or_else(|| panic!("`{layer}` is in no layer: add it to LAYERS"))
}

/// The layer a top-level name of the crate belongs to.
fn layer_of_name(name: &str) -> Option<&'static str> {
    match name {
        "Gateway" => Some("root"),
        "Body" | "full_body" => Some("wire"),
        "Config" | "install_crypto" => Some("config"),
        _ => LAYERS.iter().map(|(l, _)| *l).find(|l| *l == name),
    }
}

/// The layer of a source file: its top folder, or its own name for a file at the top.
fn layer_of_file(rel: &Path) -> &'static str {
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_str()
        .unwrap();
    let name = first.strip_suffix(".rs").unwrap_or(first);
    if name == "lib" {
        return "root";
    }
    layer_of_name(name).unwrap_or_else(|| panic!("src/{first} is in no layer: add it to LAYERS"))
}

/// The source without its inline `#[cfg(test)]` module (tests may reach anywhere). A test
/// module in a file of its own (`mod tests;`) hides nothing of the source around it.
fn without_tests(text: &str) -> &str {
    const TEST_MOD: &str = "#[cfg(test)]\nmod ";
    let mut from = 0;
    while let Some(i) = text[from..].find(TEST_MOD) {
        let at = from + i;
        let line_end = text[at + TEST_MOD.len()..]
            .find('\n')
            .map_or(text.len(), |e| at + TEST_MOD.len() + e);
        if text[at..line_end].trim_end().ends_with('{') {
            return &text[..at];
        }
        from = line_end;
    }
    text
}

/// The first names of every `crate::` path (`crate::state::pools::Pool` → `state`;
/// `crate::{Body, Gateway}` → both); in `lib.rs`, also paths written without `crate::`.
fn names_used(text: &str, root: bool) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut at = 0;
    while let Some(i) = text[at..].find("crate::") {
        let start = at + i + "crate::".len();
        at = start;
        if i > 0 && (bytes[at - 8].is_ascii_alphanumeric() || bytes[at - 8] == b'_') {
            continue; // `keel_crate::` and the like
        }
        if bytes.get(start) == Some(&b'{') {
            let end = start + matching_brace(&text[start..]);
            for element in top_level_elements(&text[start + 1..end]) {
                out.insert(element);
            }
        } else {
            out.insert(ident(&text[start..]).to_owned());
        }
    }
    if root {
        for line in text.lines() {
            let line = line.trim_start();
            if line.starts_with("//") || line.starts_with("pub mod") || line.starts_with("mod ") {
                continue;
            }
            for (layer, _) in LAYERS {
                let path = format!("{layer}::");
                let mut rest = line;
                while let Some(i) = rest.find(&path) {
                    let before = rest[..i].chars().last();
                    if !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                        out.insert(layer.to_string());
                    }
                    rest = &rest[i + path.len()..];
                }
            }
        }
    }
    out
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The index of the `}` closing the `{` at the start of `s`.
fn matching_brace(s: &str) -> usize {
    let mut depth = 0;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    s.len()
}

fn top_level_elements(group: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(ident(group[start..i].trim()).to_owned());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(ident(group[start..].trim()).to_owned());
    out.retain(|e| !e.is_empty() && e != "self");
    out
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs")
            && path.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(path);
        }
    }
}

/// Every (file, layer above it) pair the source imports.
fn upward_imports() -> BTreeSet<(String, String)> {
    let mut files = Vec::new();
    sources(&src(), &mut files);
    let mut found = BTreeSet::new();
    for path in files {
        let rel = path.strip_prefix(src()).unwrap().to_path_buf();
        let own = layer_of_file(&rel);
        let text = std::fs::read_to_string(&path).unwrap();
        for name in names_used(without_tests(&text), own == "root") {
            let Some(target) = layer_of_name(&name) else {
                continue;
            };
            if rank(target) < rank(own) {
                found.insert((rel.display().to_string(), target.to_owned()));
            }
        }
    }
    found
}

#[test]
fn imports_run_only_down_the_layers() {
    let found = upward_imports();
    assert!(
        found.is_empty(),
        "imports from a lower layer up to a higher one (file, layer it reaches); layers from the top: {:?}\n{found:#?}",
        LAYERS.iter().map(|(l, _)| *l).collect::<Vec<_>>()
    );
}

#[test]
fn a_test_module_in_its_own_file_hides_no_import() {
    let text = "#[cfg(test)]\nmod tests;\nuse crate::Gateway;\n#[cfg(test)]\nmod more {\n    use crate::admin;\n}\n";
    let kept = without_tests(text);
    assert!(kept.contains("crate::Gateway"), "{kept}");
    assert!(!kept.contains("crate::admin"), "{kept}");
}

#[test]
fn the_reader_sees_grouped_and_plain_paths() {
    let text = "use crate::state::pools::Pool;\nuse crate::{wire::body::Body, Gateway};\nlet x = keel_crate::nothing;";
    let names = names_used(text, false);
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["Gateway", "state", "wire"]
    );
    let root = "pub struct G { a: admin::live::Process }\npub mod admin;";
    assert!(names_used(root, true).contains("admin"));
}
