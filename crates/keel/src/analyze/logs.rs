//! Access lines in, [`Record`]s out: the fields the analysis reads from one JSON access line
//! (everything else in the line is skipped unread), and a generator of synthetic access logs
//! of any size for measuring the analysis.

use std::borrow::Cow;
use std::io::Write;

use serde::Deserialize;

use keel_core::analyze::report::{parse_time_ms, Record};
use keel_core::rng::Rng;

/// The fields of an access line the analysis uses.
#[derive(Deserialize)]
struct Line<'a> {
    #[serde(borrow)]
    ts: Cow<'a, str>,
    #[serde(borrow)]
    pool: Cow<'a, str>,
    #[serde(default)]
    status: u16,
    #[serde(default, borrow)]
    outcome: Option<Cow<'a, str>>,
    #[serde(default)]
    total_ms: Option<f64>,
    #[serde(default)]
    tokens_in: Option<u64>,
    #[serde(default)]
    tokens_out: Option<u64>,
    #[serde(default, borrow)]
    cache_key: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    cache_key_raw: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    cache_key_syntax: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    template: Option<Cow<'a, str>>,
    #[serde(default)]
    deterministic: Option<bool>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    tools: Option<bool>,
    #[serde(default)]
    spend_usd: Option<f64>,
}

/// The first 64 bits of a hex key.
fn key64(hex: &str) -> Option<u64> {
    u64::from_str_radix(hex.get(..16.min(hex.len()))?, 16).ok()
}

/// One access line as a record; `None` for a line that is not one (or a request refused before
/// it had a pool).
pub fn record(line: &[u8]) -> Option<Record> {
    let l: Line = serde_json::from_slice(line).ok()?;
    if l.pool == "none" {
        return None;
    }
    let end_ms = parse_time_ms(&l.ts)?;
    let key_raw = l.cache_key_raw.as_deref().and_then(key64);
    // The normalized key: `syntax`'s where the pool does not normalize, else the pool's own.
    let key_norm = l
        .cache_key_syntax
        .as_deref()
        .or(l.cache_key.as_deref())
        .and_then(key64);
    let fingerprinted = key_raw.is_some() && key_norm.is_some();
    Some(Record {
        pool: l.pool.into_owned(),
        end_ms,
        total_ms: l.total_ms.unwrap_or(0.0),
        ok: l.status == 200 && l.outcome.as_deref() == Some("ok"),
        key_raw: key_raw.filter(|_| fingerprinted),
        key_norm: key_norm.filter(|_| fingerprinted),
        template: l.template.as_deref().and_then(key64),
        deterministic: l.deterministic.unwrap_or(false),
        temperature: l.temperature,
        tools: l.tools.unwrap_or(false),
        tokens_in: l.tokens_in.unwrap_or(0),
        tokens_out: l.tokens_out.unwrap_or(0),
        spend_usd: l.spend_usd.unwrap_or(0.0),
    })
}

/// Which records the analysis keeps.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only these pools (empty: all).
    pub pools: Vec<String>,
    /// Only requests that ended at or after this (ms since the epoch).
    pub since_ms: Option<i64>,
}

impl Filter {
    pub fn keeps(&self, r: &Record) -> bool {
        (self.pools.is_empty() || self.pools.contains(&r.pool))
            && self.since_ms.is_none_or(|s| r.end_ms >= s)
    }
}

/// Writes about `bytes` of synthetic access lines to `out`: three pools over a day (a
/// templated support pool with repeats, a chat pool of unique prompts, a mixed pool with
/// sampling), lines shaped as keel writes them (every field, realistic sizes).
pub fn synthetic(out: &mut impl Write, bytes: u64, seed: u64) -> std::io::Result<u64> {
    let mut rng = Rng::new(seed);
    let mut written = 0u64;
    let mut i = 0u64;
    let day_ms = 86_400_000u64;
    let start_ms = 1_796_342_400_000u64; // 2026-12-04T00:00:00Z
    let step_ms = (day_ms * 800 / bytes.max(1)).max(1);
    let mut buf = String::with_capacity(1024);
    // A key of 64 hex digits, as SHA-256 would print.
    let sha = |k: u64| {
        let m = keel_core::rng::mix;
        format!(
            "{:016x}{:016x}{:016x}{:016x}",
            m(k),
            m(k ^ 1),
            m(k ^ 2),
            m(k ^ 3)
        )
    };
    while written < bytes {
        i += 1;
        let (pool, key, template, temp) = match rng.next_u64() % 10 {
            0..=4 => ("support", rng.next_u64() % 60, rng.next_u64() % 40, 0.0),
            5..=7 => ("chat", rng.next_u64(), rng.next_u64() % 5000, 0.7),
            _ => {
                let t = if rng.next_f64() < 0.5 { 0.0 } else { 1.0 };
                ("mixed", rng.next_u64() % 200, rng.next_u64() % 200, t)
            }
        };
        // In time order over one day, whatever the size (a line is about 800 bytes).
        let t_ms = start_ms + (i * step_ms) % day_ms;
        let secs = t_ms / 1000;
        let (y, m, d) = keel_core::analyze::report::civil_from_days((secs / 86_400) as i64);
        let rem = secs % 86_400;
        let out_tokens = 20 + template % 50 + rng.next_u64() % 8;
        let total = 200.0 + rng.next_f64() * 800.0;
        buf.clear();
        use std::fmt::Write as _;
        let _ = write!(
            buf,
            r#"{{"ts":"{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z","request_id":"01JEXAMPLE{i:016}","tenant":"team-a","key_id":"app","api":"chat_completions","pool":"{pool}","variant":"{pool}-a","variants_tried":["{pool}-a"],"route":"direct","attempts":1,"hedges":0,"migrations":0,"prompt_fixes":[],"status":200,"outcome":"ok","detail":null,"ttft_ms":{:.3},"total_ms":{total:.3},"tokens_in":{},"tokens_out":{out_tokens},"overhead_us":41,"cache":"bypass","cached_from":null,"trace_id":null,"cache_key":"{}","cache_key_raw":"{}","cache_key_syntax":"{}","template":"{:016x}","deterministic":{},"temperature":{temp},"tools":false,"spend_usd":{:.6}}}"#,
            rem / 3600,
            rem % 3600 / 60,
            rem % 60,
            t_ms % 1000,
            total / 4.0,
            100 + template * 3,
            sha(key),
            // An eighth differ raw only (what normalization merges).
            sha(key + u64::from(rng.next_u64().is_multiple_of(8)) * (1 << 40)),
            sha(key),
            template.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            temp == 0.0,
            out_tokens as f64 * 2e-6,
        );
        buf.push('\n');
        out.write_all(buf.as_bytes())?;
        written += buf.len() as u64;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_become_records_and_junk_does_not() {
        let mut buf = Vec::new();
        synthetic(&mut buf, 20_000, 1).unwrap();
        let text = String::from_utf8(buf).unwrap();
        let recs: Vec<Record> = text.lines().filter_map(|l| record(l.as_bytes())).collect();
        assert_eq!(recs.len(), text.lines().count());
        let r = &recs[0];
        assert!(r.key_raw.is_some() && r.template.is_some() && r.ok, "{r:?}");
        assert!(r.end_ms >= 1_796_342_400_000);
        for junk in [
            "",
            "not json",
            "{}",
            r#"{"ts":"x","pool":"p"}"#,
            r#"{"ts":"2026-12-04T00:00:00Z","pool":"none"}"#,
        ] {
            assert!(record(junk.as_bytes()).is_none(), "{junk}");
        }
        // A line without fingerprints (its pool does not take them) still counts.
        let plain =
            record(br#"{"ts":"2026-12-04T00:00:00Z","pool":"p","status":200,"outcome":"ok"}"#)
                .unwrap();
        assert_eq!((plain.key_raw, plain.ok), (None, true));
        let f = Filter {
            pools: vec!["support".into()],
            since_ms: Some(r.end_ms),
        };
        assert_eq!(f.keeps(r), r.pool == "support");
        assert!(!f.keeps(&Record {
            end_ms: r.end_ms - 1,
            ..r.clone()
        }));
    }
}
