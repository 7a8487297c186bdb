//! Replays the gateway's fuzz corpora (`fuzz/corpus/config_parse/`,
//! `fuzz/corpus/upstream_response/`, regressions included) through their harnesses on stable;
//! a panic on any file fails the test and names the file.

use std::path::{Path, PathBuf};

fn replay(target: &str, harness: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} holds no corpus", dir.display());
    let failed: Vec<String> = files
        .iter()
        .filter(|f| {
            let data = std::fs::read(f).expect("a readable corpus file");
            std::panic::catch_unwind(|| harness(&data)).is_err()
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(failed.is_empty(), "the harness panicked on {failed:#?}");
}

#[test]
fn config_parse_corpus() {
    replay("config_parse", keel_gateway::fuzzing::config_parse);
}

#[test]
fn upstream_response_corpus() {
    replay(
        "upstream_response",
        keel_gateway::fuzzing::upstream_response,
    );
}
