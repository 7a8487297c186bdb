//! `[pools.integrity]`: output integrity checks and what keel may do about a failed one (see
//! `relay::integrity`). The table's presence turns the checks on (answers that fail them are
//! flagged with `x-keel-integrity`); `auto_continue` and `json_retry` allow repairs.

use super::read::{Issues, Table};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntegrityConfig {
    /// Continue an answer its upstream cut below the client's limit (default true).
    pub auto_continue: bool,
    /// Retry once a structured answer that is not the JSON asked for (default true).
    pub json_retry: bool,
    /// Continuations one answer may get for truncation (default 2, at most 8).
    pub max_continuations: u32,
}

impl Default for IntegrityConfig {
    fn default() -> Self {
        IntegrityConfig {
            auto_continue: true,
            json_retry: true,
            max_continuations: 2,
        }
    }
}

/// The most continuations for truncation one answer may get.
const MAX_CONTINUATIONS: u32 = 8;

pub(super) fn read(t: Option<Table>, issues: &mut Issues) -> Option<IntegrityConfig> {
    let mut t = t?;
    let d = IntegrityConfig::default();
    let max_continuations = match t.get::<u32>("max_continuations", issues) {
        Some(v) if v.value > MAX_CONTINUATIONS => {
            issues.report(
                v.at,
                &v.path,
                format!("at most {MAX_CONTINUATIONS}, got {}", v.value),
            );
            d.max_continuations
        }
        Some(v) => v.value,
        None => d.max_continuations,
    };
    let cfg = IntegrityConfig {
        auto_continue: t
            .value::<bool>("auto_continue", issues)
            .unwrap_or(d.auto_continue),
        json_retry: t
            .value::<bool>("json_retry", issues)
            .unwrap_or(d.json_retry),
        max_continuations,
    };
    t.finish(issues);
    Some(cfg)
}
