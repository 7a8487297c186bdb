//! What a reload changes, pool by pool, as the reload's answer and log line say it.

use serde_json::{json, Value};

use crate::config::Config;

/// What a reload changes, pool by pool, for the admin answer and the log: `unchanged`,
/// `added`, `removed`, or `changed` with the variants `kept` (live state carried), `added`,
/// `redefined` (started afresh) and `removed`.
pub fn changes(old: &Config, new: &Config) -> Vec<Value> {
    let mut out = Vec::new();
    for p in &new.pools {
        let Some(o) = old.pools.iter().find(|o| o.name == p.name) else {
            out.push(json!({"pool": p.name, "change": "added"}));
            continue;
        };
        if o == p {
            out.push(json!({"pool": p.name, "change": "unchanged"}));
            continue;
        }
        let (mut kept, mut added, mut redefined) = (Vec::new(), Vec::new(), Vec::new());
        for v in &p.variants {
            match o.variants.iter().find(|ov| ov.name == v.name) {
                Some(ov) if ov == v => kept.push(&v.name),
                Some(_) => redefined.push(&v.name),
                None => added.push(&v.name),
            }
        }
        let removed: Vec<&String> = o
            .variants
            .iter()
            .filter(|ov| !p.variants.iter().any(|v| v.name == ov.name))
            .map(|ov| &ov.name)
            .collect();
        out.push(json!({"pool": p.name, "change": "changed", "kept": kept, "added": added, "redefined": redefined, "removed": removed}));
    }
    for o in &old.pools {
        if !new.pools.iter().any(|p| p.name == o.name) {
            out.push(json!({"pool": o.name, "change": "removed"}));
        }
    }
    out
}
