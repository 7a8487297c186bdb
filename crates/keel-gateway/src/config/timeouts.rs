//! `[timeouts]` (the defaults), a pool's `[pools.timeouts]`, and the same keys written flat in
//! the pool table. Each layer sets some of the four; the rest fall through to the layer below:
//! flat pool keys, then `[pools.timeouts]`, then `[timeouts]`, then [`Timeouts::default`].

use super::read::{Issues, Table};

/// The four timeouts, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP (and TLS) connection establishment.
    pub connect_ms: u64,
    /// From sending the request to the first generated token (streams) or the response head.
    pub first_token_ms: u64,
    /// Longest silence between two stream events once the first token arrived.
    pub stall_ms: u64,
    /// The whole request, all attempts together.
    pub total_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect_ms: 1_000,
            first_token_ms: 15_000,
            stall_ms: 10_000,
            total_ms: 600_000,
        }
    }
}

/// The timeouts one table sets; `None` falls through.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct TimeoutLayer {
    connect_ms: Option<u64>,
    first_token_ms: Option<u64>,
    stall_ms: Option<u64>,
    total_ms: Option<u64>,
}

impl TimeoutLayer {
    /// Reads the four keys from `t` (which may hold other keys too); 0 is reported where written.
    pub(super) fn read(t: &mut Table, issues: &mut Issues) -> Self {
        let mut one = |key: &'static str| {
            let v = t.get::<u64>(key, issues)?;
            if v.value == 0 {
                issues.report(v.at, &v.path, "must be greater than 0");
            }
            Some(v.value)
        };
        TimeoutLayer {
            connect_ms: one("connect_ms"),
            first_token_ms: one("first_token_ms"),
            stall_ms: one("stall_ms"),
            total_ms: one("total_ms"),
        }
    }

    /// Reads a whole `[timeouts]` table (nothing else belongs in it).
    pub(super) fn read_table(t: Option<Table>, issues: &mut Issues) -> Self {
        let Some(mut t) = t else {
            return TimeoutLayer::default();
        };
        let layer = TimeoutLayer::read(&mut t, issues);
        t.finish(issues);
        layer
    }

    /// This layer's settings over `base`.
    pub(super) fn over(self, base: Timeouts) -> Timeouts {
        Timeouts {
            connect_ms: self.connect_ms.unwrap_or(base.connect_ms),
            first_token_ms: self.first_token_ms.unwrap_or(base.first_token_ms),
            stall_ms: self.stall_ms.unwrap_or(base.stall_ms),
            total_ms: self.total_ms.unwrap_or(base.total_ms),
        }
    }
}
