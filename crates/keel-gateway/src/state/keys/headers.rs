//! The rate-limit headers of a keyed request, in the client's protocol, for the limits the key
//! has: OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (reset as a duration
//! such as `6m0s` or `120ms`) or Anthropic's `anthropic-ratelimit-{requests,tokens}-{limit,
//! remaining,reset}` (reset as an RFC 3339 UTC instant).

use http::{HeaderMap, HeaderName, HeaderValue};

use keel_core::protocol::Protocol;
use keel_core::quota::budget::civil_from_days;

use crate::state::quota::Limit;

/// One rate limit as seen by a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateView {
    pub limit: Limit,
    /// The configured limit per minute.
    pub max: u64,
    pub remaining: u64,
    /// Until the allowance is full again.
    pub reset_ns: u64,
}

/// OpenAI's duration format: `1s`, `6m0s`, `1h2m3s`, `120ms` (whole milliseconds below a
/// second; above, seconds rounded up).
pub fn openai_duration(ns: u64) -> String {
    let ms = ns.div_ceil(1_000_000);
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = ms.div_ceil(1000);
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m{s}s"),
    }
}

/// An RFC 3339 UTC instant, to the second, from Unix milliseconds (rounded up: the limit is
/// whole again by then).
pub fn rfc3339(unix_ms: u64) -> String {
    let secs = unix_ms.div_ceil(1000);
    let (y, mo, d) = civil_from_days((secs / 86_400) as i64);
    let t = secs % 86_400;
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}Z",
        t / 3600,
        t / 60 % 60,
        t % 60
    )
}

fn put(h: &mut HeaderMap, name: String, value: String) {
    if let (Ok(n), Ok(v)) = (
        HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(&value),
    ) {
        h.insert(n, v);
    }
}

/// Sets the headers for `views`, as of `now_unix_ms`.
pub fn apply(h: &mut HeaderMap, protocol: Protocol, views: &[RateView], now_unix_ms: u64) {
    for v in views {
        let what = v.limit.as_str();
        match protocol {
            Protocol::OpenAi => {
                put(h, format!("x-ratelimit-limit-{what}"), v.max.to_string());
                put(
                    h,
                    format!("x-ratelimit-remaining-{what}"),
                    v.remaining.to_string(),
                );
                put(
                    h,
                    format!("x-ratelimit-reset-{what}"),
                    openai_duration(v.reset_ns),
                );
            }
            Protocol::Anthropic => {
                put(
                    h,
                    format!("anthropic-ratelimit-{what}-limit"),
                    v.max.to_string(),
                );
                put(
                    h,
                    format!("anthropic-ratelimit-{what}-remaining"),
                    v.remaining.to_string(),
                );
                let at = now_unix_ms.saturating_add(v.reset_ns.div_ceil(1_000_000));
                put(h, format!("anthropic-ratelimit-{what}-reset"), rfc3339(at));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_openai_format() {
        assert_eq!(openai_duration(0), "0ms");
        assert_eq!(openai_duration(120_000_000), "120ms");
        assert_eq!(openai_duration(119_500_000), "120ms");
        assert_eq!(openai_duration(1_000_000_000), "1s");
        assert_eq!(openai_duration(360_000_000_000), "6m0s");
        assert_eq!(openai_duration(3_723_000_000_000), "1h2m3s");
    }

    #[test]
    fn instants_in_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        // 2024-02-29T12:34:56Z is 1709210096.
        assert_eq!(rfc3339(1_709_210_096_000), "2024-02-29T12:34:56Z");
        assert_eq!(rfc3339(1_709_210_095_001), "2024-02-29T12:34:56Z");
    }

    #[test]
    fn headers_by_protocol() {
        let v = [RateView {
            limit: Limit::Requests,
            max: 10,
            remaining: 9,
            reset_ns: 6_000_000_000,
        }];
        let mut h = HeaderMap::new();
        apply(&mut h, Protocol::OpenAi, &v, 0);
        assert_eq!(h["x-ratelimit-limit-requests"], "10");
        assert_eq!(h["x-ratelimit-remaining-requests"], "9");
        assert_eq!(h["x-ratelimit-reset-requests"], "6s");
        assert!(!h.contains_key("x-ratelimit-limit-tokens"));
        let mut h = HeaderMap::new();
        apply(&mut h, Protocol::Anthropic, &v, 1_709_210_090_000);
        assert_eq!(h["anthropic-ratelimit-requests-limit"], "10");
        assert_eq!(
            h["anthropic-ratelimit-requests-reset"],
            "2024-02-29T12:34:56Z"
        );
    }
}
