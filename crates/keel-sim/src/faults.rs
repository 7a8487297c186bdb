//! Fault injection. A fault is a kind with parameters and a trigger (`rate`: probability per
//! request; `count`: the next N requests, after which it expires). Faults come from config or at
//! runtime from `POST /sim/faults` (one object or an array) and are cleared by
//! `DELETE /sim/faults`. Each server has its own list, so every fault is scoped to one server.
//!
//! For every request the active faults are resolved once into a [`RequestFaults`]: a plain
//! description of what will go wrong with this request, which the server then acts out.

use serde::{Deserialize, Serialize};

use keel_core::rng::Rng;

/// Names of the fault kinds.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// Answer with an error status (`status`: 429, 500, 503, 529, …; optional `retry_after_s`).
    Error,
    /// Close the connection before sending response headers.
    Reset,
    /// Send nothing for `ms` (or forever when absent) before the response head.
    Hang,
    /// Stop sending after `after_tokens` tokens for `ms` (or forever when absent).
    Stall,
    /// Drop the connection after `after_tokens` tokens.
    Close,
    /// Multiply inter-token gaps by `factor`.
    Slowdown,
    /// Add `extra_ms` to time to first token (for `count` requests: a cold start).
    ColdStart,
    /// Send a malformed SSE chunk after `after_tokens` tokens (non-streaming: a truncated body).
    Malformed,
    /// A sick instance (a GPU out of memory): `error_rate` of requests fail with 503, the rest are
    /// `factor` times slower.
    Degraded,
    /// Added network delay of `ms` before the response head.
    Delay,
    /// Answer 503 `Loading model`, as llama.cpp does while it loads its model (with `count`:
    /// the server becomes ready after that many requests; with `ms`: that long after the fault
    /// was added). `GET /health` answers 503 while it is active.
    Loading,
    /// Refuse connections for `ms` (a process restarting: the listener is closed and every
    /// open connection dropped, then the server listens again on the same port).
    Refuse,
    /// Answer a streamed request with the whole JSON body, as servers that ignore `stream` do.
    IgnoreStream,
    /// Answer with exactly `body` (status `status`, default 200; content type
    /// `content_type`, default `application/json`): a broken or hostile upstream, byte for
    /// byte, or a provider's own error answer.
    Raw,
    /// End the reply after `after_tokens` tokens with `finish_reason: "length"` (Anthropic
    /// `stop_reason: "max_tokens"`), whatever the request's `max_tokens`: an upstream that cuts
    /// answers below the client's limit (a server-side cap).
    Truncate,
    /// Make a structured (`response_format` JSON) reply invalid JSON: its last character is
    /// dropped (an unclosed object). Replies that are not structured are left alone.
    InvalidJson,
    /// End a stream after `after_tokens` tokens with the protocol's in-stream error (`status`,
    /// default 529: Anthropic `event: error` `overloaded_error`, an OpenAI `error` chunk,
    /// Gemini's `error` chunk, a Bedrock `:message-type: exception` frame
    /// (`throttlingException` for 429, `serviceUnavailableException` for 503/529,
    /// `modelStreamErrorException` otherwise), a Responses `error` event). Whole answers are
    /// left alone.
    StreamError,
    /// End a text reply after `after_tokens` tokens with the provider's safety stop (OpenAI
    /// `finish_reason: "content_filter"`, Anthropic `stop_reason: "refusal"`, Gemini
    /// `finishReason: "SAFETY"`, Bedrock `stopReason: "content_filtered"`, Responses
    /// `incomplete` for `content_filter`): a finished answer, not an error.
    Refusal,
    /// Answer text replies with `body` (as a fixed answer: its text after any prefill),
    /// streamed token by token; tool calls are left alone. Not a failure: a script for tests
    /// that need to know what the model says (keel's guard restoring placeholders).
    Answer,
}

/// One configured fault.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    pub kind: FaultKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_rate: Option<f64>,
    /// Probability that the fault applies to a request (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// Apply to the next `count` requests only, then expire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// `raw`: the response body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// `raw`: the response content type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
}

impl FaultSpec {
    pub fn new(kind: FaultKind) -> Self {
        FaultSpec {
            kind,
            status: None,
            retry_after_s: None,
            ms: None,
            after_tokens: None,
            factor: None,
            extra_ms: None,
            error_rate: None,
            rate: None,
            count: None,
            body: None,
            content_type: None,
        }
    }

    /// Checks the parameters the kind needs; the error starts with the field name.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(r) = self.rate {
            if !(0.0..=1.0).contains(&r) {
                return Err("rate: must be between 0 and 1".into());
            }
        }
        match self.kind {
            FaultKind::Error => match self.status {
                Some(s) if (400..=599).contains(&s) => Ok(()),
                Some(_) => Err("status: must be an HTTP error status (400–599)".into()),
                None => Err("status: required for kind \"error\" (e.g. 429, 500, 503, 529)".into()),
            },
            FaultKind::Stall
            | FaultKind::Close
            | FaultKind::Malformed
            | FaultKind::Truncate
            | FaultKind::StreamError
            | FaultKind::Refusal
                if self.after_tokens.is_none() =>
            {
                Err(format!(
                    "after_tokens: required for kind \"{}\"",
                    kind_name(self.kind)
                ))
            }
            FaultKind::Slowdown if !self.factor.is_some_and(|f| f.is_finite() && f >= 1.0) => {
                Err("factor: required for kind \"slowdown\", a number ≥ 1".into())
            }
            FaultKind::ColdStart if self.extra_ms.is_none() => {
                Err("extra_ms: required for kind \"cold_start\"".into())
            }
            FaultKind::Delay if self.ms.is_none() => Err("ms: required for kind \"delay\"".into()),
            FaultKind::Refuse if self.ms.is_none() => {
                Err("ms: required for kind \"refuse\" (how long connections are refused)".into())
            }
            FaultKind::Raw if self.body.is_none() => Err("body: required for kind \"raw\"".into()),
            FaultKind::Answer if self.body.is_none() => {
                Err("body: required for kind \"answer\" (the answer's text)".into())
            }
            FaultKind::Degraded if self.error_rate.is_some_and(|r| !(0.0..=1.0).contains(&r)) => {
                Err("error_rate: must be between 0 and 1".into())
            }
            _ => Ok(()),
        }
    }
}

fn kind_name(k: FaultKind) -> String {
    serde_json::to_value(k)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// What goes wrong with one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestFaults {
    pub error: Option<(u16, Option<f64>)>,
    pub reset: bool,
    /// `Some(None)`: hang forever.
    pub hang_ms: Option<Option<u64>>,
    /// (after tokens, for ms or forever).
    pub stall: Option<(u64, Option<u64>)>,
    pub close_after: Option<u64>,
    pub malformed_after: Option<u64>,
    pub gap_factor: f64,
    pub ttft_factor: f64,
    pub extra_ttft_ms: u64,
    pub ignore_stream: bool,
    pub loading: bool,
    /// (status, content type, body) answered verbatim.
    pub raw: Option<(u16, String, String)>,
    /// End the reply for length after this many tokens.
    pub truncate_after: Option<u64>,
    pub invalid_json: bool,
    /// (after tokens, status): end the stream with an in-stream error.
    pub stream_error: Option<(u64, u16)>,
    /// End the reply with a safety stop after this many tokens.
    pub refuse_after: Option<u64>,
    /// The text to answer with (`answer`).
    pub answer: Option<String>,
}

/// A server's active faults with their remaining counts (and, for a timed `loading`, when
/// it ends).
#[derive(Debug, Default)]
pub struct FaultSet {
    active: Vec<(FaultSpec, Option<u64>)>,
    /// Index-aligned with `active`: when a timed fault expires.
    until: Vec<Option<std::time::Instant>>,
}

impl FaultSet {
    pub fn add(&mut self, f: FaultSpec) {
        let remaining = f.count;
        let until = match f.kind {
            FaultKind::Loading => {
                f.ms.map(|ms| std::time::Instant::now() + std::time::Duration::from_millis(ms))
            }
            _ => None,
        };
        self.active.push((f, remaining));
        self.until.push(until);
    }

    /// Drops the faults whose count or time is used up.
    fn expire(&mut self) {
        let now = std::time::Instant::now();
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].1 == Some(0) || self.until[i].is_some_and(|t| now >= t) {
                self.active.remove(i);
                self.until.remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Whether `GET /health` answers that the model is still loading: a `loading` fault is
    /// active (a counted one counts this request too, as the server would be asked again).
    pub fn health_loading(&mut self) -> bool {
        self.expire();
        let hit = self
            .active
            .iter_mut()
            .find(|(f, _)| f.kind == FaultKind::Loading);
        match hit {
            Some((_, remaining)) => {
                if let Some(r) = remaining {
                    *r -= 1;
                }
                self.expire();
                true
            }
            None => false,
        }
    }

    pub fn clear(&mut self) {
        self.active.clear();
        self.until.clear();
    }

    pub fn list(&self) -> Vec<FaultSpec> {
        self.active.iter().map(|(f, _)| f.clone()).collect()
    }

    /// Resolves the faults for one request, consuming counts.
    pub fn resolve(&mut self, rng: &mut Rng) -> RequestFaults {
        let mut out = RequestFaults {
            gap_factor: 1.0,
            ttft_factor: 1.0,
            ..Default::default()
        };
        self.expire();
        for (f, remaining) in &mut self.active {
            if *remaining == Some(0) {
                continue;
            }
            if let Some(rate) = f.rate {
                if rng.next_f64() >= rate {
                    continue;
                }
            }
            if let Some(r) = remaining {
                *r -= 1;
            }
            match f.kind {
                FaultKind::Error => {
                    if out.error.is_none() {
                        out.error = Some((f.status.unwrap_or(500), f.retry_after_s));
                    }
                }
                FaultKind::Reset => out.reset = true,
                FaultKind::Hang => out.hang_ms = Some(f.ms),
                FaultKind::Stall => out.stall = Some((f.after_tokens.unwrap_or(0), f.ms)),
                FaultKind::Close => out.close_after = Some(f.after_tokens.unwrap_or(0)),
                FaultKind::Malformed => out.malformed_after = Some(f.after_tokens.unwrap_or(0)),
                FaultKind::Slowdown => out.gap_factor *= f.factor.unwrap_or(1.0),
                FaultKind::ColdStart => out.extra_ttft_ms += f.extra_ms.unwrap_or(0),
                FaultKind::Delay => out.extra_ttft_ms += f.ms.unwrap_or(0),
                FaultKind::IgnoreStream => out.ignore_stream = true,
                FaultKind::Truncate => out.truncate_after = Some(f.after_tokens.unwrap_or(0)),
                FaultKind::InvalidJson => out.invalid_json = true,
                FaultKind::Refusal => out.refuse_after = Some(f.after_tokens.unwrap_or(0)),
                FaultKind::Answer => out.answer = f.body.clone(),
                FaultKind::StreamError => {
                    out.stream_error = Some((f.after_tokens.unwrap_or(0), f.status.unwrap_or(529)))
                }
                FaultKind::Loading => out.loading = true,
                // Acted out by the listener (see `server`), never by a request.
                FaultKind::Refuse => {}
                FaultKind::Raw => {
                    let ct = f.content_type.clone();
                    out.raw = Some((
                        f.status.unwrap_or(200),
                        ct.unwrap_or_else(|| "application/json".into()),
                        f.body.clone().unwrap_or_default(),
                    ));
                }
                FaultKind::Degraded => {
                    if rng.next_f64() < f.error_rate.unwrap_or(0.3) {
                        if out.error.is_none() {
                            out.error = Some((f.status.unwrap_or(503), f.retry_after_s));
                        }
                    } else {
                        let k = f.factor.unwrap_or(4.0);
                        out.gap_factor *= k;
                        out.ttft_factor *= k;
                    }
                }
            }
        }
        self.expire();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_faults_expire() {
        let mut set = FaultSet::default();
        let mut f = FaultSpec::new(FaultKind::Error);
        f.status = Some(503);
        f.count = Some(2);
        set.add(f);
        let mut rng = Rng::new(1);
        assert_eq!(set.resolve(&mut rng).error, Some((503, None)));
        assert_eq!(set.resolve(&mut rng).error, Some((503, None)));
        assert_eq!(set.resolve(&mut rng).error, None);
        assert!(set.list().is_empty());
    }

    #[test]
    fn rate_applies_to_a_share() {
        let mut set = FaultSet::default();
        let mut f = FaultSpec::new(FaultKind::Reset);
        f.rate = Some(0.25);
        set.add(f);
        let mut rng = Rng::new(9);
        let hits = (0..4000).filter(|_| set.resolve(&mut rng).reset).count();
        assert!((800..1200).contains(&hits), "{hits}");
    }

    #[test]
    fn timed_loading_expires_and_health_sees_it() {
        let mut set = FaultSet::default();
        let mut f = FaultSpec::new(FaultKind::Loading);
        f.ms = Some(30);
        set.add(f);
        let mut rng = Rng::new(1);
        assert!(set.health_loading());
        assert!(set.resolve(&mut rng).loading);
        std::thread::sleep(std::time::Duration::from_millis(40));
        assert!(!set.health_loading());
        assert!(!set.resolve(&mut rng).loading);
        assert!(set.list().is_empty());
        // A counted one: health checks count too.
        let mut f = FaultSpec::new(FaultKind::Loading);
        f.count = Some(2);
        set.add(f);
        assert!(set.health_loading());
        assert!(set.resolve(&mut rng).loading);
        assert!(!set.health_loading());
        let refuse = FaultSpec::new(FaultKind::Refuse);
        assert!(refuse.validate().unwrap_err().starts_with("ms:"));
    }

    #[test]
    fn truncate_and_invalid_json_resolve() {
        let f: FaultSpec = serde_json::from_str(r#"{"kind":"truncate"}"#).unwrap();
        assert!(f.validate().unwrap_err().starts_with("after_tokens:"));
        let mut set = FaultSet::default();
        set.add(serde_json::from_str(r#"{"kind":"truncate","after_tokens":5,"count":1}"#).unwrap());
        set.add(serde_json::from_str(r#"{"kind":"invalid_json"}"#).unwrap());
        let mut rng = Rng::new(3);
        let first = set.resolve(&mut rng);
        assert_eq!((first.truncate_after, first.invalid_json), (Some(5), true));
        let second = set.resolve(&mut rng);
        assert_eq!((second.truncate_after, second.invalid_json), (None, true));
    }

    #[test]
    fn json_errors_name_the_field() {
        let e = serde_json::from_str::<FaultSpec>(r#"{"kind":"stall","afterr":3}"#).unwrap_err();
        assert!(e.to_string().contains("afterr"));
        let f: FaultSpec = serde_json::from_str(r#"{"kind":"error"}"#).unwrap();
        assert!(f.validate().unwrap_err().starts_with("status:"));
    }
}
