//! Fleet configuration: what each simulated server is like (latency, capacity, cache, auth,
//! conventions) and which faults it starts with. Read from TOML (`keel sim --config sim.toml`)
//! or built in code by tests.

use serde::{Deserialize, Serialize};

use crate::faults::FaultSpec;

/// The whole fleet.
#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    #[serde(default)]
    pub generation: GenerationConfig,
    #[serde(default)]
    pub servers: Vec<ServerConfig>,
}

/// How text is generated. Shared by the fleet: two servers of one `family` given one prompt
/// produce the same text, which is what makes exact continuation on another server possible.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GenerationConfig {
    /// A chat reply never ends on its own before this many tokens.
    pub min_reply_tokens: u32,
    /// Approximate mean length of a chat reply that ends on its own.
    pub mean_reply_tokens: u32,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        GenerationConfig {
            min_reply_tokens: 16,
            mean_reply_tokens: 48,
        }
    }
}

/// Whether a final assistant message is continued (a prefill) on the OpenAI-compatible chat
/// endpoint: vLLM and SGLang need `continue_final_message: true`; llama.cpp always continues.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum PrefillConvention {
    #[default]
    Explicit,
    Always,
}

/// One simulated server.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub name: String,
    /// Servers of one family generate identical text for identical prompts.
    pub family: String,
    /// Copies of this entry to start (names get `-1`, `-2`, … suffixes).
    pub replicas: u32,
    /// Port on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    /// Model names served; empty accepts any name.
    pub models: Vec<String>,
    /// When set, requests must carry it (`Authorization: Bearer` or `x-api-key`), else 401.
    pub api_key: Option<String>,
    pub assistant_prefill: PrefillConvention,
    /// Refuse assistant prefill as Anthropic's newer models do (Claude Sonnet 4.6, Opus 4.6
    /// and later): a conversation ending in an assistant message gets a 400
    /// `invalid_request_error`, "This model does not support assistant message prefill. The
    /// conversation must end with a user message." (in the endpoint's protocol's error shape).
    pub refuse_prefill: bool,
    /// Asked to continue a cut-off answer (keel's `instruction` resume: the answer as an
    /// assistant message, then a user message asking to continue it), the simulated model
    /// continues it as a real one tends to: in a new message (its first word without the
    /// leading space), repeating between 0 and this many of the answer's last tokens (how many
    /// is drawn per request from its text).
    pub instruction_echo_tokens: u32,
    /// A fixed answer: every chat or completion reply is this text (a JSON text for a
    /// structured request), whatever the prompt, so that servers can be made to disagree on
    /// purpose (consensus tests). A continuation (prefill) gets the rest of it.
    pub answer: Option<String>,
    /// When set, a prompt (by keel's tokenizer rule) plus `max_tokens` larger than this is
    /// refused with 400 as real servers do: OpenAI's `context_length_exceeded` ("This model's
    /// maximum context length is …"), Anthropic's "prompt is too long: N tokens > M maximum".
    pub context_window: Option<u64>,
    /// Median base time to first token.
    pub ttft_ms: f64,
    /// Lognormal shape of TTFT jitter (0 = none).
    pub ttft_sigma: f64,
    /// Prefill cost per prompt token not found in the simulated KV cache.
    pub prefill_us_per_token: f64,
    /// Median gap between output tokens.
    pub gap_ms: f64,
    /// Lognormal shape of inter-token gaps (0 = none).
    pub gap_sigma: f64,
    /// Concurrent sequences; more requests queue.
    pub capacity: u32,
    /// When this many requests already wait, answer 429 with `retry_after_s` instead of queueing
    /// (a saturated hosted API); unset: queue without bound.
    pub max_waiting: Option<u32>,
    pub retry_after_s: f64,
    /// Gaps stretch by `1 + load_stretch × running / capacity`.
    pub load_stretch: f64,
    /// Heavy tail: probability that a request is `tail_factor` times slower.
    pub tail_prob: f64,
    pub tail_factor: f64,
    /// Simulated KV cache size in blocks of `block_tokens` prompt tokens.
    pub kv_cache_blocks: u32,
    pub block_tokens: u32,
    /// Cold start: the first N requests after start (or after faults are cleared) pay extra TTFT.
    pub cold_start_requests: u32,
    pub cold_start_extra_ms: u64,
    /// Length of the vectors `POST /v1/embeddings` returns when the request gives no
    /// `dimensions`.
    pub embedding_dimensions: u32,
    /// Seed for this server's latency draws (defaults to its position in the fleet).
    pub seed: Option<u64>,
    /// Faults active from start.
    pub faults: Vec<FaultSpec>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            name: String::new(),
            family: "default".into(),
            replicas: 1,
            port: 0,
            models: Vec::new(),
            api_key: None,
            assistant_prefill: PrefillConvention::Explicit,
            refuse_prefill: false,
            instruction_echo_tokens: 2,
            answer: None,
            context_window: None,
            ttft_ms: 40.0,
            ttft_sigma: 0.25,
            prefill_us_per_token: 200.0,
            gap_ms: 12.0,
            gap_sigma: 0.2,
            capacity: 32,
            max_waiting: None,
            retry_after_s: 1.0,
            load_stretch: 0.5,
            tail_prob: 0.0,
            tail_factor: 10.0,
            kv_cache_blocks: 4096,
            block_tokens: 16,
            cold_start_requests: 0,
            cold_start_extra_ms: 0,
            embedding_dimensions: 256,
            seed: None,
            faults: Vec::new(),
        }
    }
}

impl ServerConfig {
    /// A server with no jitter and tiny delays: what most wire tests want.
    pub fn fast(name: &str) -> Self {
        ServerConfig {
            name: name.into(),
            ttft_ms: 2.0,
            ttft_sigma: 0.0,
            prefill_us_per_token: 0.0,
            gap_ms: 1.0,
            gap_sigma: 0.0,
            ..Default::default()
        }
    }
}

/// A configuration error naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl FleetConfig {
    /// `n` default servers named `sim-0` … `sim-{n-1}`.
    pub fn uniform(n: usize) -> Self {
        FleetConfig {
            generation: GenerationConfig::default(),
            servers: (0..n)
                .map(|i| ServerConfig {
                    name: format!("sim-{i}"),
                    ..Default::default()
                })
                .collect(),
        }
    }

    /// Parses TOML; `origin` (a file name) prefixes every error.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let cfg: FleetConfig = toml::from_str(text).map_err(|e| {
            let pos = e
                .span()
                .map(|s| {
                    let line = text[..s.start].matches('\n').count() + 1;
                    let col = s.start - text[..s.start].rfind('\n').map(|i| i + 1).unwrap_or(0) + 1;
                    format!(":{line}:{col}")
                })
                .unwrap_or_default();
            ConfigError(format!("{origin}{pos}: {}", e.message()))
        })?;
        cfg.validate()
            .map_err(|e| ConfigError(format!("{origin}: {}", e.0)))?;
        Ok(cfg)
    }

    /// Checks value ranges; errors name the field as `servers[i].field`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let g = &self.generation;
        if g.mean_reply_tokens <= g.min_reply_tokens {
            return Err(ConfigError(
                "generation.mean_reply_tokens: must be greater than min_reply_tokens".into(),
            ));
        }
        if self.servers.is_empty() {
            return Err(ConfigError(
                "servers: at least one [[servers]] entry is required".into(),
            ));
        }
        for (i, s) in self.servers.iter().enumerate() {
            let field = |f: &str, what: &str| Err(ConfigError(format!("servers[{i}].{f}: {what}")));
            if s.capacity == 0 {
                return field("capacity", "must be at least 1");
            }
            if s.replicas == 0 {
                return field("replicas", "must be at least 1");
            }
            if s.block_tokens == 0 {
                return field("block_tokens", "must be at least 1");
            }
            if s.embedding_dimensions == 0 {
                return field("embedding_dimensions", "must be at least 1");
            }
            for (name, v) in [
                ("ttft_ms", s.ttft_ms),
                ("ttft_sigma", s.ttft_sigma),
                ("prefill_us_per_token", s.prefill_us_per_token),
                ("gap_ms", s.gap_ms),
                ("gap_sigma", s.gap_sigma),
                ("load_stretch", s.load_stretch),
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return field(name, "must be a finite number ≥ 0");
                }
            }
            if !(0.0..=1.0).contains(&s.tail_prob) {
                return field("tail_prob", "must be between 0 and 1");
            }
            if !(s.tail_factor.is_finite() && s.tail_factor >= 1.0) {
                return field("tail_factor", "must be ≥ 1");
            }
            if s.port != 0 && s.replicas > 1 {
                return field(
                    "port",
                    "a fixed port cannot be shared by several replicas (use port = 0)",
                );
            }
            for (j, f) in s.faults.iter().enumerate() {
                f.validate()
                    .map_err(|e| ConfigError(format!("servers[{i}].faults[{j}].{e}")))?;
            }
        }
        Ok(())
    }

    /// This fleet as run `seed` of a benchmark draws it: replicas expanded, and each server
    /// that sets no `seed` of its own seeded from `seed` and its place in the fleet, so that
    /// runs with different seeds draw different latencies and faults (with the servers' own
    /// default seeds every run drew alike, whatever its arrivals), and runs with one seed
    /// alike. Seed 1 draws as the fleet started as it is.
    pub fn seeded(&self, seed: u64) -> FleetConfig {
        let own: Vec<bool> = self
            .servers
            .iter()
            .flat_map(|s| std::iter::repeat_n(s.seed.is_some(), s.replicas as usize))
            .collect();
        let mut servers = self.expanded();
        for (i, (c, own)) in servers.iter_mut().zip(own).enumerate() {
            if !own {
                c.seed = Some((seed.wrapping_sub(1) << 32).wrapping_add(i as u64 + 1));
            }
        }
        FleetConfig {
            generation: self.generation,
            servers,
        }
    }

    /// The servers to start, with replicas expanded and names filled in.
    pub fn expanded(&self) -> Vec<ServerConfig> {
        let mut out = Vec::new();
        for (i, s) in self.servers.iter().enumerate() {
            let base = if s.name.is_empty() {
                format!("sim-{i}")
            } else {
                s.name.clone()
            };
            for r in 0..s.replicas {
                let mut c = s.clone();
                c.replicas = 1;
                c.name = if s.replicas > 1 {
                    format!("{base}-{r}")
                } else {
                    base.clone()
                };
                if c.seed.is_none() {
                    c.seed = Some(out.len() as u64 + 1);
                }
                out.push(c);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_field_is_named_with_position() {
        let e = FleetConfig::from_toml("[[servers]]\nname = \"a\"\ncapacty = 3\n", "sim.toml")
            .unwrap_err();
        assert!(e.0.starts_with("sim.toml:3:1"), "{}", e.0);
        assert!(e.0.contains("capacty"), "{}", e.0);
    }

    #[test]
    fn range_errors_name_the_field() {
        let e = FleetConfig::from_toml("[[servers]]\ncapacity = 0\n", "sim.toml").unwrap_err();
        assert_eq!(e.0, "sim.toml: servers[0].capacity: must be at least 1");
        let e = FleetConfig::from_toml("[[servers]]\n[[servers.faults]]\nkind = \"stall\"\n", "f")
            .unwrap_err();
        assert!(e.0.contains("servers[0].faults[0].after_tokens"), "{}", e.0);
    }

    #[test]
    fn replicas_expand() {
        let c = FleetConfig::from_toml("[[servers]]\nname = \"gpu\"\nreplicas = 3\n", "x").unwrap();
        let names: Vec<_> = c.expanded().into_iter().map(|s| s.name).collect();
        assert_eq!(names, vec!["gpu-0", "gpu-1", "gpu-2"]);
    }

    #[test]
    fn a_runs_seed_seeds_every_server_without_its_own() {
        let c = FleetConfig::from_toml(
            "[[servers]]\nname = \"gpu\"\nreplicas = 2\n[[servers]]\nname = \"own\"\nseed = 7\n",
            "x",
        )
        .unwrap();
        let seeds = |run: u64| -> Vec<Option<u64>> {
            c.seeded(run).servers.iter().map(|s| s.seed).collect()
        };
        // Seed 1 draws as the fleet does unseeded; another run differently; a set seed stays.
        let plain: Vec<Option<u64>> = c.expanded().iter().map(|s| s.seed).collect();
        assert_eq!(seeds(1), plain);
        assert_eq!(
            seeds(2),
            [Some((1 << 32) + 1), Some((1 << 32) + 2), Some(7)]
        );
        assert_eq!(seeds(2), seeds(2));
        let names: Vec<String> = c.seeded(2).servers.into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["gpu-0", "gpu-1", "own"]);
        // Started again from its expanded form, the fleet keeps its names and seeds.
        let again = c.seeded(3);
        assert_eq!(again.seeded(3).servers.len(), 3);
        assert_eq!(again.expanded()[1].seed, again.servers[1].seed);
    }
}
