"""The OpenAI SDK's Responses API (`client.responses`) against keel: same-protocol pools,
Anthropic-protocol pools (translated) and the mixed pool, whole, streamed, with tools and with
structured output."""
import asyncio

import openai
import pydantic
import pytest

POOLS = ["demo-gpt", "demo-claude", "demo-mixed", "demo-clouds"]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0)


@pytest.mark.parametrize("model", POOLS)
def test_whole_and_streamed_responses_agree(keel_demo, model):
    c = client(keel_demo)
    whole = c.responses.create(
        model=model, instructions="Be brief.", input="tell me about gateways", max_output_tokens=400
    )
    assert whole.object == "response"
    assert whole.model == model
    assert whole.status in ("completed", "incomplete")
    assert whole.output_text
    assert whole.usage.output_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens

    # Raw events.
    deltas, kinds = [], []
    for event in c.responses.create(
        model=model, instructions="Be brief.", input="tell me about gateways", max_output_tokens=400, stream=True
    ):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == whole.output_text

    # The SDK's stream helper accumulates the same response.
    if whole.status == "completed":
        with c.responses.stream(
            model=model, instructions="Be brief.", input="tell me about gateways", max_output_tokens=400
        ) as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            final = stream.get_final_response()
        assert text == whole.output_text
        assert final.output_text == whole.output_text
        assert final.id.startswith("resp_")


@pytest.mark.parametrize("model", POOLS)
def test_a_forced_tool_call_streams_and_round_trips(keel_demo, model):
    c = client(keel_demo)
    r = c.responses.create(
        model=model,
        input="What is the weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output
    call = calls[0]
    assert call.name == "get_weather"
    args = pydantic.TypeAdapter(dict).validate_json(call.arguments)
    assert isinstance(args["city"], str) and args["unit"] in ("c", "f")

    with c.responses.stream(
        model=model,
        input="What is the weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    ) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    final_call = [o for o in final.output if o.type == "function_call"][0]
    assert final_call.arguments == streamed
    pydantic.TypeAdapter(dict).validate_json(streamed)

    # The tool's result goes back as a function_call_output item: an answer in text.
    follow = c.responses.create(
        model=model,
        max_output_tokens=64,
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "3 C, clear"},
        ],
    )
    assert follow.output_text


class City(pydantic.BaseModel):
    name: str
    population: int
    coastal: bool


@pytest.mark.parametrize("model", ["demo-gpt", "demo-claude"])
def test_responses_parse_returns_a_validated_object(keel_demo, model):
    """Same protocol (the schema reaches the server as `response_format`) and across (keel's
    forced-tool pattern for Anthropic variants)."""
    c = client(keel_demo)
    r = c.responses.parse(model=model, input="Describe Oslo.", text_format=City)
    assert isinstance(r.output_parsed, City)
    assert City.model_validate_json(r.output_text) == r.output_parsed


def test_async_responses_whole_and_streamed(keel_demo):
    async def run():
        c = openai.AsyncOpenAI(base_url=keel_demo + "/v1", api_key="x", max_retries=0)
        whole = await c.responses.create(model="demo-mixed", input="async please", max_output_tokens=400)
        stream = await c.responses.create(
            model="demo-mixed", input="async please", max_output_tokens=400, stream=True
        )
        text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
        await c.close()
        return whole.output_text, text

    whole, streamed = asyncio.run(run())
    assert whole and streamed == whole


def test_what_keel_cannot_serve_is_a_bad_request_naming_the_field(keel_demo):
    c = client(keel_demo)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="demo-gpt", input="x", previous_response_id="resp_123")
    assert "previous_response_id" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="demo-gpt", input="x", tools=[{"type": "web_search"}])
    assert "tools[0].type" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="no-such-model", input="x")
