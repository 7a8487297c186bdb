"""The official SDKs see keel's resilience as one clean answer, or as their own error types.

Runs against a `keel demo` of its own (the `faults` fixture), into whose simulated servers the
tests inject faults. The demo lets a request pin its first attempt to a variant
(`x-keel-force-variant`), so a fault aimed at that variant's server hits this request.
The simulator's answer is deterministic per prompt, whichever server gives it: an answer that
survived a migration must equal the same request's un-faulted answer.
"""
import asyncio
import json
import time

import anthropic
import openai
import pytest

from sdk_helpers import Timeline, read_openai_stream

PROMPT = [{"role": "user", "content": "tell me how a gateway survives a broken stream"}]
MAX_TOKENS = 48

# (pool, the variant the stream starts on and loses after a few tokens): same protocol for
# each client, across protocols, and both ways through the mixed pool.
MIGRATIONS = [
    ("demo-gpt", "gpt-b"),
    ("demo-claude", "claude-a"),
    ("demo-mixed", "mixed-openai"),
    ("demo-mixed", "mixed-anthropic"),
    ("demo-clouds", "clouds-bedrock"),
    ("demo-clouds", "clouds-gemini"),
]
POOLS = ["demo-gpt", "demo-claude", "demo-mixed", "demo-clouds"]

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"],
    },
}


def openai_client(demo, max_retries=0, **kw):
    return openai.OpenAI(base_url=demo.url + "/v1", api_key="not-needed", max_retries=max_retries, **kw)


def anthropic_client(demo, max_retries=0, **kw):
    return anthropic.Anthropic(base_url=demo.url, api_key="not-needed", max_retries=max_retries, **kw)


def pinned(variant):
    return {"x-keel-force-variant": variant}


def break_stream_of(demo, variant):
    """The variant's server drops the connection after five tokens of every answer."""
    demo.add_fault(variant, kind="close", after_tokens=5)


def assert_migrated(demo, request_id, variant):
    """keel's record of the request: the pinned variant failed mid-stream and a continuation on
    another variant finished the answer. (A hedge raced against a late first token may be
    recorded too.)"""
    attempts = demo.decision(request_id)["attempts"]
    first = [a for a in attempts if a["kind"] == "first"]
    assert first[0]["variant"] == variant and first[0]["outcome"] != "ok", attempts
    # The record lists attempts as they settle: a hedge that lost its race may end after the
    # continuation that finished the answer.
    finished = [a for a in attempts if a["kind"] == "continuation" and a["outcome"] == "ok"]
    assert len(finished) == 1, attempts
    assert finished[0]["variant"] != variant, attempts


def hedge_won_first(attempts):
    """Whether a hedge won the race for the first token: the pinned first attempt was
    cancelled before it answered, so the fault aimed at it never met this request."""
    first = [a for a in attempts if a["kind"] == "first"]
    won = [a for a in attempts if a["kind"] == "hedge" and a["outcome"] == "ok"]
    return bool(first and won) and first[0]["outcome"] == "race_cancelled"


def migrating(demo, variant, attempt, tries=3):
    """Runs `attempt()` (requests pinned to `variant`, with their own checks of the answer; it
    returns their request ids) until keel's records show each stream started on `variant`, then
    checks the migration. On a loaded machine a late first token can be hedged and the hedge
    win: keel did its job, but not the one under test, so the scenario is run again."""
    for _ in range(tries):
        ids = attempt()
        if not any(hedge_won_first(demo.decision(i)["attempts"]) for i in ids):
            for i in ids:
                assert_migrated(demo, i, variant)
            return
    pytest.fail(f"a hedge won the first token in each of {tries} tries: no migration was exercised")


def assert_schema_valid(args):
    """The tool's arguments fit WEATHER's schema."""
    props = WEATHER["schema"]["properties"]
    assert isinstance(args.get("city"), str) and args["city"], args
    assert set(args) <= set(props), args
    if "unit" in args:
        assert args["unit"] in props["unit"]["enum"], args


# 1. A stream that breaks mid-way migrates; the SDK sees one clean answer.


@pytest.mark.parametrize("pool,variant", MIGRATIONS)
def test_openai_stream_survives_a_migration(faults, pool, variant):
    client = openai_client(faults)
    expected = client.chat.completions.create(model=pool, max_tokens=MAX_TOKENS, messages=PROMPT)
    break_stream_of(faults, variant)

    def attempt():
        raw = client.chat.completions.with_raw_response.create(
            model=pool,
            max_tokens=MAX_TOKENS,
            messages=PROMPT,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=pinned(variant),
        )
        text, finish, usage = read_openai_stream(raw.parse())
        assert text == expected.choices[0].message.content
        assert finish == expected.choices[0].finish_reason
        assert usage is not None and usage.completion_tokens == expected.usage.completion_tokens
        return [raw.headers["x-keel-request-id"]]

    migrating(faults, variant, attempt)


@pytest.mark.parametrize("pool,variant", MIGRATIONS)
def test_openai_whole_answer_survives_a_migration(faults, pool, variant):
    """A non-streamed answer is assembled before its headers leave: they say `migrated`."""
    client = openai_client(faults)
    expected = client.chat.completions.create(model=pool, max_tokens=MAX_TOKENS, messages=PROMPT)
    break_stream_of(faults, variant)

    def attempt():
        raw = client.chat.completions.with_raw_response.create(
            model=pool, max_tokens=MAX_TOKENS, messages=PROMPT, extra_headers=pinned(variant)
        )
        got = raw.parse()
        assert got.choices[0].message.content == expected.choices[0].message.content
        assert got.choices[0].finish_reason == expected.choices[0].finish_reason
        rid = raw.headers["x-keel-request-id"]
        if not hedge_won_first(faults.decision(rid)["attempts"]):
            assert raw.headers["x-keel-route"] == "migrated"
        return [rid]

    migrating(faults, variant, attempt)


@pytest.mark.parametrize("pool,variant", MIGRATIONS)
def test_anthropic_stream_helper_survives_a_migration(faults, pool, variant):
    client = anthropic_client(faults)
    expected = client.messages.create(model=pool, max_tokens=MAX_TOKENS, messages=PROMPT)
    break_stream_of(faults, variant)

    def attempt():
        with client.messages.stream(
            model=pool, max_tokens=MAX_TOKENS, messages=PROMPT, extra_headers=pinned(variant)
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
            request_id = stream.response.headers["x-keel-request-id"]
        assert text == expected.content[0].text
        assert final.content[0].text == text
        assert final.stop_reason == expected.stop_reason
        assert final.usage.output_tokens == expected.usage.output_tokens
        return [request_id]

    migrating(faults, variant, attempt)


# 2. Streamed tool use through the SDKs' stream helpers, same protocol and across.

ANTHROPIC_TOOL = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["schema"]}
OPENAI_TOOL = {
    "type": "function",
    "function": {"name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["schema"]},
}
TOOL_PROMPT = [{"role": "user", "content": "what is the weather in Paris"}]


@pytest.mark.parametrize("pool", ["demo-claude", "demo-gpt", "demo-clouds"])
def test_anthropic_stream_helper_with_a_forced_tool(faults, pool):
    client = anthropic_client(faults)
    partial, snapshot = "", None
    with client.messages.stream(
        model=pool,
        max_tokens=MAX_TOKENS,
        tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "tool", "name": WEATHER["name"]},
        messages=TOOL_PROMPT,
    ) as stream:
        for event in stream:
            if event.type == "input_json":
                partial += event.partial_json
                snapshot = event.snapshot
        final = stream.get_final_message()
    assert partial, "no input_json events"
    assert final.stop_reason == "tool_use"
    used = [b for b in final.content if b.type == "tool_use"]
    assert len(used) == 1 and used[0].name == WEATHER["name"] and used[0].id
    assert used[0].input == json.loads(partial) == snapshot
    assert_schema_valid(used[0].input)


@pytest.mark.parametrize("pool", ["demo-gpt", "demo-claude", "demo-clouds"])
def test_openai_stream_helper_with_a_forced_tool(faults, pool):
    client = openai_client(faults)
    deltas, done = "", None
    with client.chat.completions.stream(
        model=pool,
        max_tokens=MAX_TOKENS,
        tools=[OPENAI_TOOL],
        tool_choice={"type": "function", "function": {"name": WEATHER["name"]}},
        messages=TOOL_PROMPT,
    ) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                deltas += event.arguments_delta
            elif event.type == "tool_calls.function.arguments.done":
                done = event
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    calls = final.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == WEATHER["name"] and calls[0].id
    assert done is not None and done.name == WEATHER["name"]
    args = json.loads(calls[0].function.arguments)
    assert args == json.loads(deltas) == json.loads(done.arguments)
    assert_schema_valid(args)


# 3. The async clients, whole and streamed, same protocol and across, and through a migration.


@pytest.mark.parametrize("pool", POOLS)
def test_async_openai_whole_and_streamed(faults, pool):
    async def run():
        client = openai.AsyncOpenAI(base_url=faults.url + "/v1", api_key="not-needed", max_retries=0)
        whole = await client.chat.completions.create(model=pool, max_tokens=MAX_TOKENS, messages=PROMPT)
        stream = await client.chat.completions.create(
            model=pool, max_tokens=MAX_TOKENS, messages=PROMPT, stream=True, stream_options={"include_usage": True}
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        await client.close()
        return whole, text, finish, usage

    whole, text, finish, usage = asyncio.run(run())
    assert whole.model == pool and text and text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("pool", POOLS)
def test_async_anthropic_whole_and_streamed(faults, pool):
    async def run():
        client = anthropic.AsyncAnthropic(base_url=faults.url, api_key="not-needed", max_retries=0)
        whole = await client.messages.create(model=pool, max_tokens=MAX_TOKENS, messages=PROMPT)
        async with client.messages.stream(model=pool, max_tokens=MAX_TOKENS, messages=PROMPT) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        await client.close()
        return whole, text, final

    whole, text, final = asyncio.run(run())
    assert whole.model == pool and text and text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("pool,variant", [("demo-mixed", "mixed-openai"), ("demo-claude", "claude-b")])
def test_async_streams_survive_a_migration(faults, pool, variant):
    async def run():
        oa = openai.AsyncOpenAI(base_url=faults.url + "/v1", api_key="not-needed", max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=faults.url, api_key="not-needed", max_retries=0)
        expected = await oa.chat.completions.create(model=pool, max_tokens=MAX_TOKENS, messages=PROMPT)
        break_stream_of(faults, variant)
        raw = await oa.chat.completions.with_raw_response.create(
            model=pool, max_tokens=MAX_TOKENS, messages=PROMPT, stream=True, extra_headers=pinned(variant)
        )
        chat_text = ""
        async for chunk in raw.parse():
            for choice in chunk.choices:
                chat_text += choice.delta.content or ""
        async with an.messages.stream(
            model=pool, max_tokens=MAX_TOKENS, messages=PROMPT, extra_headers=pinned(variant)
        ) as stream:
            message_text = "".join([t async for t in stream.text_stream])
            message_id = stream.response.headers["x-keel-request-id"]
        await oa.close()
        await an.close()
        return expected.choices[0].message.content, chat_text, raw.headers["x-keel-request-id"], message_text, message_id

    def attempt():
        expected, chat_text, chat_id, message_text, message_id = asyncio.run(run())
        assert chat_text == expected and message_text == expected
        return [chat_id, message_id]

    migrating(faults, variant, attempt)


# 4. keel's 503 with retry-after: each SDK waits exactly what keel told it.

# What the pool's two servers ask for (keel passes the variants' own wait on to the client).
UPSTREAM_WAIT_S = {"claude-a": 0.45, "claude-b": 0.65}


def refuse_every_variant(demo, status):
    for variant, wait in UPSTREAM_WAIT_S.items():
        demo.add_fault(variant, kind="error", status=status, retry_after_s=wait)


def test_keel_answers_503_with_both_retry_after_headers(faults):
    import httpx

    refuse_every_variant(faults, 429)
    r = httpx.post(
        faults.url + "/v1/messages",
        json={"model": "demo-claude", "max_tokens": 16, "messages": PROMPT},
        headers={"anthropic-version": "2023-06-01"},
    )
    assert r.status_code == 503
    ms = int(r.headers["retry-after-ms"])
    assert ms in [round(s * 1000) for s in UPSTREAM_WAIT_S.values()]
    assert int(r.headers["retry-after"]) == -(-ms // 1000)
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"


def make_retrying_client(sdk, demo, timeline, asynchronous):
    if sdk == "openai":
        http = (openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient)(
            event_hooks=timeline.hooks(asynchronous)
        )
        cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return cls(base_url=demo.url + "/v1", api_key="not-needed", max_retries=1, http_client=http)
    http = (anthropic.DefaultAsyncHttpxClient if asynchronous else anthropic.DefaultHttpxClient)(
        event_hooks=timeline.hooks(asynchronous)
    )
    cls = anthropic.AsyncAnthropic if asynchronous else anthropic.Anthropic
    return cls(base_url=demo.url, api_key="not-needed", max_retries=1, http_client=http)


def ask(sdk, client):
    """One request in the client's own API (a coroutine for an async client)."""
    if sdk == "openai":
        return client.chat.completions.create(model="demo-claude", max_tokens=16, messages=PROMPT)
    return client.messages.create(model="demo-claude", max_tokens=16, messages=PROMPT)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("sdk,upstream_status", [("openai", 429), ("anthropic", 503)])
def test_sdk_waits_what_keel_says(faults, sdk, upstream_status, asynchronous):
    """The one timing check of the retry contract: the SDK's pause before its retry is keel's
    retry-after-ms, within 50 ms (both SDKs honour `retry-after-ms` exactly, without jitter,
    for any value up to a minute)."""
    refuse_every_variant(faults, upstream_status)
    errors = openai if sdk == "openai" else anthropic
    # Never earlier than told; at most 50 ms later. A loaded machine can only delay a timer, so
    # the overshoot is judged on the best of three tries (each is printed).
    overshoots = []
    for _ in range(3):
        timeline = Timeline()
        client = make_retrying_client(sdk, faults, timeline, asynchronous)
        with pytest.raises(errors.InternalServerError) as err:
            if asynchronous:
                asyncio.run(ask(sdk, client))
            else:
                ask(sdk, client)
        assert err.value.status_code == 503
        assert "no variant of `demo-claude` could serve the request" in str(err.value)
        waited, told = timeline.waited_and_told()
        print(f"{sdk} ({'async' if asynchronous else 'sync'}): keel said {told * 1000:.0f} ms, the SDK waited {waited * 1000:.1f} ms")
        assert 0.3 <= told <= 0.8
        assert waited >= told - 0.005, "the SDK retried before keel's retry-after-ms"
        overshoots.append(waited - told)
        if overshoots[-1] <= 0.05:
            break
    assert min(overshoots) <= 0.05, overshoots


# 5. keel's own 4xx arrive as each SDK's own exception types, with keel's message.


def test_openai_sdk_error_types(faults):
    client = openai_client(faults)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=PROMPT)
    assert "no-such-model" in e.value.message and "models you may use" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo-gpt", messages="not a list")
    assert e.value.status_code == 400 and "messages" in e.value.message
    with pytest.raises(openai.APIStatusError) as e:
        client.get("/chat/completions", cast_to=object)
    assert e.value.status_code == 405 and "method GET is not allowed" in e.value.message
    # The demo keeps the default max_body_bytes (10 MiB).
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(
            model="demo-gpt", messages=[{"role": "user", "content": "x" * (10 * 1024 * 1024 + 1)}]
        )
    assert e.value.status_code == 413


def test_anthropic_sdk_error_types(faults):
    client = anthropic_client(faults)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=16, messages=PROMPT)
    assert "no-such-model" in e.value.message and "models you may use" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="demo-claude", max_tokens=-1, messages=PROMPT)
    assert "max_tokens" in e.value.message
    with pytest.raises(anthropic.APIStatusError) as e:
        client.get("/v1/messages", cast_to=object)
    assert e.value.status_code == 405 and "method GET is not allowed" in e.value.message
    with pytest.raises(anthropic.ContentTooLargeError) as e:
        client.messages.create(
            model="demo-claude", max_tokens=16, messages=[{"role": "user", "content": "x" * (10 * 1024 * 1024 + 1)}]
        )
    assert e.value.status_code == 413
