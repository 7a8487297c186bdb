"""The official SDKs, pointed at keel's base URL, work unchanged."""
import anthropic
import openai

from sdk_helpers import read_openai_stream


def test_openai_streamed_chat_arrives_intact(keel_demo):
    client = openai.OpenAI(base_url=keel_demo + "/v1", api_key="not-needed", max_retries=0)
    whole = client.chat.completions.create(
        model="demo-gpt", messages=[{"role": "user", "content": "stream please"}]
    )
    expected = whole.choices[0].message.content
    assert expected
    # Several streams: the fleet has a flaky variant, and keel must hide it every time.
    for _ in range(8):
        stream = client.chat.completions.create(
            model="demo-gpt",
            messages=[{"role": "user", "content": "stream please"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = read_openai_stream(stream)
        assert text == expected
        assert finish == "stop"
        assert usage is not None and usage.completion_tokens > 0


def test_openai_headers_and_errors(keel_demo):
    client = openai.OpenAI(base_url=keel_demo + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="demo-gpt", messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers["x-keel-request-id"]
    # Every legitimate route: the demo fleet has a flaky variant (fallback), hedges late first
    # tokens (hedged) and may migrate a stream (migrated).
    assert raw.headers["x-keel-route"] in ("direct", "fallback", "hedged", "migrated")
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("expected NotFoundError")
    except openai.NotFoundError as e:
        assert "models you may use" in str(e)
    models = [m.id for m in client.models.list()]
    assert models == ["demo-gpt", "gpt-4o-mini", "demo-claude", "demo-mixed", "demo-clouds", "demo-embed", "demo-guarded"]


def test_anthropic_stream_and_message(keel_demo):
    client = anthropic.Anthropic(base_url=keel_demo, api_key="not-needed", max_retries=0)
    msg = client.messages.create(
        model="demo-claude", max_tokens=64, messages=[{"role": "user", "content": "hello"}]
    )
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(
        model="demo-claude", max_tokens=64, messages=[{"role": "user", "content": "hello"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text
    assert final.usage.output_tokens == msg.usage.output_tokens
    try:
        client.messages.create(model="demo-claude", messages=[{"role": "user", "content": "x"}], max_tokens=-1)
        raise AssertionError("expected BadRequestError")
    except anthropic.BadRequestError as e:
        assert "max_tokens" in str(e)


def test_openai_sdk_on_an_anthropic_protocol_pool(keel_demo):
    """Cross-protocol: the OpenAI SDK asks for the demo's Anthropic pool; keel translates."""
    client = openai.OpenAI(base_url=keel_demo + "/v1", api_key="not-needed", max_retries=0)
    whole = client.chat.completions.create(
        model="demo-claude", max_tokens=64, messages=[{"role": "user", "content": "translate me"}]
    )
    expected = whole.choices[0].message.content
    assert expected
    assert whole.model == "demo-claude"
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="demo-claude",
        max_tokens=64,
        messages=[{"role": "user", "content": "translate me"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = read_openai_stream(stream)
    assert text == expected
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0


def test_anthropic_sdk_on_an_openai_protocol_pool(keel_demo):
    """Cross-protocol: the Anthropic SDK asks for the demo's OpenAI pool; keel translates."""
    client = anthropic.Anthropic(base_url=keel_demo, api_key="not-needed", max_retries=0)
    msg = client.messages.create(
        model="demo-gpt", max_tokens=64, messages=[{"role": "user", "content": "translate me"}]
    )
    assert msg.model == "demo-gpt"
    assert msg.stop_reason in ("end_turn", "max_tokens")
    expected = "".join(b.text for b in msg.content if b.type == "text")
    assert expected
    with client.messages.stream(
        model="demo-gpt", max_tokens=64, messages=[{"role": "user", "content": "translate me"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"],
    },
}


def test_openai_sdk_streamed_tool_call_across_protocols(keel_demo):
    """A streamed tool call from an Anthropic-protocol pool arrives as OpenAI tool-call deltas."""
    import json

    client = openai.OpenAI(base_url=keel_demo + "/v1", api_key="not-needed", max_retries=0)
    args = dict(
        model="demo-claude",
        max_tokens=64,
        tools=[{"type": "function", "function": WEATHER_TOOL}],
        tool_choice="required",
        messages=[{"role": "user", "content": "what is the weather in Paris"}],
    )
    whole = client.chat.completions.create(**args)
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    name, arguments, ids, finish = "", "", set(), None
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    name += tc.function.name
                if tc.function and tc.function.arguments:
                    arguments += tc.function.arguments
    assert finish == "tool_calls"
    assert name == "get_weather"
    assert len(ids) == 1
    assert json.loads(arguments) == json.loads(call.function.arguments)
    assert "city" in json.loads(arguments)


def test_anthropic_sdk_streamed_tool_use_across_protocols(keel_demo):
    """A streamed tool call from an OpenAI-protocol pool arrives as Anthropic tool_use events."""
    client = anthropic.Anthropic(base_url=keel_demo, api_key="not-needed", max_retries=0)
    args = dict(
        model="demo-gpt",
        max_tokens=64,
        tools=[
            {
                "name": WEATHER_TOOL["name"],
                "description": WEATHER_TOOL["description"],
                "input_schema": WEATHER_TOOL["parameters"],
            }
        ],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "what is the weather in Paris"}],
    )
    whole = client.messages.create(**args)
    assert whole.stop_reason == "tool_use"
    used = [b for b in whole.content if b.type == "tool_use"]
    assert used and used[0].name == "get_weather"
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert streamed and streamed[0].name == "get_weather"
    assert streamed[0].input == used[0].input
    assert "city" in streamed[0].input


def test_both_sdks_on_the_mixed_pool(keel_demo):
    """demo-mixed holds an OpenAI- and an Anthropic-protocol variant; either client is served."""
    oa = openai.OpenAI(base_url=keel_demo + "/v1", api_key="not-needed", max_retries=0)
    an = anthropic.Anthropic(base_url=keel_demo, api_key="not-needed", max_retries=0)
    for _ in range(6):
        c = oa.chat.completions.create(
            model="demo-mixed", max_tokens=32, messages=[{"role": "user", "content": "mixed"}]
        )
        assert c.model == "demo-mixed" and c.choices[0].message.content
        m = an.messages.create(
            model="demo-mixed", max_tokens=32, messages=[{"role": "user", "content": "mixed"}]
        )
        assert m.model == "demo-mixed" and m.content[0].text
