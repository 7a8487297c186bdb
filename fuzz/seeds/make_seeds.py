#!/usr/bin/env python3
"""Writes the seed inputs of keel's fuzz targets into fuzz/corpus/<target>/seed-*: real upstream
stream shapes (OpenAI chat/completions chunks, Anthropic events, as keel-sim and the providers
write them), requests for every endpoint, and the book's configuration (docs/src/configuration.md). Rerun after changing
it, then `cargo fuzz cmin <target>` keeps what adds coverage."""
import json, os, re, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def sse(events):
    out = b""
    for name, data in events:
        if name == ":":
            out += b":" + data.encode() + b"\n\n"
            continue
        if name:
            out += b"event: " + name.encode() + b"\n"
        if not isinstance(data, str):
            data = json.dumps(data, separators=(",", ":"))
        for line in data.split("\n"):
            out += b"data: " + line.encode() + b"\n"
        out += b"\n"
    return out


def oa(choice, **extra):
    v = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
         "model": "gpt-4o", "choices": [choice]}
    v.update(extra)
    return (None, v)


def oa_text_stream(words, finish="stop"):
    ev = [oa({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})]
    ev += [oa({"index": 0, "delta": {"content": w}, "logprobs": None, "finish_reason": None}) for w in words]
    ev.append(oa({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}))
    ev.append((None, {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "gpt-4o",
                      "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": len(words), "total_tokens": 9 + len(words)}}))
    ev.append((None, "[DONE]"))
    return ev


OA_TOOLS = [
    oa({"index": 0, "delta": {"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}, "finish_reason": None}),
    oa({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}, "finish_reason": None}),
    oa({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}, "finish_reason": None}),
    oa({"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}, "finish_reason": None}),
    oa({"index": 0, "delta": {}, "finish_reason": "tool_calls"}),
    (None, "[DONE]"),
]

OA_COMPLETIONS = [
    (None, {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": None}]})
    for t in ["Once", " upon", " a", " time"]
] + [(None, {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
             "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}}), (None, "[DONE]")]

OA_MISC = [
    oa({"index": 0, "delta": {"role": "assistant", "refusal": "I can't help with that."}, "finish_reason": None}),
    oa({"index": 0, "delta": {"reasoning_content": "Thinking..."}, "finish_reason": None}),
    (":", " keep-alive"),
    (None, {"error": {"message": "upstream overloaded", "type": "server_error", "param": None, "code": None}}),
    (None, "{not json"),
]


def an(name, data):
    data = dict(data)
    data.setdefault("type", name)
    return (name, data)


def an_text_stream(words):
    ev = [an("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
                                           "content": [], "stop_reason": None, "stop_sequence": None,
                                           "usage": {"input_tokens": 12, "output_tokens": 1}}}),
          an("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
          an("ping", {})]
    ev += [an("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": w}}) for w in words]
    ev += [an("content_block_stop", {"index": 0}),
           an("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": len(words)}}),
           an("message_stop", {})]
    return ev


AN_TOOL = [
    an("message_start", {"message": {"id": "msg_2", "type": "message", "role": "assistant", "model": "claude",
                                     "content": [], "usage": {"input_tokens": 30, "output_tokens": 1}}}),
    an("content_block_start", {"index": 0, "content_block": {"type": "thinking", "thinking": ""}}),
    an("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me see."}}),
    an("content_block_delta", {"index": 0, "delta": {"type": "signature_delta", "signature": "abc"}}),
    an("content_block_stop", {"index": 0}),
    an("content_block_start", {"index": 1, "content_block": {"type": "text", "text": ""}}),
    an("content_block_delta", {"index": 1, "delta": {"type": "text_delta", "text": "Checking."}}),
    an("content_block_stop", {"index": 1}),
    an("content_block_start", {"index": 2, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}}),
    an("content_block_delta", {"index": 2, "delta": {"type": "input_json_delta", "partial_json": ""}}),
    an("content_block_delta", {"index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"city\": \"Par"}}),
    an("content_block_delta", {"index": 2, "delta": {"type": "input_json_delta", "partial_json": "is\"}"}}),
    an("content_block_stop", {"index": 2}),
    an("message_delta", {"delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 40}}),
    an("message_stop", {}),
]

AN_ERROR = [an("message_start", {"message": {"id": "m", "usage": {"input_tokens": 1}}}),
            ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})]

STREAMS = {
    "openai-chat": oa_text_stream(["Hello", ",", " world", "."]),
    "openai-tools": OA_TOOLS,
    "openai-completions": OA_COMPLETIONS,
    "openai-misc": OA_MISC,
    "anthropic-text": an_text_stream(["Hi", " there", "!"]),
    "anthropic-tools": AN_TOOL,
    "anthropic-error": AN_ERROR,
}


def segmented(first, second, marker=":segment"):
    # A stream cut after three events, continued by a second segment.
    return sse(first[:3]) + marker.encode() + b"\n\n" + sse(second)


REQUESTS = {
    "chat": {"model": "gpt", "messages": [{"role": "system", "content": "You are terse."},
                                         {"role": "user", "content": "Say hi"}], "stream": True, "max_tokens": 100, "user": "u1"},
    "chat-parts": {"model": "gpt", "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                                                              {"type": "image_url", "image_url": {"url": "data:,"}}]},
                                               {"role": "assistant", "content": "It is"}],
                   "max_completion_tokens": 20, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    "completions": {"model": "gpt", "prompt": "Once upon", "max_tokens": 16, "stream": False},
    "completions-array": {"model": "gpt", "prompt": ["a", "b"], "max_tokens": None},
    "messages": {"model": "claude", "max_tokens": 1024, "system": [{"type": "text", "text": "Be brief."}],
                 "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": [{"type": "text", "text": "Sure:"}]}],
                 "metadata": {"user_id": "abc"}, "stream": True},
    "count-tokens": {"model": "claude", "messages": [{"role": "user", "content": "count me"}]},
    "long-prefix": {"model": "gpt", "messages": [{"role": "system", "content": "You are a helpful assistant. " * 20},
                                                {"role": "user", "content": "q"}]},
}


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def main():
    for name, ev in STREAMS.items():
        body = sse(ev)
        for t in ("chunk_events", "assemble", "stitch"):
            write(t, name, body)
        write("sse_decoder", name, b"\x03\x07\x00\x1f" + body)
        write("sse_decoder", name + "-crlf", b"\x00" + body.replace(b"\n", b"\r\n"))
        write("sse_decoder", name + "-cr-small", b"\x82\x02\x05" + body.replace(b"\n", b"\r"))
    write("stitch", "openai-migrated", segmented(STREAMS["openai-chat"], oa_text_stream([" world", ".", " Bye"])))
    write("stitch", "openai-instruction", segmented(STREAMS["openai-chat"], oa_text_stream([",", " world"]), ":segment trim"))
    write("stitch", "openai-completions-migrated", segmented(OA_COMPLETIONS, OA_COMPLETIONS[2:], ":segment trim"))
    write("stitch", "anthropic-migrated", sse(AN_TOOL[:7]) + b":segment\n\n" + sse(an_text_stream([" more", "."])))
    write("stitch", "anthropic-twice", segmented(an_text_stream(["a", "b"]), an_text_stream(["c"])) + b":segment trim\n\n" + sse(an_text_stream(["c", "d"])))
    for name, req in REQUESTS.items():
        write("request_parse", name, json.dumps(req).encode())
    chapter = open(os.path.join(ROOT, "docs", "src", "configuration.md")).read()
    m = re.search(r"```toml\n(listen = .*?)```", chapter, re.S)
    if m:
        write("config_parse", "readme", m.group(1).encode())
    write("config_parse", "minimal", b'[[pools]]\nname = "m"\n[[pools.variants]]\nname = "a"\nurl = "http://127.0.0.1:1/v1"\n'
          b'protocol = "openai"\nupstream_model = "x"\napi_key = "${KEY}"\n')


if __name__ == "__main__":
    sys.exit(main())
