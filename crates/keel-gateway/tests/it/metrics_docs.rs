//! The metric list stays true: every metric keel records is in `metrics.rs`'s table, the book's
//! metrics chapter (`docs/src/metrics.md`) lists exactly the table's metrics, and the Grafana dashboard (`deploy/grafana/keel.json`)
//! queries only metrics that exist.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `keel_…` name in `text` that starts a token (the characters before it are not part of
/// an identifier), with `_bucket`/`_sum`/`_count` folded into their histogram.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("keel_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_lowercase() || bytes[end] == b'_') {
            end += 1;
        }
        let starts_token =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        if starts_token {
            out.insert(text[start..end].to_owned());
        }
        i = end.max(start + 1);
    }
    out
}

fn fold_histogram(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// The metrics in the first column of a Markdown table (`| \`name\` | …`) in `text`.
fn table_names(text: &str, line_prefix: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix(line_prefix))
        .filter_map(|l| l.strip_prefix("| `keel_"))
        .filter_map(|l| l.split_once('`'))
        .map(|(rest, _)| format!("keel_{rest}"))
        .collect()
}

/// The metric table at the top of `metrics.rs`.
fn documented() -> BTreeSet<String> {
    let t = table_names(
        &read(&repo().join("crates/keel-gateway/src/observe/metrics.rs")),
        "//! ",
    );
    assert!(t.len() > 10, "metrics.rs table not found: {t:?}");
    t
}

/// Every Rust source file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_metric_recorded_is_in_the_table() {
    let table = documented();
    let mut files = Vec::new();
    sources(&repo().join("crates/keel-gateway/src"), &mut files);
    let mut recorded = BTreeSet::new();
    for f in files {
        let text = read(&f);
        // Names quoted in code are the ones recorded (`m.counter("keel_…", …)`); the log
        // target `keel_gateway` and `metrics.rs`'s own test registry are not metrics.
        for name in metric_names(&text) {
            if text.contains(&format!("\"{name}\""))
                && name != "keel_gateway"
                && name != "keel_x_total"
            {
                recorded.insert(name);
            }
        }
    }
    let missing: Vec<_> = recorded.difference(&table).collect();
    assert!(
        missing.is_empty(),
        "recorded but not in metrics.rs's table: {missing:?}"
    );
    let stale: Vec<_> = table.difference(&recorded).collect();
    assert!(
        stale.is_empty(),
        "in metrics.rs's table but never recorded: {stale:?}"
    );
}

#[test]
fn the_book_lists_exactly_the_tables_metrics() {
    let chapter = read(&repo().join("docs/src/metrics.md"));
    let section = chapter
        .strip_prefix("# Metrics\n")
        .expect("docs/src/metrics.md is the Metrics chapter");
    assert_eq!(table_names(section, ""), documented());
    // Nothing else in the section names a metric that does not exist.
    let unknown: Vec<_> = metric_names(section)
        .into_iter()
        .filter(|n| !documented().contains(fold_histogram(n)))
        .collect();
    assert!(
        unknown.is_empty(),
        "the metrics chapter names unknown metrics: {unknown:?}"
    );
}

#[test]
fn grafana_queries_only_metrics_that_exist() {
    let doc: Value = serde_json::from_str(&read(&repo().join("deploy/grafana/keel.json")))
        .expect("deploy/grafana/keel.json is JSON");
    // A Prometheus data source variable that every query uses.
    let vars = doc["templating"]["list"].as_array().unwrap();
    assert!(vars.iter().any(|v| v["name"] == "datasource"
        && v["type"] == "datasource"
        && v["query"] == "prometheus"));
    let mut exprs = Vec::new();
    for p in doc["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{}", p["title"]);
            exprs.push(t["expr"].as_str().unwrap().to_owned());
        }
    }
    for v in vars {
        if let Some(q) = v["query"]["query"].as_str() {
            exprs.push(q.to_owned());
        }
    }
    assert!(exprs.len() > 20);
    let table = documented();
    let mut queried = BTreeSet::new();
    for e in &exprs {
        let names = metric_names(e);
        assert!(!names.is_empty(), "query without a keel metric: {e}");
        for n in names {
            let base = fold_histogram(&n).to_owned();
            assert!(table.contains(&base), "{e}: `{n}` is not a keel metric");
            queried.insert(base);
        }
    }
    // The dashboard covers every metric keel has.
    let unshown: Vec<_> = table.difference(&queried).collect();
    assert!(
        unshown.is_empty(),
        "metrics without a Grafana panel: {unshown:?}"
    );
}
