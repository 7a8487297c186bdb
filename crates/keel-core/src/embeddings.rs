//! OpenAI's embeddings request (`POST /v1/embeddings`), read and validated once for keel's
//! admission and for the simulator: `input` is a string, an array of strings, an array of token
//! ids, or an array of token-id arrays; `encoding_format` is `float` (the default) or `base64`;
//! `dimensions` is a positive integer. Every error names the field, as OpenAI's own do.

use serde_json::{Map, Value};

use crate::members::Members;
use crate::request::RequestError;
use crate::tokens;

/// Most inputs in one request (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// One input to embed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input<'a> {
    Text(&'a str),
    Tokens(Vec<u64>),
}

impl Input<'_> {
    /// Tokens by keel's rule (a token array counts its ids).
    pub fn tokens(&self) -> u64 {
        match self {
            Input::Text(t) => tokens::count(t) as u64,
            Input::Tokens(ids) => ids.len() as u64,
        }
    }
}

/// How vectors are written in the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    /// A JSON array of numbers.
    #[default]
    Float,
    /// The little-endian `f32` bytes of the vector, base64-encoded (what the OpenAI SDKs ask for
    /// by default and decode themselves).
    Base64,
}

/// A validated embeddings request.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingsRequest<'a> {
    pub inputs: Vec<Input<'a>>,
    pub encoding: Encoding,
    /// The requested vector length, if any.
    pub dimensions: Option<u32>,
}

impl EmbeddingsRequest<'_> {
    /// Prompt tokens of all inputs.
    pub fn tokens(&self) -> u64 {
        self.inputs.iter().map(Input::tokens).sum()
    }
}

/// Reads `input`, `encoding_format` and `dimensions` from a request body.
pub fn parse(body: &Map<String, Value>) -> Result<EmbeddingsRequest<'_>, RequestError> {
    let inputs = match body.member("input") {
        None | Some(Value::Null) => {
            return Err(RequestError::invalid("missing required field `input`"))
        }
        Some(Value::String(s)) => vec![text_input(s, "input")?],
        Some(Value::Array(items)) => array_inputs(items)?,
        Some(_) => {
            return Err(RequestError::invalid(
                "`input` must be a string, an array of strings, an array of token ids or an array of token-id arrays",
            ))
        }
    };
    let encoding = match body.member("encoding_format") {
        None | Some(Value::Null) => Encoding::Float,
        Some(Value::String(s)) if s == "float" => Encoding::Float,
        Some(Value::String(s)) if s == "base64" => Encoding::Base64,
        Some(other) => {
            return Err(RequestError::invalid(format!(
                "`encoding_format` must be \"float\" or \"base64\", got {other}"
            )))
        }
    };
    let dimensions = match body.member("dimensions") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|d| (1..=u32::MAX as u64).contains(d))
                .ok_or_else(|| {
                    RequestError::invalid(format!(
                        "`dimensions` must be a positive integer, got {v}"
                    ))
                })? as u32,
        ),
    };
    if body
        .member("stream")
        .is_some_and(|s| s != &Value::Bool(false) && !s.is_null())
    {
        return Err(RequestError::invalid(
            "`stream` is not supported on /v1/embeddings",
        ));
    }
    Ok(EmbeddingsRequest {
        inputs,
        encoding,
        dimensions,
    })
}

fn text_input<'a>(s: &'a str, field: &str) -> Result<Input<'a>, RequestError> {
    if s.is_empty() {
        return Err(RequestError::invalid(format!(
            "`{field}` must not be empty"
        )));
    }
    Ok(Input::Text(s))
}

/// One array of token ids (`field` names it in errors).
fn token_ids(items: &[Value], field: &str) -> Result<Vec<u64>, RequestError> {
    if items.is_empty() {
        return Err(RequestError::invalid(format!(
            "`{field}` must not be empty"
        )));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.as_u64().ok_or_else(|| {
                RequestError::invalid(format!(
                    "`{field}[{i}]` must be a token id (a non-negative integer)"
                ))
            })
        })
        .collect()
}

/// An array `input`: its first element decides which of the three array forms it is.
fn array_inputs(items: &[Value]) -> Result<Vec<Input<'_>>, RequestError> {
    if items.is_empty() {
        return Err(RequestError::invalid("`input` must not be empty"));
    }
    if items.len() > MAX_INPUTS {
        return Err(RequestError::invalid(format!(
            "`input` holds {} items; at most {MAX_INPUTS} are allowed",
            items.len()
        )));
    }
    match &items[0] {
        Value::Number(_) => Ok(vec![Input::Tokens(token_ids(items, "input")?)]),
        Value::String(_) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => text_input(s, &format!("input[{i}]")),
                _ => Err(RequestError::invalid(format!(
                    "`input[{i}]` must be a string like the other items"
                ))),
            })
            .collect(),
        Value::Array(_) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::Array(ids) => Ok(Input::Tokens(token_ids(ids, &format!("input[{i}]"))?)),
                _ => Err(RequestError::invalid(format!(
                    "`input[{i}]` must be an array of token ids like the other items"
                ))),
            })
            .collect(),
        _ => Err(RequestError::invalid(
            "`input[0]` must be a string, a token id or an array of token ids",
        )),
    }
}

/// Standard base64 (with padding) of `bytes`.
pub fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> shift) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A vector as the `base64` encoding format writes it: little-endian `f32`s, base64-encoded.
pub fn vector_to_base64(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64_encode(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn reads_every_input_form() {
        let b = body(json!({"input": "hello world"}));
        assert_eq!(parse(&b).unwrap().inputs, vec![Input::Text("hello world")]);
        assert_eq!(parse(&b).unwrap().tokens(), 2);
        let b = body(json!({"input": ["a", "b c"], "encoding_format": "base64", "dimensions": 8}));
        let r = parse(&b).unwrap();
        assert_eq!(r.inputs, vec![Input::Text("a"), Input::Text("b c")]);
        assert_eq!(
            (r.encoding, r.dimensions, r.tokens()),
            (Encoding::Base64, Some(8), 3)
        );
        let b = body(json!({"input": [1, 2, 3]}));
        assert_eq!(
            parse(&b).unwrap().inputs,
            vec![Input::Tokens(vec![1, 2, 3])]
        );
        let b = body(json!({"input": [[1], [2, 3]]}));
        assert_eq!(parse(&b).unwrap().tokens(), 3);
    }

    #[test]
    fn names_the_field_in_errors() {
        let cases = [
            (json!({}), "missing required field `input`"),
            (json!({"input": ""}), "`input` must not be empty"),
            (json!({"input": []}), "`input` must not be empty"),
            (json!({"input": 5}), "`input` must be a string"),
            (json!({"input": ["a", 1]}), "`input[1]` must be a string"),
            (json!({"input": [1, -2]}), "`input[1]` must be a token id"),
            (json!({"input": [[1], []]}), "`input[1]` must not be empty"),
            (json!({"input": [{"a": 1}]}), "`input[0]` must be"),
            (
                json!({"input": "a", "encoding_format": "int8"}),
                "`encoding_format`",
            ),
            (json!({"input": "a", "dimensions": 0}), "`dimensions`"),
            (json!({"input": "a", "stream": true}), "`stream`"),
        ];
        for (b, want) in cases {
            let e = parse(&body(b.clone())).unwrap_err();
            assert!(e.message.contains(want), "{b}: {}", e.message);
        }
    }

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(base64_encode(b""), "");
        assert_eq!(base64_encode(b"f"), "Zg==");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_encode(b"foo"), "Zm9v");
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        // 1.0f32 is 0x3f800000, little-endian 00 00 80 3f.
        assert_eq!(vector_to_base64(&[1.0]), "AACAPw==");
    }
}
