//! Simulated embeddings (`POST /v1/embeddings`, OpenAI's wire shape).
//!
//! A vector depends only on its input text, so every server (of any family) gives the same text
//! the same vector, and a failover changes nothing the client can see. Each token of the text
//! adds a pseudo-random direction drawn from the token itself, so texts sharing words point in
//! similar directions (cosine similarity behaves roughly as with a real model). Component `j`
//! is drawn independently of the vector's length: a vector asked with `dimensions = d` is the
//! first `d` components of a longer one, renormalized, as OpenAI's shortened embeddings are.

use serde_json::{json, Value};

use keel_core::embeddings::{vector_to_base64, EmbeddingsRequest, Encoding, Input};
use keel_core::rng::{hash_bytes, mix};
use keel_core::tokens;

/// The unit-length vector of `text` with `dims` components.
pub fn vector(text: &str, dims: usize) -> Vec<f32> {
    let mut v = vec![0f64; dims];
    for token in tokens::split(text)
        .iter()
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
    {
        let t = hash_bytes(0x656d_6264, token.to_lowercase().as_bytes());
        for (j, x) in v.iter_mut().enumerate() {
            // A uniform draw in [-1, 1) per (token, component).
            let r = mix(t ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            *x += (r >> 11) as f64 / (1u64 << 52) as f64 - 1.0;
        }
    }
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    if norm == 0.0 {
        // No tokens (whitespace only): a fixed unit vector.
        return (0..dims).map(|j| if j == 0 { 1.0 } else { 0.0 }).collect();
    }
    v.iter().map(|x| (x / norm) as f32).collect()
}

/// The text a token-id input stands for (each id one word), so ids embed deterministically too.
fn input_text(input: &Input) -> String {
    match input {
        Input::Text(t) => (*t).to_owned(),
        Input::Tokens(ids) => ids.iter().map(u64::to_string).collect::<Vec<_>>().join(" "),
    }
}

/// The response body for a validated request to `model`, with `default_dims` components unless
/// the request asked for `dimensions`.
pub fn response_body(req: &EmbeddingsRequest, model: &str, default_dims: u32) -> Value {
    let dims = req.dimensions.unwrap_or(default_dims) as usize;
    let data: Vec<Value> = req
        .inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            let v = vector(&input_text(input), dims);
            let embedding = match req.encoding {
                Encoding::Float => json!(v),
                Encoding::Base64 => json!(vector_to_base64(&v)),
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let n = req.tokens();
    json!({"object": "list", "data": data, "model": model,
        "usage": {"prompt_tokens": n, "total_tokens": n}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    #[test]
    fn vectors_are_unit_length_and_deterministic() {
        let a = vector("the quick brown fox", 64);
        assert_eq!(a, vector("the quick brown fox", 64));
        assert!((cosine(&a, &a) - 1.0).abs() < 1e-5);
        assert_ne!(a, vector("a slow green turtle", 64));
        assert_eq!(vector("   ", 3), vec![1.0, 0.0, 0.0]);
    }

    #[test]
    fn shared_words_make_similar_vectors() {
        let a = vector("routing requests across model servers", 256);
        let b = vector("routing requests across many servers", 256);
        let c = vector("bake the bread at two hundred degrees", 256);
        assert!(cosine(&a, &b) > cosine(&a, &c) + 0.3);
    }

    #[test]
    fn shorter_vectors_are_renormalized_prefixes() {
        let long = vector("hello world", 256);
        let short = vector("hello world", 16);
        let norm = long[..16].iter().map(|x| x * x).sum::<f32>().sqrt();
        for (s, l) in short.iter().zip(&long[..16]) {
            assert!((s - l / norm).abs() < 1e-5);
        }
    }
}
