//! Gateway integration tests: keel on loopback in front of keel-sim servers.
//! One test binary (faster to link); one module per concern.

mod access_log;
mod bad_input;
mod cache;
mod canonical_tools;
mod capacity;
mod context;
mod count_tokens;
mod decisions;
mod embeddings;
mod events;
mod failover;
mod fuzz_corpus;
mod harness;
mod hedging;
mod hostile;
mod keys;
mod lifecycle;
mod metrics_docs;
mod migration;
mod models;
mod normalize;
mod openapi;
mod prefill_refusal;
mod proxy;
mod queue;
mod responses;
mod routing;
mod safe_mode;
mod safeguards;
mod speculation;
mod streams;
mod tracing;
mod translation;
