//! What the client sees on the wire, whoever produces it: response bodies, the client-side
//! writer, errors in the client's protocol, the Responses API's shape, the route table and
//! request ids.

pub mod body;
pub mod client_write;
pub mod errors;
pub mod request_id;
pub mod responses;
pub mod routes;

/// The response header naming what a pool's guard found in the request and did about it.
pub const GUARD_HEADER: &str = "x-keel-guard";
