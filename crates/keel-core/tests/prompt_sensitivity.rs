//! Runs `bench/data/prompt-sensitivity.json` through each normalization mode (each text as the
//! one user message of a Chat Completions body): reports the share of trivially different
//! groups, and of groups wording one format instruction differently, that collapse to one text,
//! and asserts that no pair with a different meaning collapses in any mode. Run with
//! `--nocapture` to see the shares.

use keel_core::normalize::{normalize_request, FullConfig, Mode};
use keel_core::protocol::Endpoint;
use serde_json::{json, Value};

fn canonical(s: &str, mode: Mode, cfg: &FullConfig) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": s}]});
    normalize_request(
        Endpoint::ChatCompletions,
        body.as_object_mut().expect("object"),
        mode,
        cfg,
    );
    body
}

fn groups(data: &Value, key: &str) -> Vec<Vec<String>> {
    serde_json::from_value(data[key].clone()).expect("groups of strings")
}

/// How many groups map every member to the first member's canonical form.
fn collapsed(groups: &[Vec<String>], mode: Mode, cfg: &FullConfig) -> usize {
    groups
        .iter()
        .filter(|g| {
            let first = canonical(&g[0], mode, cfg);
            g.iter().all(|v| canonical(v, mode, cfg) == first)
        })
        .count()
}

#[test]
fn trivial_groups_collapse_and_distinct_ones_do_not() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../bench/data/prompt-sensitivity.json"
    );
    let data: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("data set")).expect("JSON");
    let trivial = groups(&data, "trivial");
    let phrasing = groups(&data, "phrasing");
    let distinct = groups(&data, "distinct");
    assert!(trivial.len() >= 200 && distinct.len() >= 50 && phrasing.len() >= 50);
    let cfg = FullConfig::default();

    let mut shares = Vec::new();
    for (name, mode) in [
        ("off", Mode::Off),
        ("syntax", Mode::Syntax),
        ("full", Mode::Full),
    ] {
        let t = collapsed(&trivial, mode, &cfg);
        let p = collapsed(&phrasing, mode, &cfg);
        let share = |n: usize, of: usize| n as f64 / of as f64 * 100.0;
        println!(
            "{name:>6}: trivial groups collapsed {t}/{} = {:.1}%, phrasing groups {p}/{} = {:.1}%",
            trivial.len(),
            share(t, trivial.len()),
            phrasing.len(),
            share(p, phrasing.len())
        );
        shares.push((t, p));

        let merged: Vec<_> = distinct
            .iter()
            .filter(|g| canonical(&g[0], mode, &cfg) == canonical(&g[1], mode, &cfg))
            .collect();
        println!(
            "{name:>6}: distinct groups merged: {}/{}",
            merged.len(),
            distinct.len()
        );
        assert!(
            merged.is_empty(),
            "{name}: meaning-changing merges: {merged:?}"
        );
    }
    // Guards against regressions, not targets to tune towards: `syntax` collapses nearly all
    // trivial groups, and `full` never collapses less than `syntax` (it runs `syntax` first)
    // and collapses most rewordings of the instructions its default rules know.
    let ((syntax_t, _), (full_t, full_p)) = (shares[1], shares[2]);
    assert!(syntax_t * 10 >= trivial.len() * 9, "syntax: {syntax_t}");
    assert!(full_t >= syntax_t, "full {full_t} < syntax {syntax_t}");
    assert!(full_p * 10 >= phrasing.len() * 9, "full phrasing: {full_p}");
}
