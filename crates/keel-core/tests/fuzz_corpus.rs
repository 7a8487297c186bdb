//! Replays every fuzz corpus file (`fuzz/corpus/<target>/`, regressions included) through its
//! harness on stable, so that what the fuzzer found stays fixed without a nightly toolchain.
//! A harness that panics on any file fails the test and names the file.

use std::path::{Path, PathBuf};

use keel_core::fuzzing;

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
    assert!(
        failed.is_empty(),
        "{target}: the harness panicked on {failed:#?}"
    );
}

#[test]
fn sse_decoder_corpus() {
    replay("sse_decoder", fuzzing::sse_decoder);
}

#[test]
fn chunk_events_corpus() {
    replay("chunk_events", fuzzing::chunk_events);
}

#[test]
fn assemble_corpus() {
    replay("assemble", fuzzing::assemble);
}

#[test]
fn stitch_corpus() {
    replay("stitch", fuzzing::stitch);
}

#[test]
fn request_parse_corpus() {
    replay("request_parse", fuzzing::request_parse);
}
