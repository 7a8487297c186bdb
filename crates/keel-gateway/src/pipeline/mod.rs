//! The request pipeline, in the order a request travels: admit ([`admission`], [`prompt_work`],
//! [`context_fit`]), cache ([`cache`]), plan ([`selection`], with the canary split and
//! [`consensus`]), execute ([`execution`], [`attempt`], [`settlement`]; hedges and failover), and
//! deliver ([`delivery`], then [`relay`] once the first byte is out). [`context`] is the
//! per-request context every phase reads; [`monitor`] sends the probes and warm-ups that keep the
//! live estimates true through the same attempt machinery; [`shadow`] copies served requests.

pub mod admission;
pub mod attempt;
pub mod cache;
pub mod consensus;
pub mod context;
pub mod context_fit;
pub mod decision_candidates;
pub mod delivery;
pub mod execution;
pub mod guard;
pub mod guard_stream;
pub mod monitor;
pub mod phases;
pub mod prompt_work;
pub mod relay;
pub mod selection;
pub mod settlement;
pub mod shadow;
