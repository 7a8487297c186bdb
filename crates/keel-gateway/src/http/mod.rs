//! The HTTP server: accepting connections (plain or TLS, HTTP/1.1 or HTTP/2), serving each,
//! and routing each request to the pipeline or the operations plane.

pub mod conn_limit;
pub mod connection;
pub mod graceful;
pub mod h2_head;
pub mod models;
pub mod server;
pub mod tls;
