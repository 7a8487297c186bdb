//! The tokens a keyed request really used, per serving attempt, for reconciliation: the
//! upstream's own `usage` when it reports one (OpenAI `usage.prompt_tokens` /
//! `completion_tokens`, Anthropic `usage.input_tokens` (+ cache reads and writes) /
//! `output_tokens`), otherwise keel's count of the token-carrying events it relayed and its
//! estimate of the prompt. Each attempt is priced at its own variant's prices, so a migrated
//! stream pays each segment where it ran.

use std::sync::{LazyLock, Mutex};

use keel_core::sse::SseEvent;
use keel_core::usage::{self, Reported};
use memchr::memmem;

use crate::config::VariantConfig;

/// One attempt's use.
#[derive(Debug, Clone, Default)]
struct Use {
    variant: String,
    price_in: f64,
    price_out: f64,
    input: Option<u64>,
    output: Option<u64>,
    /// Token-carrying events relayed (the fallback for `output`).
    counted: u64,
}

/// What a request used, all attempts together.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Totals {
    pub input: u64,
    pub output: u64,
    /// Micro-dollars.
    pub spend_micros: u64,
}

/// The per-attempt record of a request's usage.
#[derive(Debug, Default)]
pub struct Meter {
    uses: Mutex<Vec<Use>>,
}

/// Whether an event may report usage, without parsing it: it names `"usage"`, and not only as
/// the `"usage":null` that every chunk carries when the client asked for
/// `stream_options.include_usage` (parsing each of those into a JSON tree cost more than
/// the rest of the meter). A `"usage"` inside generated text is escaped (`\"usage\"`), so a
/// second occurrence means a second member to look at: then the event is parsed.
fn may_carry_usage(data: &str) -> bool {
    const KEY: &str = "\"usage\"";
    // A searcher built once: `str::match_indices` builds one for every call, and this runs
    // for every event of every stream (2% of keel's CPU on whole answers, in the profile).
    static FINDER: LazyLock<memmem::Finder<'static>> =
        LazyLock::new(|| memmem::Finder::new(KEY.as_bytes()));
    let mut at = FINDER.find_iter(data.as_bytes());
    let Some(first) = at.next() else {
        return false;
    };
    if at.next().is_some() {
        return true;
    }
    let rest = data[first + KEY.len()..].trim_start();
    let Some(value) = rest.strip_prefix(':') else {
        return true;
    };
    !value.trim_start().starts_with("null")
}

impl Meter {
    /// Whether no attempt has reported or relayed anything yet.
    pub fn is_empty(&self) -> bool {
        self.uses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    fn with_use(&self, variant: &VariantConfig, f: impl FnOnce(&mut Use)) {
        let mut uses = self.uses.lock().unwrap_or_else(|e| e.into_inner());
        let i = match uses.iter().position(|u| u.variant == variant.name) {
            Some(i) => i,
            None => {
                uses.push(Use {
                    variant: variant.name.clone(),
                    price_in: variant.price_input_per_mtok,
                    price_out: variant.price_output_per_mtok,
                    ..Use::default()
                });
                uses.len() - 1
            }
        };
        f(&mut uses[i]);
    }

    /// A relayed stream event (in the client's protocol) from an attempt on `variant`;
    /// `tokens`: it carries generated tokens (`stream_watch::carries_tokens`, which the relay
    /// has read already); `plain`: it was read as a plain text chunk (`EventFacts::plain`),
    /// which has no usage, so its data is not searched for one.
    pub fn event(&self, variant: &VariantConfig, ev: &SseEvent, tokens: bool, plain: bool) {
        let usage = (!plain && may_carry_usage(&ev.data))
            .then(|| usage::of(ev.data.as_bytes()).ok().flatten())
            .flatten();
        if !tokens && usage.is_none() {
            return;
        }
        self.with_use(variant, |u| {
            u.counted += tokens as u64;
            if let Some((input, output)) = usage {
                // Anthropic reports input in `message_start` and the running output total in
                // `message_delta`: keep the latest of each.
                u.input = input.or(u.input);
                u.output = output.or(u.output);
            }
        });
    }

    /// A whole answer from an attempt on `variant`: its usage as read already where its body
    /// was checked (`read`), or else read from `body`.
    pub fn whole_or_read(&self, variant: &VariantConfig, read: Option<Reported>, body: &[u8]) {
        let Some(usage) = read.or_else(|| usage::of(body).ok()) else {
            return;
        };
        let (input, output) = usage.unwrap_or_default();
        self.with_use(variant, |u| {
            u.input = input;
            u.output = output.or(Some(0));
        });
    }

    /// The totals; an attempt without a reported input is charged `estimated_input`.
    pub fn totals(&self, estimated_input: u64) -> Totals {
        let uses = self.uses.lock().unwrap_or_else(|e| e.into_inner());
        uses.iter().fold(Totals::default(), |t, u| {
            let input = u.input.unwrap_or(estimated_input);
            let output = u.output.unwrap_or(u.counted);
            // USD per million tokens = micro-dollars per token.
            let spend = input as f64 * u.price_in + output as f64 * u.price_out;
            // Counts come from upstreams: sums saturate (a cast from f64 does too).
            Totals {
                input: t.input.saturating_add(input),
                output: t.output.saturating_add(output),
                spend_micros: t.spend_micros.saturating_add(spend.ceil() as u64),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::protocol::Protocol;
    use keel_core::stream_watch::read_event;

    /// An event as the relay meters it: with the facts the relay read from it.
    fn feed(m: &Meter, v: &VariantConfig, p: Protocol, ev: &SseEvent) {
        let facts = read_event(p, ev);
        m.event(v, ev, facts.tokens, facts.plain);
    }

    #[test]
    fn null_usage_chunks_are_not_parsed_but_real_usage_is() {
        let chunk = r#"{"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}"#;
        assert!(!may_carry_usage(chunk));
        assert!(!may_carry_usage(r#"{"choices":[],"usage" : null}"#));
        assert!(!may_carry_usage(
            r#"{"choices":[{"delta":{"content":"no usage"}}]}"#
        ));
        assert!(may_carry_usage(
            r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}"#
        ));
        // Anthropic's message_delta.
        assert!(may_carry_usage(
            r#"{"type":"message_delta","usage":{"output_tokens":5}}"#
        ));
        // Text that quotes a null usage does not hide a real one.
        assert!(may_carry_usage(
            r#"{"choices":[{"delta":{"content":"say \"usage\":null"}}],"usage":{"completion_tokens":2}}"#
        ));
    }

    fn variant(name: &str, pin: f64, pout: f64) -> VariantConfig {
        let toml = format!(
            "[[pools]]\nname = \"m\"\n[[pools.variants]]\nname = \"{name}\"\nurl = \"http://x\"\nprotocol = \"openai\"\nupstream_model = \"u\"\nprice_input_per_mtok = {pin}\nprice_output_per_mtok = {pout}\n"
        );
        let cfg = crate::config::Config::parse(&toml, "t.toml", &Default::default()).unwrap();
        cfg.pools[0].variants[0].clone()
    }

    #[test]
    fn reported_usage_wins_and_counts_fill_in() {
        let a = variant("a", 2.0, 10.0);
        let b = variant("b", 1.0, 1.0);
        let m = Meter::default();
        let chunk = |d: &str| SseEvent::new(None, d);
        feed(
            &m,
            &a,
            Protocol::OpenAi,
            &chunk(r#"{"choices":[{"delta":{"content":"hi"}}]}"#),
        );
        feed(
            &m,
            &a,
            Protocol::OpenAi,
            &chunk(r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}"#),
        );
        // Migrated to b, which never reported usage: two tokens counted, the prompt estimated.
        feed(
            &m,
            &b,
            Protocol::OpenAi,
            &chunk(r#"{"choices":[{"delta":{"content":"x"}}]}"#),
        );
        feed(
            &m,
            &b,
            Protocol::OpenAi,
            &chunk(r#"{"choices":[{"delta":{"content":"y"}}]}"#),
        );
        let t = m.totals(5);
        assert_eq!((t.input, t.output), (12, 5));
        assert_eq!(t.spend_micros, 7 * 2 + 3 * 10 + 5 + 2);
    }

    /// vLLM's `continuous_usage_stats` puts usage on every text chunk: such a chunk is not
    /// read as plain text, so its usage is not skipped.
    #[test]
    fn usage_on_a_text_chunk_is_read() {
        let a = variant("a", 0.0, 0.0);
        let m = Meter::default();
        for (text, done) in [("a", 1), ("b", 2), ("c", 3)] {
            let data = format!(
                r#"{{"id":"c","choices":[{{"index":0,"delta":{{"content":"{text}"}}}}],"usage":{{"prompt_tokens":7,"completion_tokens":{done}}}}}"#
            );
            feed(&m, &a, Protocol::OpenAi, &SseEvent::new(None, &data));
        }
        let t = m.totals(99);
        assert_eq!((t.input, t.output), (7, 3));
    }

    /// Usage comes from upstreams: whatever they report, totals saturate and never wrap.
    #[test]
    fn totals_saturate() {
        let a = variant("a", 1.0, 1.0);
        let b = variant("b", 1.0, 1.0);
        let m = Meter::default();
        let max = u64::MAX;
        let body = format!(r#"{{"usage":{{"prompt_tokens":{max},"completion_tokens":{max}}}}}"#);
        m.whole_or_read(&a, None, body.as_bytes());
        m.whole_or_read(&b, None, body.as_bytes());
        let t = m.totals(0);
        assert_eq!((t.input, t.output, t.spend_micros), (max, max, max));
    }

    #[test]
    fn anthropic_usage_from_start_and_delta() {
        let a = variant("a", 0.0, 0.0);
        let m = Meter::default();
        feed(
            &m,
            &a,
            Protocol::Anthropic,
            &SseEvent::new(
                Some("message_start"),
                r#"{"type":"message_start","message":{"usage":{"input_tokens":4,"cache_read_input_tokens":2,"output_tokens":1}}}"#,
            ),
        );
        feed(
            &m,
            &a,
            Protocol::Anthropic,
            &SseEvent::new(
                Some("message_delta"),
                r#"{"type":"message_delta","usage":{"output_tokens":9}}"#,
            ),
        );
        assert_eq!(m.totals(100).input, 6);
        assert_eq!(m.totals(100).output, 9);
        let w = Meter::default();
        w.whole_or_read(
            &a,
            None,
            br#"{"usage":{"input_tokens":3,"output_tokens":2}}"#,
        );
        assert_eq!((w.totals(0).input, w.totals(0).output), (3, 2));
    }
}
