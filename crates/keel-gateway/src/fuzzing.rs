//! Fuzz harness for configuration text (see `keel_core::fuzzing` for the others): the cargo-fuzz
//! target `config_parse` calls it, and `tests/it/fuzz_corpus.rs` replays its corpus on stable.

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
