//! keel-sim: a fleet of simulated model servers for tests, the demo and benchmarks.
//!
//! Each server is a real HTTP server on loopback speaking the OpenAI and Anthropic wire
//! protocols and the clouds' dialects of them ([`dialects`]: Azure OpenAI, Gemini, Vertex AI,
//! Bedrock Converse, the OpenAI Responses API), with deterministic text and exact continuation ([`text`]), a latency and capacity
//! model ([`latency`]), and fault injection ([`faults`]). keel's gateway does not know this crate
//! exists: to it, a simulated server is just another upstream.
#![forbid(unsafe_code)]

pub mod config;
pub mod dialects;
pub mod embeddings;
pub mod faults;
pub mod latency;
pub mod load;
pub mod schema;
pub mod server;
pub mod text;
pub mod wire;

pub use config::{FleetConfig, GenerationConfig, ServerConfig};
pub use faults::{FaultKind, FaultSpec};
pub use server::{ServerHandle, SimServer, Stats};

/// A running fleet. Dropping it stops every server.
pub struct Fleet {
    pub servers: Vec<ServerHandle>,
}

impl Fleet {
    /// Starts every server of the config (replicas expanded), all on loopback.
    pub async fn start(cfg: &FleetConfig) -> std::io::Result<Fleet> {
        let mut servers = Vec::new();
        for s in cfg.expanded() {
            servers.push(server::start(s, cfg.generation).await?);
        }
        Ok(Fleet { servers })
    }

    /// Starts `n` servers with the given per-server config (names `sim-0`…).
    pub async fn start_n(n: usize, template: ServerConfig) -> std::io::Result<Fleet> {
        let cfg = FleetConfig {
            generation: GenerationConfig::default(),
            servers: (0..n)
                .map(|i| ServerConfig {
                    name: format!("sim-{i}"),
                    seed: Some(i as u64 + 1),
                    ..template.clone()
                })
                .collect(),
        };
        Fleet::start(&cfg).await
    }

    pub fn get(&self, i: usize) -> &ServerHandle {
        &self.servers[i]
    }
}

/// Installs the process-wide TLS crypto provider (ring) once; every HTTP client in keel's
/// binaries and tests is built after this. Safe to call repeatedly.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A plain HTTP client for tests and tools (crypto provider installed).
pub fn http_client() -> reqwest::Client {
    install_crypto();
    reqwest::Client::new()
}
