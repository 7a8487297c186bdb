//! keel-core: the pure routing core. No sockets, no clocks, no global state: time (`now_ms`) and
//! randomness ([`rng::Rng`]) are passed in, so every decision can be unit-tested exactly and
//! benchmarked per call.
//!
//! Modules follow the request's path: [`request`] (admission: parse, validate, canonical form),
//! [`selection`] (an ordered plan of variants), [`outcome`] and [`budget`] (execution's
//! decisions after each attempt), [`protocol`] and [`sse`] (delivery: wire shapes and streams),
//! [`translate`] (between the OpenAI and Anthropic protocols, requests and answers).
#![forbid(unsafe_code)]

pub mod analyze;
pub mod assemble;
pub mod budget;
pub mod canary;
pub mod compare;

pub mod cache_key;
pub mod continuation;
pub mod dialect;
pub mod embeddings;
pub mod fit;
#[doc(hidden)]
pub mod fuzzing;
pub mod guard;
pub mod health;
pub mod health_colour;
pub mod hedge;
pub mod integrity;
pub mod json_out;
pub mod members;
pub mod normalize;
pub mod outcome;
pub mod p2c;
pub mod prefill;
pub mod protocol;
pub mod queue;
pub mod quota;
pub mod request;
pub mod rng;
pub mod selection;
pub mod sse;
pub mod stream_watch;
pub mod synthesize;
pub mod tokens;
pub mod translate;
pub mod usage;
