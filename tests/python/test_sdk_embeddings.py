"""The official Python SDKs against keel demo: embeddings on `demo-embed` (whose flaky variant
keel fails over from before the answer), structured output parsed into a pydantic model on a
same-protocol and a cross-protocol pool, and Anthropic's count_tokens answered from the pools."""
import asyncio
import math
from typing import List, Literal

import anthropic
import openai
import pydantic
import pytest

TEXTS = ["keel routes requests", "to healthy servers", "and fails over before the answer"]


def openai_client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0)


def async_openai_client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0)


def check_vectors(resp, n, dims=256):
    assert resp.model == "demo-embed"
    assert [d.index for d in resp.data] == list(range(n))
    for d in resp.data:
        assert len(d.embedding) == dims
        assert abs(math.sqrt(sum(x * x for x in d.embedding)) - 1.0) < 1e-4
    assert resp.usage.prompt_tokens > 0
    return [d.embedding for d in resp.data]


def as_f32(values):
    """Rounds Python floats to float32, as the base64 encoding carries them."""
    import struct

    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values)))


def test_embeddings_float_and_base64_agree(keel_demo):
    client = openai_client(keel_demo)
    # Several rounds: the flaky variant fails some of them; keel fails over, the client never sees it.
    for _ in range(4):
        floats = check_vectors(
            client.embeddings.create(model="demo-embed", input=TEXTS, encoding_format="float"), 3
        )
        # The SDK's default: it asks for base64 and decodes the little-endian float32 bytes.
        decoded = check_vectors(client.embeddings.create(model="demo-embed", input=TEXTS), 3)
        assert decoded == [as_f32(v) for v in floats]
    # One string, token ids, and shorter vectors.
    one = client.embeddings.create(model="demo-embed", input=TEXTS[0], encoding_format="float")
    assert one.data[0].embedding == floats[0]
    ids = client.embeddings.create(model="demo-embed", input=[[1, 2, 3], [4, 5]], dimensions=32)
    check_vectors(ids, 2, dims=32)


def test_async_embeddings(keel_demo):
    async def run():
        client = async_openai_client(keel_demo)
        results = await asyncio.gather(
            *[client.embeddings.create(model="demo-embed", input=[t], encoding_format="float") for t in TEXTS],
            client.embeddings.create(model="demo-embed", input=TEXTS),
        )
        await client.close()
        return results

    *singles, together = asyncio.run(run())
    together = check_vectors(together, 3)
    for single, want in zip(singles, together):
        assert as_f32(check_vectors(single, 1)[0]) == want


def test_embeddings_errors_surface_as_sdk_exceptions(keel_demo):
    client = openai_client(keel_demo)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="demo-claude", input="x")
    assert "demo-claude" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="demo-embed", input=[])
    assert "`input`" in str(e.value)


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "parrot"]
    name: str


class Person(pydantic.BaseModel):
    name: str
    age: int
    hobbies: List[str]
    pet: Pet


PARSE_ARGS = dict(
    max_tokens=300,
    messages=[{"role": "user", "content": "Describe a person and their pet."}],
    response_format=Person,
)


@pytest.mark.parametrize("model", ["demo-gpt", "demo-claude"])
def test_chat_completions_parse_into_a_pydantic_model(keel_demo, model):
    completion = openai_client(keel_demo).chat.completions.parse(model=model, **PARSE_ARGS)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    person = choice.message.parsed
    assert isinstance(person, Person)
    # The SDK validated it; check again from the raw text.
    assert Person.model_validate_json(choice.message.content) == person
    assert completion.model == model


@pytest.mark.parametrize("model", ["demo-gpt", "demo-claude"])
def test_async_chat_completions_parse(keel_demo, model):
    async def run():
        client = async_openai_client(keel_demo)
        completion = await client.chat.completions.parse(model=model, **PARSE_ARGS)
        await client.close()
        return completion

    person = asyncio.run(run()).choices[0].message.parsed
    assert isinstance(person, Person) and person.pet.kind in ("cat", "dog", "parrot")


@pytest.mark.parametrize("model", ["demo-claude", "demo-gpt", "demo-mixed"])
def test_anthropic_count_tokens(keel_demo, model):
    client = anthropic.Anthropic(base_url=keel_demo, api_key="not-needed", max_retries=0)
    short = client.messages.count_tokens(model=model, messages=[{"role": "user", "content": "hello"}])
    long = client.messages.count_tokens(
        model=model,
        system="You are a careful assistant.",
        messages=[{"role": "user", "content": "hello, and please count these extra words too"}],
    )
    assert short.input_tokens > 0
    assert long.input_tokens > short.input_tokens
