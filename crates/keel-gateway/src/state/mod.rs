//! State that outlives a request: the pools and their live variant state ([`pools`]),
//! learned limits and the wait line ([`capacity`]), the retry budget, rollout state ([`canary`],
//! [`safe_mode`]), keys and quotas ([`keys`], [`quota`]) and what replicas tell each other
//! ([`signals`]), and the token counts of long prompt texts ([`token_counts`]).

pub mod analysis;
pub mod cache;
pub mod canary;
pub mod capacity;
pub mod keys;
pub mod pools;
pub mod process;
pub mod quota;
pub mod retry_budget;
pub mod safe_mode;
pub mod shadow;
pub mod signals;
pub mod token_counts;
