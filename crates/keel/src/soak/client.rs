//! The soak's client: one request through the gateway, read to its end in the client's
//! protocol, and judged against the simulator's reference text.
//!
//! The client never retries: every error the gateway returns is counted, because the soak keeps
//! a healthy variant in every pool at all times (see `schedule`).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

use keel_core::protocol::{event_role, ChunkView, Endpoint, EventRole, Protocol};
use keel_core::rng::Rng;
use keel_core::sse::SseDecoder;
use keel_sim::text::Generator;

/// Longest a client waits for a whole answer. Far above any fault (faults last ≤ 8 s, stalls
/// are migrated within seconds); reaching it means the gateway held a request without end.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// One request of the run.
pub struct Planned {
    pub index: usize,
    pub pool: usize,
    pub endpoint: Endpoint,
    pub stream: bool,
    pub body: Value,
    pub reference: String,
}

const TOPICS: [&str; 6] = [
    "why does a stream stall?",
    "how is a migration stitched?",
    "what does a retry budget bound?",
    "when is a hedge worth its cost?",
    "why must an answer end explicitly?",
    "how does a cold start show?",
];

/// Request `index` of a run with `seed` to pool `pool_names[pool]` (pool 0 speaks OpenAI chat,
/// pool 1 Anthropic messages): the shape is drawn from the seed, the prompt names the index so
/// that every answer differs.
pub fn plan(seed: u64, index: usize, pool_names: &[&str], generator: &Generator) -> Planned {
    let mut rng = Rng::new(keel_core::rng::mix(
        seed ^ (index as u64).wrapping_mul(0x9e37),
    ));
    let pool = (rng.next_u64() % pool_names.len() as u64) as usize;
    let stream = rng.next_f64() < 0.6;
    let max_tokens = [24, 48, 96][(rng.next_u64() % 3) as usize];
    let prompt = format!("Soak request {index}: {}", TOPICS[index % TOPICS.len()]);
    let endpoint = if pool == 1 {
        Endpoint::Messages
    } else {
        Endpoint::ChatCompletions
    };
    let mut body = json!({"model": pool_names[pool], "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "user", "content": prompt}]});
    if stream && endpoint == Endpoint::ChatCompletions {
        body["stream_options"] = json!({"include_usage": true});
    }
    let reference = crate::scenario::reference_text(generator, endpoint, &body);
    Planned {
        index,
        pool,
        endpoint,
        stream,
        body,
        reference,
    }
}

/// How an answer ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The reference text, byte for byte, with exactly one clean end.
    Intact,
    /// Text that is not a prefix of the reference (`duplicated`: longer than it), or a broken
    /// stream shape (two terminal events, invalid framing): the worst failure.
    Corrupt { duplicated: bool },
    /// A clean-looking end with less than the reference and no error: a silent truncation.
    Truncated,
    /// An error the client was told about: a status, an error event, an aborted connection.
    Error,
}

/// One answer.
#[derive(Debug, Clone)]
pub struct Seen {
    pub verdict: Verdict,
    /// Why it is not intact (status, error message, …), for the failure list.
    pub detail: String,
    pub route: String,
    pub variant: String,
    pub request_id: String,
    /// `: keel migrated` comments in the stream.
    pub migrated_comments: u32,
    pub total_us: u64,
    pub text_len: usize,
}

/// What the body of an answer held.
#[derive(Default)]
struct Read {
    text: String,
    /// Terminal events (streams) or 1 for a whole body that parsed.
    terminals: u32,
    /// An error the client was shown (event, aborted body, bad framing of the error itself).
    error: Option<String>,
    /// The stream is not well formed (framing, events after the end).
    malformed: Option<String>,
    migrated_comments: u32,
}

/// The verdict on `text` against `reference` for an answer that ended as described.
pub fn judge(reference: &str, text: &str, terminals: u32, error: bool, malformed: bool) -> Verdict {
    if !reference.starts_with(text) || malformed || terminals > 1 {
        return Verdict::Corrupt {
            duplicated: text.len() > reference.len() || terminals > 1,
        };
    }
    if error {
        Verdict::Error
    } else if terminals == 0 || text.len() < reference.len() {
        Verdict::Truncated
    } else {
        Verdict::Intact
    }
}

/// Sends `p` to the gateway at `base` (`http://host:port`) and judges the answer.
pub async fn send(client: &reqwest::Client, base: &str, p: &Planned) -> Seen {
    let started = Instant::now();
    let mut seen = Seen {
        verdict: Verdict::Error,
        detail: String::new(),
        route: String::new(),
        variant: String::new(),
        request_id: String::new(),
        migrated_comments: 0,
        total_us: 0,
        text_len: 0,
    };
    let protocol = p.endpoint.protocol();
    // Paths as the SDKs build them: OpenAI's base URL ends in `/v1`, Anthropic's does not.
    let prefix = match protocol {
        Protocol::OpenAi => "/v1",
        Protocol::Anthropic => "",
    };
    let mut req = client
        .post(format!("{base}{prefix}{}", p.endpoint.upstream_path()))
        .json(&p.body)
        .timeout(CLIENT_TIMEOUT);
    if protocol == Protocol::Anthropic {
        req = req.header("anthropic-version", "2023-06-01");
    }
    let read = match req.send().await {
        Err(e) => Err(format!("send: {e}")),
        Ok(resp) => {
            let h = |n: &str| {
                resp.headers()
                    .get(n)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned()
            };
            seen.route = h("x-keel-route");
            seen.variant = h("x-keel-variant");
            seen.request_id = h("x-keel-request-id");
            let status = resp.status().as_u16();
            if status != 200 {
                let body = resp.text().await.unwrap_or_default();
                Err(format!(
                    "status {status}: {}",
                    body.chars().take(200).collect::<String>()
                ))
            } else if p.stream {
                Ok(read_stream(resp, protocol).await)
            } else {
                Ok(read_whole(resp, protocol).await)
            }
        }
    };
    seen.total_us = started.elapsed().as_micros() as u64;
    match read {
        Err(detail) => seen.detail = detail,
        Ok(r) => {
            seen.verdict = judge(
                &p.reference,
                &r.text,
                r.terminals,
                r.error.is_some(),
                r.malformed.is_some(),
            );
            seen.migrated_comments = r.migrated_comments;
            seen.text_len = r.text.len();
            seen.detail = r
                .malformed
                .or(r.error)
                .unwrap_or_else(|| match seen.verdict {
                    Verdict::Intact => String::new(),
                    _ => format!(
                        "{} of {} bytes, {} terminal events",
                        r.text.len(),
                        p.reference.len(),
                        r.terminals
                    ),
                });
        }
    }
    seen
}

async fn read_whole(resp: reqwest::Response, protocol: Protocol) -> Read {
    let mut r = Read::default();
    let bytes = match resp.bytes().await {
        Ok(b) => b,
        Err(e) => {
            r.error = Some(format!("body: {e}"));
            return r;
        }
    };
    let Ok(v) = serde_json::from_slice::<Value>(&bytes) else {
        // A 200 whose body is cut or broken: the client was told it succeeded.
        r.malformed = Some(format!("a 200 with invalid JSON ({} bytes)", bytes.len()));
        return r;
    };
    if v.get("error").is_some_and(|e| !e.is_null()) || v["type"] == "error" {
        r.error = Some(format!("error body with 200: {v}"));
        return r;
    }
    r.terminals = 1;
    r.text = match protocol {
        Protocol::OpenAi => v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_owned(),
        Protocol::Anthropic => v["content"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|b| b["type"] == "text")
            .filter_map(|b| b["text"].as_str())
            .collect(),
    };
    r
}

async fn read_stream(resp: reqwest::Response, protocol: Protocol) -> Read {
    let mut r = Read::default();
    let mut dec = SseDecoder::new();
    let mut events = Vec::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                // An aborted body is how the gateway tells a client it cannot finish.
                r.error.get_or_insert(format!("aborted: {e}"));
                return r;
            }
        };
        if let Err(e) = dec.feed(&chunk, &mut events) {
            r.malformed = Some(format!("framing: {e}"));
            return r;
        }
        for ev in events.drain(..) {
            if ev.comment_only {
                if ev.raw.starts_with(b": keel migrated") {
                    r.migrated_comments += 1;
                }
                continue;
            }
            if r.terminals > 0 {
                r.malformed = Some("an event after the terminal event".into());
            }
            match event_role(protocol, &ev) {
                EventRole::Terminal => r.terminals += 1,
                EventRole::Error(m) => {
                    r.error.get_or_insert(format!("error event: {m}"));
                }
                EventRole::Malformed(m) => r.malformed = Some(m),
                _ => r.text.push_str(&event_text(protocol, &ev.event, &ev.data)),
            }
        }
    }
    if r.error.is_none() && dec.finish().is_err() {
        r.malformed = Some("the body ended inside an event".into());
    }
    r
}

/// The generated text one stream event carries.
fn event_text(protocol: Protocol, name: &Option<String>, data: &str) -> String {
    match protocol {
        Protocol::OpenAi => ChunkView::parse(data)
            .and_then(|v| v.text().map(str::to_owned))
            .unwrap_or_default(),
        Protocol::Anthropic if name.as_deref() == Some("content_block_delta") => {
            serde_json::from_str::<Value>(data)
                .ok()
                .and_then(|v| {
                    v.pointer("/delta/text")
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                })
                .unwrap_or_default()
        }
        Protocol::Anthropic => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let r = "one two three";
        assert_eq!(judge(r, r, 1, false, false), Verdict::Intact);
        assert_eq!(judge(r, "one two", 1, false, false), Verdict::Truncated);
        assert_eq!(judge(r, r, 0, false, false), Verdict::Truncated);
        assert_eq!(judge(r, "one two", 0, true, false), Verdict::Error);
        assert_eq!(
            judge(r, "one two two three", 1, false, false),
            Verdict::Corrupt { duplicated: true }
        );
        assert_eq!(
            judge(r, "one three", 1, false, false),
            Verdict::Corrupt { duplicated: false }
        );
        // An error after intact text is an error; text that went wrong before it is corrupt.
        assert_eq!(judge(r, "one tw", 0, true, false), Verdict::Error);
        assert_eq!(
            judge(r, "two", 0, true, false),
            Verdict::Corrupt { duplicated: false }
        );
        assert_eq!(
            judge(r, r, 2, false, false),
            Verdict::Corrupt { duplicated: true }
        );
    }

    #[test]
    fn a_seed_names_one_request_sequence() {
        let g = Generator::new("default", Default::default());
        let names = ["a", "b"];
        let a: Vec<Value> = (0..50).map(|i| plan(3, i, &names, &g).body).collect();
        let b: Vec<Value> = (0..50).map(|i| plan(3, i, &names, &g).body).collect();
        assert_eq!(a, b);
        let pools: Vec<usize> = (0..50).map(|i| plan(3, i, &names, &g).pool).collect();
        assert!(pools.contains(&0) && pools.contains(&1));
        assert!(!plan(3, 1, &names, &g).reference.is_empty());
    }
}
