"""The official OpenAI and Anthropic SDKs through keel against every cloud dialect: each of the
demo's `demo-clouds` variants (Bedrock, Vertex AI Claude, Gemini, Azure OpenAI, the Responses
API, all on keel-sim in their own wire formats) pinned in turn, whole and streamed, a tool call,
structured output, and an upstream error reaching the SDK as its own exception type."""
import json

import anthropic
import openai
import pytest

CLOUDS = ["clouds-bedrock", "clouds-vertex", "clouds-gemini", "clouds-azure", "clouds-responses"]
PROMPT = [{"role": "user", "content": "tell me about the clouds"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


def pinned(variant):
    return {"x-keel-force-variant": variant}


def openai_client(demo):
    return openai.OpenAI(base_url=demo.url + "/v1", api_key="not-needed", max_retries=0)


def anthropic_client(demo):
    return anthropic.Anthropic(base_url=demo.url, api_key="not-needed", max_retries=0)


@pytest.mark.parametrize("variant", CLOUDS)
def test_openai_sdk_whole_and_streamed_on_each_cloud(faults, variant):
    client = openai_client(faults)
    # A pinned request may still be hedged on a loaded machine (the hedge then answers from
    # another cloud): asked again, as a client would, until the pinned cloud answers itself.
    for _ in range(5):
        raw = client.chat.completions.with_raw_response.create(
            model="demo-clouds", max_tokens=48, messages=PROMPT, extra_headers=pinned(variant)
        )
        if "hedged" not in raw.headers.get("x-keel-route", ""):
            break
    assert raw.headers["x-keel-variant"] == variant
    whole = raw.parse()
    assert whole.model == "demo-clouds" and whole.choices[0].message.content
    text, finish, usage = "", None, None
    stream = client.chat.completions.create(
        model="demo-clouds",
        max_tokens=48,
        messages=PROMPT,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=pinned(variant),
    )
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("variant", CLOUDS)
def test_anthropic_sdk_whole_and_streamed_on_each_cloud(faults, variant):
    client = anthropic_client(faults)
    whole = client.messages.create(model="demo-clouds", max_tokens=48, messages=PROMPT, extra_headers=pinned(variant))
    assert whole.content[0].text
    with client.messages.stream(
        model="demo-clouds", max_tokens=48, messages=PROMPT, extra_headers=pinned(variant)
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        assert stream.response.headers["x-keel-variant"] == variant
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason


@pytest.mark.parametrize("variant", CLOUDS)
def test_tool_calls_and_structured_output_on_each_cloud(faults, variant):
    oa = openai_client(faults)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER_SCHEMA}}
    r = oa.chat.completions.create(
        model="demo-clouds",
        max_tokens=64,
        tools=[tool],
        tool_choice="required",
        messages=[{"role": "user", "content": "weather in Paris?"}],
        extra_headers=pinned(variant),
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    r = oa.chat.completions.create(
        model="demo-clouds",
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": WEATHER_SCHEMA, "strict": True}},
        messages=[{"role": "user", "content": "a city, as JSON"}],
        extra_headers=pinned(variant),
    )
    assert isinstance(json.loads(r.choices[0].message.content)["city"], str)
    an = anthropic_client(faults)
    m = an.messages.create(
        model="demo-clouds",
        max_tokens=64,
        tools=[{"name": "get_weather", "description": "weather", "input_schema": WEATHER_SCHEMA}],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "weather in Paris?"}],
        extra_headers=pinned(variant),
    )
    used = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and used and isinstance(used[0].input["city"], str)


@pytest.mark.parametrize("variant", CLOUDS)
def test_a_cloud_error_reaches_each_sdk_as_its_own_exception(faults, variant):
    """The cloud answers 400 in its own words (Bedrock's ValidationException, Google's
    INVALID_ARGUMENT, …): a client error, returned in the client's protocol, not failed over."""
    faults.add_fault(variant, kind="error", status=400)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(faults).chat.completions.create(
            model="demo-clouds", max_tokens=16, messages=PROMPT, extra_headers=pinned(variant)
        )
    assert e.value.status_code == 400
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client(faults).messages.create(
            model="demo-clouds", max_tokens=16, messages=PROMPT, extra_headers=pinned(variant)
        )
    assert e.value.status_code == 400
