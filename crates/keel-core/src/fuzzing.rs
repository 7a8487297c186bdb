//! Fuzz harnesses: one function per target, taking the fuzzer's bytes. The cargo-fuzz targets
//! in `fuzz/` are one-line calls of these, and `tests/fuzz_corpus.rs` replays every corpus file
//! through them on stable, so a crash found once stays a failing test until it is fixed.
//!
//! Each harness drives code that reads bytes from outside keel (an upstream's stream, a
//! client's body) and checks what must hold whatever the bytes: no panic, and properties that
//! are cheap to state (chunking does not change decoding; the chunk view reads what the JSON
//! tree reads; stitched output is valid SSE; an assembled body is bounded by its input).
//!
//! Event-sequence inputs are SSE text, so that real upstream streams seed the corpora and
//! findings read as streams: the input is cut into blocks at blank lines (`\n\n`) and each block
//! decoded on its own, so one malformed block does not hide the rest. In `stitch`, a comment
//! block `:segment` starts a continuation segment (`:segment trim` one whose overlap with the
//! delivered text is trimmed, as `instruction` mode does).

use serde_json::{Map, Value};

use crate::assemble::Assembler;
use crate::continuation::{continuation, default_prefill_fields, event_text, ResumeMode, Stitcher};
use crate::protocol::{event_role, openai_choice_text, openai_chunk_has_output, ChunkView};
use crate::protocol::{Endpoint, Protocol};
use crate::request::{parse, CanonicalRequest};
use crate::sse::{decode_all, SseDecoder, SseEvent, DEFAULT_MAX_EVENT_BYTES};
use crate::tokens;

const PROTOCOLS: [Protocol; 2] = [Protocol::OpenAi, Protocol::Anthropic];
const ENDPOINTS: [Endpoint; 5] = [
    Endpoint::ChatCompletions,
    Endpoint::Completions,
    Endpoint::Messages,
    Endpoint::CountTokens,
    Endpoint::Embeddings,
];
const MODES: [ResumeMode; 4] = [
    ResumeMode::Prefill,
    ResumeMode::Completion,
    ResumeMode::Instruction,
    ResumeMode::None,
];

/// The events of an SSE text, block by block (blocks that do not decode are skipped).
pub fn events(data: &[u8]) -> Vec<SseEvent> {
    let mut out = Vec::new();
    for block in data
        .split_inclusive(|&b| b == b'\n')
        .collect::<Vec<_>>()
        .split(|l| *l == b"\n")
    {
        let mut bytes: Vec<u8> = block.concat();
        bytes.extend_from_slice(b"\n\n");
        if let Ok(evs) = decode_all(&bytes) {
            out.extend(evs);
        }
    }
    out
}

/// Feeds `body` to a fresh decoder in the given chunks; returns the events and the first error
/// (or the end's result).
fn decode_in_chunks<'a>(
    max: usize,
    chunks: impl Iterator<Item = &'a [u8]>,
) -> (Vec<SseEvent>, Result<(), crate::sse::SseError>) {
    let mut dec = SseDecoder::with_max_event_bytes(max);
    let mut out = Vec::new();
    for c in chunks {
        if let Err(e) = dec.feed(c, &mut out) {
            return (out, Err(e));
        }
    }
    let end = dec.end(&mut out);
    (out, end)
}

/// `sse_decoder`: byte 0 = control (bit 7: a 64-byte event limit instead of the default; bits
/// 0–3: how many chunk-length bytes follow), then the chunk lengths (each byte + 1), then the
/// body. The body is decoded whole, in the input's chunks (cycled) and byte by byte: the three
/// must agree exactly, no event may exceed the limit, and every event's raw bytes decode to
/// the event itself.
pub fn sse_decoder(data: &[u8]) {
    let Some((&ctl, rest)) = data.split_first() else {
        return;
    };
    let max = if ctl & 0x80 != 0 {
        64
    } else {
        DEFAULT_MAX_EVENT_BYTES
    };
    let n = usize::from(ctl & 0x0f).min(rest.len());
    let (lens, body) = rest.split_at(n);
    let whole = decode_in_chunks(max, std::iter::once(body));
    let mut chunks = Vec::new();
    let (mut at, mut k) = (0, 0);
    while at < body.len() {
        let len = lens
            .get(k % lens.len().max(1))
            .map_or(body.len(), |&l| usize::from(l) + 1);
        let end = (at + len).min(body.len());
        chunks.push(&body[at..end]);
        at = end;
        k += 1;
    }
    let chunked = decode_in_chunks(max, chunks.into_iter());
    assert_eq!(whole, chunked, "chunking changed the decoding");
    let bytewise = decode_in_chunks(max, body.chunks(1));
    assert_eq!(whole, bytewise, "byte-by-byte feeding changed the decoding");
    for ev in &whole.0 {
        assert!(
            ev.raw.len() <= max,
            "an event of {} bytes passed a limit of {max}",
            ev.raw.len()
        );
        assert_eq!(
            decode_all(&ev.raw).as_deref(),
            Ok(std::slice::from_ref(ev)),
            "an event's raw bytes decode to another event"
        );
    }
}

/// `chunk_events`: every event classified and read for both protocols; where the chunk view
/// reads an OpenAI chunk and the JSON tree reads it too, both must see the same text, output,
/// finish and error.
pub fn chunk_events(data: &[u8]) {
    for ev in events(data) {
        for protocol in PROTOCOLS {
            let _ = event_role(protocol, &ev);
            let _ = event_text(protocol, &ev);
        }
        let Some(view) = ChunkView::parse(&ev.data) else {
            continue;
        };
        let _ = (view.starts_tool_call(), view.is_plain_text());
        let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
            continue;
        };
        let not_null = |p: &str| v.pointer(p).is_some_and(|x| !x.is_null());
        assert_eq!(
            view.has_output(),
            openai_chunk_has_output(&v),
            "has_output: {}",
            ev.data
        );
        assert_eq!(
            view.text(),
            v.pointer("/choices/0").and_then(openai_choice_text),
            "text: {}",
            ev.data
        );
        assert_eq!(
            view.finished(),
            not_null("/choices/0/finish_reason"),
            "finished: {}",
            ev.data
        );
        assert_eq!(view.has_error(), not_null("/error"), "error: {}", ev.data);
    }
}

/// `assemble`: the events into an [`Assembler`] for each protocol (stopping at the first
/// `Err`, as the gateway does), then every endpoint's body. A body is bounded by its input:
/// at most four times its bytes plus the fixed cost of the largest index keel accepts.
pub fn assemble(data: &[u8]) {
    let evs = events(data);
    for protocol in PROTOCOLS {
        let mut a = Assembler::new();
        for ev in &evs {
            if a.push(protocol, ev).is_err() {
                break;
            }
        }
        // `CountTokens` has no body to assemble: `finish` treats it as chat completions.
        for endpoint in &ENDPOINTS[..3] {
            let body = a.clone().finish(*endpoint).to_bytes();
            let bound = 4 * data.len() + 64 * 1024;
            assert!(
                body.len() <= bound,
                "{} bytes assembled from {} bytes of input",
                body.len(),
                data.len()
            );
        }
    }
}

/// Requests a continuation is built for in `stitch`, one per endpoint (with a client prefill
/// and an output limit, the cases that rewrite the body), parsed once.
fn stitch_requests() -> &'static [CanonicalRequest] {
    static REQUESTS: std::sync::OnceLock<Vec<CanonicalRequest>> = std::sync::OnceLock::new();
    REQUESTS.get_or_init(|| {
        STITCH_REQUESTS
            .iter()
            .map(|(e, b)| parse(*e, b.as_bytes()).expect("a valid fixed request"))
            .collect()
    })
}

const STITCH_REQUESTS: [(Endpoint, &str); 4] = [
    (
        Endpoint::ChatCompletions,
        r#"{"model":"m","max_tokens":50,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Sure:"}]}"#,
    ),
    (
        Endpoint::Completions,
        r#"{"model":"m","max_tokens":50,"prompt":["Once"]}"#,
    ),
    (
        Endpoint::Messages,
        r#"{"model":"m","max_tokens":50,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
    ),
    (
        Endpoint::CountTokens,
        r#"{"model":"m","max_tokens":50,"messages":[{"role":"user","content":"hi"}]}"#,
    ),
];

/// `stitch`: the events through a [`Stitcher`] for each protocol, with `:segment` comments
/// starting continuation segments. What the stitcher rewrites (after the first segment; before
/// it, events pass through byte for byte) must be one valid SSE event, and JSON. Then a
/// continuation request is built from the delivered text for every endpoint of the protocol and
/// every resume mode.
pub fn stitch(data: &[u8]) {
    let evs = events(data);
    for protocol in PROTOCOLS {
        let mut st = Stitcher::new(protocol);
        let mut trim = false;
        for ev in &evs {
            if ev.comment_only && ev.raw.starts_with(b":segment") {
                st.begin_segment();
                trim = ev.raw.starts_with(b":segment trim");
                continue;
            }
            let Some(out) = st.process(ev, &mut trim) else {
                continue;
            };
            if st.segment > 0 && !ev.comment_only && ev.data != "[DONE]" {
                let back = decode_all(&out).expect("the stitcher wrote invalid SSE");
                assert_eq!(back.len(), 1, "one event in, one out");
                assert!(
                    serde_json::from_str::<Value>(&back[0].data).is_ok(),
                    "a rewritten event is not JSON: {}",
                    back[0].data
                );
            }
        }
        for req in stitch_requests() {
            if req.endpoint.protocol() != protocol {
                continue;
            }
            for mode in MODES {
                let _ = continuation(
                    req,
                    mode,
                    &default_prefill_fields(),
                    &st.delivered,
                    st.delivered_tokens(),
                );
            }
        }
    }
}

/// `request_parse`: the bytes as a request body for every endpoint; for each request that
/// parses, its affinity keys, the upstream body both ways (which must agree), and a
/// continuation in every mode. The text is also split into tokens, which must round-trip and
/// agree with the count.
pub fn request_parse(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let pieces = tokens::split(text);
        assert_eq!(pieces.len(), tokens::count(text));
        assert_eq!(pieces.concat(), text);
    }
    let mut params = Map::new();
    params.insert("max_tokens".into(), Value::from(64));
    params.insert("temperature".into(), Value::from(0.5));
    for endpoint in ENDPOINTS {
        let Ok(req) = parse(endpoint, data) else {
            continue;
        };
        let _ = (req.prefix_key(), req.session_key());
        let body = req.upstream_body("upstream-model", &params);
        let view = req.upstream_view("upstream-model", &params).to_vec();
        assert_eq!(
            view,
            serde_json::to_vec(&body).expect("an upstream body serializes"),
            "the upstream view and body differ"
        );
        for mode in MODES {
            for delivered in ["", "Hello, wor"] {
                let tokens = tokens::count(delivered) as u64;
                let _ = continuation(&req, mode, &default_prefill_fields(), delivered, tokens);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Data of every JSON shape, and objects whose fields keel reads have the wrong types.
    const SHAPES: &[&str] = &[
        "null",
        "[]",
        "[1,{}]",
        "[null,[{\"text\":\"x\"}],null]",
        "7",
        "-1.5e300",
        "\"s\"",
        "true",
        "{}",
        r#"{"index":"0","delta":[],"content_block":5,"message":[],"usage":"u"}"#,
        r#"{"index":18446744073709551615,"delta":{"text":"t"},"usage":{"output_tokens":18446744073709551615}}"#,
        r#"{"index":0,"content_block":"text","delta":{"text":5,"partial_json":[]}}"#,
        r#"{"index":0,"content_block":{"type":"tool_use"},"delta":{"text":"t","partial_json":"{"}}"#,
        r#"{"message":{"usage":7,"id":[]},"delta":{"stop_reason":{}},"usage":{"output_tokens":"x"}}"#,
        r#"{"type":"error","error":7}"#,
        r#"{"error":{"message":5}}"#,
        r#"{"id":"a","choices":7}"#,
        r#"{"id":"a","choices":[7]}"#,
        r#"{"id":"a","choices":[["hi"]]}"#,
        r#"{"id":"a","choices":[{"delta":7,"text":[]}]}"#,
        r#"{"id":"a","choices":[{"delta":["x"],"text":"t"}]}"#,
        r#"{"id":"a","choices":[{"delta":{"content":null},"text":"t"}]}"#,
        r#"{"id":"a","choices":[{"delta":{"content":7,"tool_calls":{}}}],"usage":[]}"#,
        r#"{"id":"a","choices":[{"delta":{"tool_calls":[7,null,{"index":-1},{"index":1.5,"id":7,"function":"f"}]}}]}"#,
        r#"{"id":"a","choices":[{"delta":{"tool_calls":[{"index":4000000000,"function":{"name":"f"}}]}}]}"#,
        r#"{"id":"a","choices":[],"usage":{"prompt_tokens":18446744073709551615,"completion_tokens":18446744073709551615}}"#,
    ];

    const NAMES: &[Option<&str>] = &[
        None,
        Some("message_start"),
        Some("content_block_start"),
        Some("content_block_delta"),
        Some("content_block_stop"),
        Some("message_delta"),
        Some("message_stop"),
        Some("ping"),
        Some("error"),
    ];

    /// Every event name with data of every shape, in one stream, with continuation segments
    /// between repetitions (so the stitcher's rewriting paths run too), through every harness.
    #[test]
    fn wrong_json_shapes_never_panic() {
        let mut stream = Vec::new();
        for pass in 0..3 {
            for name in NAMES {
                for data in SHAPES {
                    stream.extend_from_slice(&SseEvent::new(*name, data).raw);
                }
            }
            stream.extend_from_slice(if pass == 0 {
                b":segment\n\n"
            } else {
                b":segment trim\n\n"
            });
        }
        assert_eq!(events(&stream).len(), 3 * (NAMES.len() * SHAPES.len() + 1));
        chunk_events(&stream);
        assemble(&stream);
        stitch(&stream);
        for data in SHAPES {
            request_parse(data.as_bytes());
        }
    }

    #[test]
    fn events_are_read_block_by_block() {
        let evs = events(b"data: 1\n\nbogus\n\nevent: e\ndata: 2\n\n\n\n: c\n\ndata: 3");
        let data: Vec<&str> = evs.iter().map(|e| e.data.as_str()).collect();
        assert_eq!(data, ["1", "2", "", "3"]);
        assert!(evs[2].comment_only);
    }

    #[test]
    fn sse_decoder_checks_itself_on_small_inputs() {
        sse_decoder(b"\x03\x00\x01\x02event: a\r\ndata: 1\r\n\r\n: ping\n\ndata: x\rdata: y\r\r");
        sse_decoder(b"\x81\x05data: 0123456789012345678901234567890123456789012345678901234567890123456789\n\n");
        sse_decoder(b"\x00bogus\n\n");
    }
}
