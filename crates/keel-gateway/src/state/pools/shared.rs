//! What other replicas said about this pool's variants (see `state::signals`): the findings
//! this replica shares, and another replica's signal applied to a variant's availability.

use keel_core::health::State;

use super::Pool;
use crate::state::signals::{hold_until, Findings, Kind, Signal};

impl Pool {
    /// The index of the variant called `name`.
    pub fn variant_index(&self, name: &str) -> Option<usize> {
        self.variants.iter().position(|v| v.cfg.name == name)
    }

    /// What this replica measured about variant `index` (not what it was told).
    pub fn findings(&self, index: usize) -> Findings {
        let st = self.variant_state(index);
        Findings {
            down: matches!(st.health.est.state, State::Ejected { .. })
                || st.restarting_since.is_some(),
            cooldown_until_ms: st.availability.cooldown_until_ms,
            learned_limit: self.variants[index].limit.learned(),
        }
    }

    /// Applies another replica's `eject`, `cooldown` or `recovered` signal to variant `index`
    /// (see the merge rule above); `limit` is the caller's (it needs an expiry of its own).
    pub fn apply_shared(&self, index: usize, s: &Signal, own_ttl_ms: u64) {
        let now = self.now_ms();
        self.update(index, |st| {
            let a = &mut st.availability;
            match s.kind {
                Kind::Eject => {
                    a.shared_eject_until_ms =
                        hold_until(a.shared_eject_until_ms, now, s, own_ttl_ms)
                }
                Kind::Cooldown => {
                    a.shared_cooldown_until_ms =
                        hold_until(a.shared_cooldown_until_ms, now, s, own_ttl_ms)
                }
                Kind::Recovered => a.shared_eject_until_ms = 0,
                Kind::Limit => {}
            }
        });
    }
}
