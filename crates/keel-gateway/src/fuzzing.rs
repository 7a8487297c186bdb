//! Fuzz harnesses for what the gateway alone parses (see `keel_core::fuzzing` for the others):
//! configuration text and upstream HTTP/1.1 answers. The cargo-fuzz targets `config_parse` and
//! `upstream_response` call them, and `tests/it/fuzz_corpus.rs` replays their corpora on stable.

use std::collections::HashMap;

/// `config_parse`: the bytes as a configuration file through the public entry point, with a
/// small environment for `${VAR}` references. Any result is fine; a panic is not.
pub fn config_parse(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let env: HashMap<String, String> = [("KEY", "sk-test"), ("EMPTY", ""), ("PORT", "8080")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let _ = crate::config::Config::parse(text, "fuzz.toml", &env);
}

/// `upstream_response`: the bytes as an upstream's HTTP/1.1 answer to the direct pool, fed in
/// pieces; see `upstream::direct::exchange::fuzz_response`.
pub fn upstream_response(data: &[u8]) {
    crate::upstream::fuzz_response(data);
}
