//! Context fit at admission: the prompt counted by the tokenizers of the pool's variants, and,
//! for a pool with `transforms = ["middle-out"]`, whole messages dropped from the middle of a
//! conversation that no variant's context window can hold. Selection then only considers
//! variants whose window holds the estimate plus `max_tokens` (`Selection::TooLong` when none
//! does: an immediate 400 naming the sizes).
//!
//! **Which count.** A pool's variants may count differently (an o200k model and a local one
//! counted by the rule). The estimate is the largest of the counts by each distinct tokenizer
//! in the pool: one to three passes over the prompt, each bounded (below), and conservative for
//! every variant, which is what refusing and quota reservations need. Counting per variant
//! would refine fit only for pools mixing tokenizers, at the price of a count per variant.
//!
//! **Bounded work.** Counting stops once the count passes the largest context window when every
//! variant has one (a 9 MB prompt is refused after reading about as much text as the window
//! holds, or at once from its byte length), else past [`ESTIMATE_CAP_TOKENS`]. Admission runs
//! it with normalization (`prompt_work`), after the key's request limits, on tokio's blocking
//! pool for bodies larger than [`BLOCKING_BYTES`] (or [`BPE_BLOCKING_BYTES`] where a variant
//! counts by a byte-pair encoding: 32 KiB of it takes about 0.3 ms by o200k or cl100k)
//! so that the count does not hold up other requests' IO.
//!
//! **Kept counts.** A long text counted by a byte-pair encoding is kept by its hash in the
//! pool's [`TokenCounts`](crate::state::token_counts::TokenCounts) and looked up there the next
//! time it comes (a system prompt, a conversation's earlier turns): such a request's estimate
//! costs a hash of its prompt and a count of what is new in it (`keel_bpe_texts_total{pool,count}`:
//! `counted` and `kept`).

use keel_core::fit;
use keel_core::members::Members;
use keel_core::request::CanonicalRequest;
use keel_core::tokens::{Estimate, Memo, Tokenizer};
use serde_json::Value;

use crate::state::pools::Pool;

/// Where counting stops when some variant has no configured window (the estimate is then a
/// lower bound; 1 Mi tokens is beyond every model's window today).
pub const ESTIMATE_CAP_TOKENS: u64 = 1 << 20;

/// Request bodies larger than this are counted on the blocking pool.
pub const BLOCKING_BYTES: usize = 256 * 1024;

/// [`BLOCKING_BYTES`] for a pool where some variant counts by a byte-pair encoding.
pub const BPE_BLOCKING_BYTES: usize = 32 * 1024;

/// The body size beyond which `pool`'s prompt work runs on the blocking pool.
pub fn blocking_bytes(pool: &Pool) -> usize {
    match pool.counts_by_bpe() {
        true => BPE_BLOCKING_BYTES,
        false => BLOCKING_BYTES,
    }
}

/// The `x-keel-prompt-fix` code of a middle-out trim.
pub const MIDDLE_OUT_FIX: &str = "middle_out_trimmed";

/// The header that says how many messages middle-out dropped.
pub const TRIMMED_HEADER: http::HeaderName =
    http::HeaderName::from_static("x-keel-trimmed-messages");

/// The prompt's estimate by the most conservative of `tokenizers`, counting stopped past `cap`.
fn estimate(
    body: &serde_json::Map<String, Value>,
    tokenizers: &[Tokenizer],
    cap: u64,
    memo: &dyn Memo,
) -> Estimate {
    tokenizers
        .iter()
        .map(|t| fit::prompt_tokens(body, *t, cap, Some(memo)))
        .max_by_key(|e| e.tokens)
        .unwrap_or_default()
}

/// Sets `req`'s estimate by the pool's tokenizers and applies middle-out where the pool has it
/// and the prompt fits no window. Returns how many messages middle-out dropped (0: none).
pub fn apply(pool: &Pool, req: &mut CanonicalRequest) -> usize {
    if !req.endpoint.generates() && req.endpoint != keel_core::protocol::Endpoint::CountTokens {
        // Embeddings inputs are counted per item at parsing (token-id arrays have no text).
        return 0;
    }
    let tokenizers = pool.tokenizers();
    let window = pool.largest_window();
    let cap = window.unwrap_or(ESTIMATE_CAP_TOKENS);
    let est = estimate(&req.body, &tokenizers, cap, &pool.token_counts);
    set(req, est);
    let output = req.max_tokens.unwrap_or(0);
    let Some(window) = window.filter(|w| {
        pool.cfg.middle_out && !pool.safety.active() && est.tokens.saturating_add(output) > *w
    }) else {
        return 0;
    };
    let trimmed = middle_out(pool, req, &tokenizers, window.saturating_sub(output));
    if trimmed > 0 {
        set(
            req,
            estimate(&req.body, &tokenizers, cap, &pool.token_counts),
        );
    }
    trimmed
}

fn set(req: &mut CanonicalRequest, est: Estimate) {
    req.estimated_input_tokens = est.tokens;
    req.estimate_is_lower_bound = est.lower_bound;
}

/// Drops messages so that the prompt fits `budget` tokens; returns how many were dropped (0
/// when even the messages always kept do not fit: selection then refuses with the sizes).
fn middle_out(
    pool: &Pool,
    req: &mut CanonicalRequest,
    tokenizers: &[Tokenizer],
    budget: u64,
) -> usize {
    let memo: &dyn Memo = &pool.token_counts;
    // What is not a message (Anthropic `system`) is always kept: it comes off the budget.
    let fixed = tokenizers
        .iter()
        .map(|t| fit::system_tokens(&req.body, *t, budget.saturating_add(1), Some(memo)))
        .max()
        .unwrap_or(0);
    let Some(Value::Array(messages)) = req.body.member_mut("messages") else {
        return 0;
    };
    let per_message_cap = budget.saturating_add(1);
    let costs: Vec<u64> = messages
        .iter()
        .map(|m| {
            tokenizers
                .iter()
                .map(|t| fit::message_tokens(m, *t, per_message_cap, Some(memo)))
                .max()
                .unwrap_or(0)
        })
        .collect();
    match fit::middle_out(messages, &costs, budget.saturating_sub(fixed)) {
        Some(dropped) if !dropped.is_empty() => {
            fit::remove(messages, &dropped);
            dropped.len()
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::protocol::Endpoint;
    use serde_json::json;

    #[tokio::test]
    async fn a_long_text_counted_by_a_byte_pair_encoding_is_kept_for_the_next_request() {
        let text = "[[pools]]\nname = \"p\"\n[[pools.variants]]\nname = \"v\"\n\
            url = \"http://127.0.0.1:9/v1\"\nprotocol = \"openai\"\nupstream_model = \"gpt-4o\"\n";
        crate::config::install_crypto();
        let cfg = crate::Config::parse(text, "t.toml", &Default::default()).unwrap();
        let gw = crate::Gateway::new(cfg);
        let pool = gw.pool("p").unwrap();
        assert!(pool.counts_by_bpe());
        let system = "You answer questions about routing, briefly and exactly. ".repeat(40);
        let request = |question: &str| {
            let body = json!({"model": "p", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question}]});
            keel_core::request::parse(Endpoint::ChatCompletions, body.to_string().as_bytes())
                .unwrap()
        };
        let counts = &pool.token_counts;
        let key = counts.key(Tokenizer::O200k, &system);
        assert_eq!(counts.recall(key), None);
        let mut first = request("What is a pool?");
        apply(pool, &mut first);
        assert_eq!(counts.recall(key), Some(Tokenizer::O200k.count(&system)));
        // The next request's estimate, with the kept count, is the one counting gives.
        let mut next = request("And a variant?");
        apply(pool, &mut next);
        let counted = fit::prompt_tokens(&next.body, Tokenizer::O200k, u64::MAX, None);
        assert_eq!(next.estimated_input_tokens, counted.tokens);
        assert_ne!(next.estimated_input_tokens, first.estimated_input_tokens);
        // Counted once, then found kept by the assertion above and by the next request (the
        // questions are too short to be looked up).
        let text = gw.metrics.render();
        for (count, n) in [("counted", 1), ("kept", 2)] {
            let line = format!("keel_bpe_texts_total{{pool=\"p\",count=\"{count}\"}} {n}");
            assert!(text.contains(&line), "{line} in\n{text}");
        }
    }
}
