//! What cross-protocol translation costs per streamed token: the relay's work on a
//! same-protocol stream (SSE decode, then reading each event as the relay does: classify it,
//! check its indexes, hold tool calls until complete, stitch) against a cross-protocol stream
//! (the same, plus the upstream's events decoded in the other protocol and translated event by
//! event), for the client speaking OpenAI Chat Completions and Anthropic Messages, on a text
//! answer and on a tool call's argument deltas. Request translation, both ways, is timed on a
//! typical chat request (system prompt, a few turns with a tool call and its result, two tools).
//!
//! `cargo bench -p keel-core --bench translate` (a name after `--` filters, as with any Criterion
//! bench). After Criterion's own report comes a summary: ns per streamed token (median),
//! translated ÷ same-protocol, and the added ns. Benchmarks:
//!
//! - `<client>_<content>/whole_{same,translated}`: a whole stream (first events, 64 token
//!   events, last events), reported per token (Criterion's throughput is tokens/s).
//! - `…/token_…`: one token event in the middle of a stream (a text delta, or a tool call's
//!   argument delta).
//! - `…/first_…` and `…/last_…`: the events before the first token and after the last
//!   (role chunk, `message_start`, block starts; finish, usage, `[DONE]`, `message_stop`).
//! - `request/*`: request translation, with the JSON parse of the same body as a scale.
//! - `dialect_gemini/*`: the Gemini dialect: `request` (the typical request's hub body as a
//!   Gemini body), `stream_event` (one text chunk of a `alt=sse` stream, mid-answer, as hub
//!   events) and `whole` (a whole answer of text and a function call as the hub's answer).
//! - `bedrock/*`: the Bedrock Converse dialect: the hub request (the typical chat request,
//!   translated to Messages) as a Converse body, one streamed text delta frame decoded into its
//!   Anthropic event, and a whole Converse answer as an Anthropic message.
//! - `dialect_responses/*`: the OpenAI Responses upstream: the typical request in its words
//!   (`request`), one text delta event mid-stream to Chat chunks (`token`), a whole Response
//!   to a chat completion (`whole`).
//! - `dialect_azure/*`: Azure OpenAI: one annotated chunk with its annotations removed
//!   (`token`), a whole annotated answer (`whole`).
//!
//! Not included, the same in both paths or not in keel-core: the clock read per output event,
//! the write to the client socket, and the gateway's `model` rename (a byte scan done on
//! same-protocol streams only, so the bench slightly favours the same-protocol path).
//! `keel bench overhead --translated` measures the whole gateway end to end.

use std::path::{Path, PathBuf};

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use serde_json::{json, Map, Value};
use std::hint::black_box;

use keel_core::continuation::Stitcher;
use keel_core::dialect::{bedrock, gemini, StreamToHub};
use keel_core::protocol::{event_role, EventRole, Protocol};
use keel_core::sse::{SseDecoder, SseEvent, DEFAULT_MAX_EVENT_BYTES};
use keel_core::stream_watch::{carries_tokens, oversized_index, Hold, ToolCallHold};
use keel_core::translate::{
    chat_to_messages, messages_to_chat, AnthropicToChatStream, ChatToAnthropicStream,
    ResponseContext,
};

/// Token events in a whole stream.
const TOKENS: usize = 64;

// ---------------------------------------------------------------------------------------------
// Upstream streams, as the bytes a provider writes: one event per network chunk.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Content {
    Text,
    ToolCall,
}

impl Content {
    fn name(self) -> &'static str {
        match self {
            Content::Text => "text",
            Content::ToolCall => "tool",
        }
    }
}

/// One upstream stream: the events before the first token, one per token, and after the last.
struct Stream {
    first: Vec<Vec<u8>>,
    tokens: Vec<Vec<u8>>,
    last: Vec<Vec<u8>>,
}

impl Stream {
    fn all(&self) -> impl Iterator<Item = &Vec<u8>> {
        self.first.iter().chain(&self.tokens).chain(&self.last)
    }
}

/// The pieces a model streams: words of a sentence, or fragments of a tool call's JSON
/// arguments (an object with one long string, split the way models split it).
fn pieces(content: Content, n: usize) -> Vec<String> {
    const WORDS: [&str; 8] = [
        " The", " gateway", " routes", " each", " request", " to", " a", " replica",
    ];
    let words = (0..n).map(|i| WORDS[i % WORDS.len()].to_owned());
    match content {
        Content::Text => words.collect(),
        Content::ToolCall => {
            let mut p: Vec<String> = words.collect();
            p[0] = "{\"query\": \"".into();
            p[n - 1] = "\"}".into();
            p
        }
    }
}

fn openai_chunk(delta: Value, finish: Value, usage: Value) -> Vec<u8> {
    let choices = if delta.is_null() {
        json!([])
    } else {
        json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}])
    };
    let chunk = json!({"id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT", "object": "chat.completion.chunk",
        "created": 1_750_000_000, "model": "gpt-4o-2024-08-06", "service_tier": "default",
        "system_fingerprint": "fp_eb9dce56a8", "choices": choices, "usage": usage});
    SseEvent::new(None, &chunk.to_string()).raw
}

/// An OpenAI stream with `stream_options.include_usage` (what keel asks for when it translates).
fn openai_stream(content: Content, n: usize) -> Stream {
    let p = pieces(content, n);
    let (first, tokens, finish) = match content {
        Content::Text => (
            openai_chunk(
                json!({"role": "assistant", "content": "", "refusal": null}),
                Value::Null,
                Value::Null,
            ),
            p.iter()
                .map(|t| openai_chunk(json!({"content": t}), Value::Null, Value::Null))
                .collect(),
            "stop",
        ),
        Content::ToolCall => (
            openai_chunk(
                json!({"role": "assistant", "content": null, "tool_calls": [{"index": 0,
                    "id": "call_DdmO9pD3xa9XTPNJ32zg2hcA", "type": "function",
                    "function": {"name": "search_docs", "arguments": ""}}]}),
                Value::Null,
                Value::Null,
            ),
            p.iter()
                .map(|a| {
                    let call = json!({"index": 0, "function": {"arguments": a}});
                    openai_chunk(json!({"tool_calls": [call]}), Value::Null, Value::Null)
                })
                .collect(),
            "tool_calls",
        ),
    };
    let usage = json!({"prompt_tokens": 412, "completion_tokens": n, "total_tokens": 412 + n,
        "prompt_tokens_details": {"cached_tokens": 256, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0}});
    Stream {
        first: vec![first],
        tokens,
        last: vec![
            openai_chunk(json!({}), json!(finish), Value::Null),
            openai_chunk(Value::Null, Value::Null, usage),
            SseEvent::new(None, "[DONE]").raw,
        ],
    }
}

fn anthropic_event(v: Value) -> Vec<u8> {
    let name = v["type"].as_str().unwrap_or("").to_owned();
    SseEvent::new(Some(&name), &v.to_string()).raw
}

fn anthropic_stream(content: Content, n: usize) -> Stream {
    let p = pieces(content, n);
    let (block, delta, stop_reason) = match content {
        Content::Text => (
            json!({"type": "text", "text": ""}),
            "text_delta",
            "end_turn",
        ),
        Content::ToolCall => (
            json!({"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "search_docs", "input": {}}),
            "input_json_delta",
            "tool_use",
        ),
    };
    let field = if content == Content::Text {
        "text"
    } else {
        "partial_json"
    };
    let message = json!({"id": "msg_01XFDUDYJgAACzvnptvVoYEL", "type": "message", "role": "assistant",
        "model": "claude-sonnet-4-5-20250929", "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 156, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 256,
            "output_tokens": 1}});
    Stream {
        first: vec![
            anthropic_event(json!({"type": "message_start", "message": message})),
            anthropic_event(
                json!({"type": "content_block_start", "index": 0, "content_block": block}),
            ),
            anthropic_event(json!({"type": "ping"})),
        ],
        tokens: p
            .iter()
            .map(|t| {
                anthropic_event(json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": delta, field: t}}))
            })
            .collect(),
        last: vec![
            anthropic_event(json!({"type": "content_block_stop", "index": 0})),
            anthropic_event(json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": null},
                "usage": {"output_tokens": n}})),
            anthropic_event(json!({"type": "message_stop"})),
        ],
    }
}

fn stream_of(protocol: Protocol, content: Content, n: usize) -> Stream {
    match protocol {
        Protocol::OpenAi => openai_stream(content, n),
        Protocol::Anthropic => anthropic_stream(content, n),
    }
}

fn other(p: Protocol) -> Protocol {
    match p {
        Protocol::OpenAi => Protocol::Anthropic,
        Protocol::Anthropic => Protocol::OpenAi,
    }
}

// ---------------------------------------------------------------------------------------------
// The relay's per-event work, as keel-gateway's `attempt::Source` and `relay::segment` do it.

enum Translator {
    ToChat(AnthropicToChatStream),
    ToMessages(ChatToAnthropicStream),
}

/// One stream on its way from the upstream's bytes to the bytes for the client.
struct Relay {
    client: Protocol,
    upstream: Protocol,
    decoder: SseDecoder,
    translator: Option<Translator>,
    hold: ToolCallHold,
    stitcher: Stitcher,
    decoded: Vec<SseEvent>,
    for_client: Vec<SseEvent>,
}

impl Relay {
    fn new(client: Protocol, upstream: Protocol) -> Relay {
        let translator = match (client, upstream) {
            (Protocol::OpenAi, Protocol::Anthropic) => {
                let ctx = ResponseContext {
                    json_tool: None,
                    include_usage: true,
                };
                Some(Translator::ToChat(AnthropicToChatStream::new(
                    ctx,
                    "bench",
                    1_750_000_000,
                )))
            }
            (Protocol::Anthropic, Protocol::OpenAi) => {
                Some(Translator::ToMessages(ChatToAnthropicStream::new("bench")))
            }
            _ => None,
        };
        Relay {
            client,
            upstream,
            decoder: SseDecoder::new(),
            translator,
            hold: ToolCallHold::default(),
            stitcher: Stitcher::new(client),
            decoded: Vec::new(),
            for_client: Vec::new(),
        }
    }

    /// A relay that has already taken `chunks`.
    fn after<'a>(
        client: Protocol,
        upstream: Protocol,
        chunks: impl Iterator<Item = &'a Vec<u8>>,
    ) -> Relay {
        let mut r = Relay::new(client, upstream);
        for c in chunks {
            r.chunk(c);
        }
        r
    }

    /// Takes one network chunk of the upstream's stream; returns the bytes released to the
    /// client (tool calls are held until complete, so often none).
    fn chunk(&mut self, bytes: &[u8]) -> usize {
        self.decoder
            .feed(bytes, &mut self.decoded)
            .expect("the bench's streams are well-formed");
        match &mut self.translator {
            None => self.for_client.append(&mut self.decoded),
            Some(t) => {
                for ev in self.decoded.drain(..) {
                    assert!(oversized_index(self.upstream, &ev).is_none());
                    match t {
                        Translator::ToChat(t) => t.push(&ev, &mut self.for_client),
                        Translator::ToMessages(t) => t.push(&ev, &mut self.for_client),
                    }
                    .expect("the bench's streams translate");
                }
            }
        }
        let mut events = std::mem::take(&mut self.for_client);
        let sent = events.drain(..).map(|ev| self.read(ev)).sum();
        self.for_client = events;
        sent
    }

    /// What the relay does with one event in the client's protocol.
    fn read(&mut self, ev: SseEvent) -> usize {
        let role = event_role(self.client, &ev);
        assert!(!matches!(
            role,
            EventRole::Error(_) | EventRole::Malformed(_)
        ));
        if role == EventRole::Output {
            black_box(carries_tokens(self.client, &ev));
        }
        assert!(oversized_index(self.client, &ev).is_none());
        let terminal = role == EventRole::Terminal;
        let released = match self
            .hold
            .push(self.client, ev, terminal, DEFAULT_MAX_EVENT_BYTES)
        {
            Hold::Pass(ev) => vec![ev],
            Hold::Held => return 0,
            Hold::Release(evs) => evs,
            Hold::Overflow => unreachable!("the bench's tool calls are small"),
        };
        released
            .iter()
            .filter_map(|ev| self.stitcher.process(ev, &mut false))
            .map(|b| b.len())
            .sum()
    }
}

// ---------------------------------------------------------------------------------------------
// Benchmarks.

const PATHS: [&str; 2] = ["same", "translated"];

/// A path that lost the answer would time nothing useful: the whole stream must reach the
/// client, the text in full, no tool call left held.
fn check(client: Protocol, upstream: Protocol, content: Content, s: &Stream) {
    let mut r = Relay::new(client, upstream);
    let sent: usize = s.all().map(|c| r.chunk(c)).sum();
    assert!(
        sent > 0 && !r.hold.holding(),
        "{client:?} from {upstream:?}"
    );
    if content == Content::Text {
        assert_eq!(r.stitcher.delivered, pieces(content, TOKENS).concat());
    }
}

fn stream_benches(c: &mut Criterion, client: Protocol, content: Content) {
    let mut g = c.benchmark_group(format!("{}_{}", client.as_str(), content.name()));
    for path in PATHS {
        let upstream = if path == "same" {
            client
        } else {
            other(client)
        };
        let s = stream_of(upstream, content, TOKENS);
        check(client, upstream, content, &s);
        // Only the token events, at the stream's middle, are timed; the relay gets there first.
        let middle = TOKENS / 2;
        g.throughput(Throughput::Elements(TOKENS as u64));
        g.bench_function(BenchmarkId::new("whole", path), |b| {
            b.iter(|| {
                let mut r = Relay::new(client, upstream);
                s.all().map(|c| r.chunk(black_box(c))).sum::<usize>()
            })
        });
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("token", path), |b| {
            b.iter_batched_ref(
                || Relay::after(client, upstream, s.first.iter().chain(&s.tokens[..middle])),
                |r| r.chunk(black_box(&s.tokens[middle])),
                BatchSize::SmallInput,
            )
        });
        g.bench_function(BenchmarkId::new("first", path), |b| {
            b.iter_batched_ref(
                || Relay::new(client, upstream),
                |r| s.first.iter().map(|c| r.chunk(black_box(c))).sum::<usize>(),
                BatchSize::SmallInput,
            )
        });
        g.bench_function(BenchmarkId::new("last", path), |b| {
            b.iter_batched_ref(
                || Relay::after(client, upstream, s.first.iter().chain(&s.tokens)),
                |r| s.last.iter().map(|c| r.chunk(black_box(c))).sum::<usize>(),
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

/// A typical agent turn in Chat Completions form: system prompt, a question, the assistant's
/// tool call, its result, a follow-up; two tools.
fn chat_request() -> Map<String, Value> {
    let tool = |name: &str, what: &str| {
        json!({"type": "function", "function": {"name": name, "description": format!("Search the {what} and return the best matching passages."),
            "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "What to look for."},
                "limit": {"type": "integer", "minimum": 1, "maximum": 20}}, "required": ["query"]}}})
    };
    let v = json!({"model": "bench", "stream": true, "stream_options": {"include_usage": true},
        "max_tokens": 1024, "temperature": 0.3,
        "messages": [
            {"role": "system", "content": "You are a support assistant for an inference gateway. Answer briefly, cite the docs you used, and ask before changing configuration."},
            {"role": "user", "content": "Why does my streamed request move to another replica halfway through?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_DdmO9pD3xa9XTPNJ32zg2hcA", "type": "function",
                "function": {"name": "search_docs", "arguments": "{\"query\": \"mid-stream migration stall\", \"limit\": 3}"}}]},
            {"role": "tool", "tool_call_id": "call_DdmO9pD3xa9XTPNJ32zg2hcA", "content": "Migration: when a stream stalls for longer than stall_ms, or its token rate falls below 60% of the variant's baseline, keel continues it on another variant from the text already delivered."},
            {"role": "assistant", "content": "It stalled: keel continued it on another replica from the text already delivered."},
            {"role": "user", "content": "Can I turn that off for one pool?"}
        ],
        "tools": [tool("search_docs", "documentation"), tool("search_issues", "issue tracker")],
        "tool_choice": "auto"});
    v.as_object().cloned().expect("an object")
}

fn request_benches(c: &mut Criterion) {
    let chat = chat_request();
    let messages = chat_to_messages(&chat, 4096).expect("translates").body;
    let (chat_text, messages_text) = (
        Value::Object(chat.clone()).to_string(),
        Value::Object(messages.clone()).to_string(),
    );
    let mut g = c.benchmark_group("request");
    g.bench_function("parse_chat", |b| {
        b.iter(|| serde_json::from_str::<Map<String, Value>>(black_box(&chat_text)).is_ok())
    });
    g.bench_function("chat_to_messages", |b| {
        b.iter(|| chat_to_messages(black_box(&chat), 4096).is_ok())
    });
    g.bench_function("parse_messages", |b| {
        b.iter(|| serde_json::from_str::<Map<String, Value>>(black_box(&messages_text)).is_ok())
    });
    g.bench_function("messages_to_chat", |b| {
        b.iter(|| messages_to_chat(black_box(&messages)).is_ok())
    });
    g.finish();
}

fn bedrock_benches(c: &mut Criterion) {
    let mut hub = chat_to_messages(&chat_request(), 4096)
        .expect("translates")
        .body;
    hub.insert(
        "model".into(),
        json!("anthropic.claude-sonnet-4-20250514-v1:0"),
    );
    let mut stream = bedrock::Stream::new("bench");
    let mut out = Vec::new();
    let start = [
        bedrock::encode_frame(
            "messageStart",
            &json!({"role": "assistant", "p": "abcdefgh"}),
        ),
        bedrock::encode_frame(
            "contentBlockDelta",
            &json!({"contentBlockIndex": 0, "delta": {"text": "The"}, "p": "abcd"}),
        ),
    ]
    .concat();
    stream.feed(&start, &mut out).expect("decodes");
    let token = bedrock::encode_frame(
        "contentBlockDelta",
        &json!({"contentBlockIndex": 0, "delta": {"text": " gateway"}, "p": "abcdefghijk"}),
    );
    let answer = json!({
        "output": {"message": {"role": "assistant", "content": [
            {"text": "It stalled: keel continued it on another replica from the text already delivered."},
            {"toolUse": {"toolUseId": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q", "name": "search_docs",
                "input": {"query": "migration per pool", "limit": 3}}}
        ]}},
        "stopReason": "tool_use",
        "usage": {"inputTokens": 412, "outputTokens": 38, "totalTokens": 1474,
            "cacheReadInputTokens": 1024, "cacheWriteInputTokens": 0},
        "metrics": {"latencyMs": 812}
    })
    .to_string();
    let mut g = c.benchmark_group("bedrock");
    g.bench_function("request", |b| {
        b.iter(|| bedrock::request(black_box(&hub)).is_ok())
    });
    g.bench_function("stream_token", |b| {
        b.iter(|| {
            out.clear();
            stream.feed(black_box(&token), &mut out).is_ok()
        })
    });
    g.bench_function("whole", |b| {
        b.iter(|| bedrock::whole(black_box(answer.as_bytes()), "bench").is_ok())
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------------
// Dialects at the upstream edge: the hub request in the dialect's words, one streamed event
// of the dialect's back in the hub's, a whole answer.

/// A Responses-API token event, as OpenAI writes it.
fn responses_delta(seq: usize, delta: &str) -> Vec<u8> {
    let v = json!({"type": "response.output_text.delta", "sequence_number": seq,
        "item_id": "msg_68af40337e3881939b4ae6d8ba1d8e3805438e46b5f69a3b", "output_index": 0,
        "content_index": 0, "delta": delta, "logprobs": []});
    format!("event: response.output_text.delta\ndata: {v}\n\n").into_bytes()
}

fn responses_benches(c: &mut Criterion) {
    use keel_core::dialect::{responses, StreamToHub};
    let chat = chat_request();
    let created = {
        let r = json!({"type": "response.created", "sequence_number": 0, "response": {
            "id": "resp_68af4030592c81938ec0a5fbab4a3e9f05438e46b5f69a3b", "object": "response",
            "created_at": 1756315696, "status": "in_progress", "model": "gpt-4.1", "output": []}});
        format!("event: response.created\ndata: {r}\n\n").into_bytes()
    };
    let pieces = pieces(Content::Text, TOKENS);
    let token = responses_delta(TOKENS / 2 + 1, &pieces[TOKENS / 2]);
    let answer = json!({"id": "resp_68af4030592c81938ec0a5fbab4a3e9f05438e46b5f69a3b", "object": "response",
        "created_at": 1756315696, "status": "completed", "model": "gpt-4.1",
        "output": [{"id": "msg_68af40337e3881939b4ae6d8ba1d8e3805438e46b5f69a3b", "type": "message",
            "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "annotations": [], "text": pieces.concat()}]}],
        "usage": {"input_tokens": 180, "input_tokens_details": {"cached_tokens": 128},
            "output_tokens": TOKENS, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 180 + TOKENS}})
    .to_string();
    let mut g = c.benchmark_group("dialect_responses");
    g.bench_function("request", |b| {
        b.iter(|| responses::request(black_box(&chat)).is_ok())
    });
    g.bench_function("token", |b| {
        b.iter_batched_ref(
            || {
                let mut s = responses::Stream::new("bench", true);
                let mut out = Vec::new();
                s.feed(&created, &mut out).expect("a Responses stream");
                for (i, p) in pieces[..TOKENS / 2].iter().enumerate() {
                    s.feed(&responses_delta(i + 1, p), &mut out)
                        .expect("a Responses stream");
                }
                (s, Vec::with_capacity(256))
            },
            |(s, out)| s.feed(black_box(&token), out).is_ok(),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("whole", |b| {
        b.iter(|| responses::whole(black_box(answer.as_bytes()), "bench").is_ok())
    });
    g.finish();
}

fn azure_benches(c: &mut Criterion) {
    use keel_core::dialect::{azure, StreamToHub};
    let filters = json!({"hate": {"filtered": false, "severity": "safe"}, "self_harm": {"filtered": false, "severity": "safe"},
        "sexual": {"filtered": false, "severity": "safe"}, "violence": {"filtered": false, "severity": "safe"}});
    let token = format!(
        "data: {}\n\n",
        json!({"choices": [{"content_filter_results": filters, "delta": {"content": " replica"}, "finish_reason": null,
            "index": 0, "logprobs": null}], "created": 1727000000, "id": "chatcmpl-AAm7r", "model": "gpt-4o-2024-08-06",
            "object": "chat.completion.chunk", "system_fingerprint": "fp_b2ffeb16ee"})
    )
    .into_bytes();
    let answer = json!({"choices": [{"content_filter_results": filters, "finish_reason": "stop", "index": 0, "logprobs": null,
            "message": {"content": pieces(Content::Text, TOKENS).concat(), "refusal": null, "role": "assistant"}}],
        "created": 1727000000, "id": "chatcmpl-AAm7r", "model": "gpt-4o-2024-08-06", "object": "chat.completion",
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": filters}],
        "usage": {"completion_tokens": TOKENS, "prompt_tokens": 180, "total_tokens": 180 + TOKENS}})
    .to_string();
    let mut g = c.benchmark_group("dialect_azure");
    g.bench_function("token", |b| {
        b.iter_batched_ref(
            || (azure::Stream::new(), Vec::with_capacity(256)),
            |(s, out)| s.feed(black_box(&token), out).is_ok(),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("whole", |b| {
        b.iter(|| azure::whole(black_box(answer.as_bytes())).is_ok())
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------------
// The summary: read back Criterion's estimates (median ns per iteration).

fn median_ns(dir: &Path, group: &str, id: &str) -> Option<f64> {
    let path = dir.join(group).join(id).join("new").join("estimates.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    v.pointer("/median/point_estimate").and_then(Value::as_f64)
}

fn summary(dir: &Path) {
    println!("\ntranslation cost, median ns per streamed token (whole: a {TOKENS}-token stream ÷ {TOKENS}; token: one delta mid-stream; first/last: the events around the tokens, per stream)");
    println!(
        "{:<20} {:<6} {:>10} {:>12} {:>8} {:>10}",
        "client/content", "what", "same ns", "translated", "ratio", "added ns"
    );
    for client in [Protocol::OpenAi, Protocol::Anthropic] {
        for content in [Content::Text, Content::ToolCall] {
            let group = format!("{}_{}", client.as_str(), content.name());
            for (what, per) in [
                ("whole", TOKENS as f64),
                ("token", 1.0),
                ("first", 1.0),
                ("last", 1.0),
            ] {
                let m = |path: &str| {
                    median_ns(dir, &group, &format!("{what}/{path}")).map(|ns| ns / per)
                };
                if let (Some(same), Some(tr)) = (m("same"), m("translated")) {
                    println!(
                        "{group:<20} {what:<6} {same:>10.0} {tr:>12.0} {:>7.2}× {:>10.0}",
                        tr / same,
                        tr - same
                    );
                }
            }
        }
    }
    for (what, base) in [
        ("chat_to_messages", "parse_chat"),
        ("messages_to_chat", "parse_messages"),
    ] {
        if let (Some(t), Some(p)) = (
            median_ns(dir, "request", what),
            median_ns(dir, "request", base),
        ) {
            println!(
                "request {what}: {t:.0} ns (parsing the same body: {p:.0} ns, {:.2}×)",
                t / p
            );
        }
    }
}

/// Where Criterion writes its estimates: `criterion` in the target directory, which holds the
/// bench binary (`<target>/<profile>/deps/translate-…`).
fn criterion_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.parent()?.parent()?.join("criterion"))
}

/// The Gemini dialect: the typical request's hub body out, a text chunk and a whole answer in.
fn gemini_benches(c: &mut Criterion) {
    let messages = chat_to_messages(&chat_request(), 4096)
        .expect("translates")
        .body;
    let usage = json!({"promptTokenCount": 412, "candidatesTokenCount": 9, "totalTokenCount": 421});
    let chunk = |text: &str| {
        let v = json!({"candidates": [{"content": {"parts": [{"text": text}], "role": "model"}, "index": 0}],
            "usageMetadata": usage, "modelVersion": "gemini-2.5-flash", "responseId": "mGo2aP7bLs2-qtsPz5WQ2A0"});
        format!("data: {v}\r\n\r\n").into_bytes()
    };
    let first = chunk("The");
    let token = chunk(" gateway");
    let words = pieces(Content::Text, TOKENS).concat();
    let answer = json!({"candidates": [{"content": {"role": "model", "parts": [{"text": words},
            {"functionCall": {"name": "search_docs", "args": {"query": "migration", "limit": 3}}}]},
            "finishReason": "STOP", "index": 0}],
        "usageMetadata": usage, "modelVersion": "gemini-2.5-flash", "responseId": "mGo2aP7bLs2-qtsPz5WQ2A0"})
    .to_string()
    .into_bytes();
    let mut g = c.benchmark_group("dialect_gemini");
    g.bench_function("request", |b| {
        b.iter(|| gemini::request(black_box(&messages)).is_ok())
    });
    g.bench_function("stream_event", |b| {
        b.iter_batched_ref(
            || {
                let mut s = gemini::Stream::new("bench");
                let mut out = Vec::new();
                s.feed(&first, &mut out).expect("a Gemini chunk");
                (s, Vec::with_capacity(256))
            },
            |(s, out)| s.feed(black_box(&token), out).is_ok(),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("whole", |b| {
        b.iter(|| gemini::whole(black_box(&answer), "bench").is_ok())
    });
    g.finish();
}

fn main() {
    let dir = criterion_dir();
    let mut c = Criterion::default()
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(3))
        .configure_from_args();
    if let Some(d) = &dir {
        c = c.output_directory(d);
    }
    for client in [Protocol::OpenAi, Protocol::Anthropic] {
        for content in [Content::Text, Content::ToolCall] {
            stream_benches(&mut c, client, content);
        }
    }
    request_benches(&mut c);
    gemini_benches(&mut c);
    bedrock_benches(&mut c);
    responses_benches(&mut c);
    azure_benches(&mut c);
    c.final_summary();
    // `cargo test --benches` (no `--bench`) and `-- --test` run each benchmark once: no
    // estimates to read.
    let args: Vec<String> = std::env::args().collect();
    let measured = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--test");
    if let Some(d) = dir.filter(|_| measured) {
        summary(&d);
    }
}
