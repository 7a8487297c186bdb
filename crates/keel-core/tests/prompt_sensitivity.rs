//! Runs `bench/data/prompt-sensitivity.json` through `syntax` normalization: reports the share
//! of trivially different groups that collapse to one text, and asserts that no pair with a
//! different meaning collapses. Run with `--nocapture` to see the share.

use keel_core::normalize::{normalize_text, Fixes};

fn canonical(s: &str) -> String {
    normalize_text(s, &mut Fixes::default()).unwrap_or_else(|| s.to_string())
}

fn groups(data: &serde_json::Value, key: &str) -> Vec<Vec<String>> {
    serde_json::from_value(data[key].clone()).expect("groups of strings")
}

#[test]
fn trivial_groups_collapse_and_distinct_ones_do_not() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../bench/data/prompt-sensitivity.json"
    );
    let data: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("data set")).expect("JSON");
    let trivial = groups(&data, "trivial");
    let distinct = groups(&data, "distinct");
    assert!(trivial.len() >= 200 && distinct.len() >= 50);

    let collapsed = trivial
        .iter()
        .filter(|g| g.iter().all(|v| canonical(v) == canonical(&g[0])))
        .count();
    let share = collapsed as f64 / trivial.len() as f64;
    println!(
        "trivial groups collapsed: {collapsed}/{} = {:.1}%",
        trivial.len(),
        share * 100.0
    );

    let merged: Vec<_> = distinct
        .iter()
        .filter(|g| canonical(&g[0]) == canonical(&g[1]))
        .collect();
    println!(
        "distinct groups merged: {}/{}",
        merged.len(),
        distinct.len()
    );
    assert!(merged.is_empty(), "meaning-changing merges: {merged:?}");
    // Guards the normalizer against regressing, not a target to tune towards.
    assert!(
        share >= 0.9,
        "only {:.1}% of trivial groups collapsed",
        share * 100.0
    );
}
