//! What keel tells its operators: metrics, traces, the access log (written off the request
//! path by [`log_writer`]), decision records and the dashboard's recent window.

pub mod access_log;
pub mod decisions;
pub mod events;
pub mod log_writer;
pub mod meter;
pub mod metrics;
pub mod record;
pub mod telemetry;
pub mod window;
