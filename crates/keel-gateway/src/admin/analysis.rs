//! `GET /keel/analyze` (operations plane: the admin key or a key with the `ops` role, like
//! every read of all tenants' traffic): the analysis `keel analyze` makes of a log, over each
//! fingerprinting pool's recent window (`state::analysis`).

use keel_core::analyze::report::Analyzer;

use crate::state::analysis::{options, RECENT};
use crate::Gateway;

/// `GET /keel/analyze`: the analysis of every fingerprinting pool's recent window.
pub fn document(gw: &Gateway) -> serde_json::Value {
    let mut analyzer = Analyzer::new(options(&gw.cfg));
    let mut kept = 0usize;
    let mut pools = Vec::new();
    for p in gw.pools() {
        if let Some(a) = &p.analysis {
            pools.push(p.cfg.name.clone());
            for r in a.snapshot() {
                kept += 1;
                analyzer.add(&r);
            }
        }
    }
    serde_json::json!({
        "window": {"per_pool": RECENT, "requests": kept, "fingerprinting_pools": pools},
        "report": analyzer.finish(),
    })
}
