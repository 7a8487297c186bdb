"""keel-sim's dialects, checked by the clouds' own SDKs.

One `keel sim` server answers Azure OpenAI, Gemini (AI Studio and Vertex AI), Vertex AI's
Claude, Bedrock Converse and the OpenAI Responses API by path. These tests drive it with the
official clients (openai, google-genai with google-auth's service-account JWT grant against the
sim's /token, anthropic's AnthropicVertex, boto3 with SigV4): if an SDK reads what the sim
writes (whole answers, streams, tool calls, errors as the SDK's own exception types), the sim
speaks the dialect as the cloud does, and tests of keel against the sim test it against the
clouds' formats.
"""
import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from keel_demo import KEEL, free_port

os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("no_proxy", "127.0.0.1,localhost")

import anthropic  # noqa: E402
import boto3  # noqa: E402
import botocore.config  # noqa: E402
import botocore.exceptions  # noqa: E402
import openai  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import rsa  # noqa: E402
from google import genai  # noqa: E402
from google.genai import errors as genai_errors  # noqa: E402
from google.genai import types  # noqa: E402
from google.oauth2 import service_account  # noqa: E402
import google.auth.transport.requests  # noqa: E402

PROMPT = "Tell me about the harbour at dawn"
MAX_TOKENS = 1024
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


class Sim:
    def __init__(self, proc, base):
        self.proc = proc
        self.base = base

    def _http(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)

    def add_fault(self, **spec):
        self._http("POST", "/sim/faults", spec)

    def clear_faults(self):
        self._http("DELETE", "/sim/faults")

    def stats(self):
        return self._http("GET", "/sim/stats")


@pytest.fixture(scope="module")
def sim():
    log = tempfile.TemporaryFile(mode="w+")
    for _ in range(5):
        port = free_port()
        proc = subprocess.Popen(
            [KEEL, "sim", "--servers", "1", "--base-port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, text=True,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while proc.poll() is None and time.time() < deadline:
            try:
                with urllib.request.urlopen(base + "/health", timeout=1):
                    break
            except Exception:
                time.sleep(0.1)
        if proc.poll() is None:
            s = Sim(proc, base)
            yield s
            proc.terminate()
            proc.wait(timeout=20)
            return
    log.seek(0)
    raise RuntimeError("keel sim did not start:\n" + log.read())


@pytest.fixture
def fresh(sim):
    """The sim with no fault active before and after the test."""
    sim.clear_faults()
    yield sim
    sim.clear_faults()


def reference_text(sim, prompt=PROMPT):
    """The answer the sim gives the prompt over Anthropic Messages (the Anthropic-hub
    dialects' text must be the same)."""
    client = anthropic.Anthropic(base_url=sim.base, api_key="k", max_retries=0)
    r = client.messages.create(
        model="sim", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}]
    )
    return r.content[0].text


# --- Azure OpenAI ---------------------------------------------------------------------------

def azure(sim):
    return openai.AzureOpenAI(
        azure_endpoint=sim.base, api_key="k", api_version="2024-10-21", max_retries=0
    )


def test_azure_whole_stream_tool_and_429(fresh):
    client = azure(fresh)
    plain = openai.OpenAI(base_url=fresh.base + "/v1", api_key="k", max_retries=0)
    msgs = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=MAX_TOKENS)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.model_extra["prompt_filter_results"][0]["prompt_index"] == 0
    same = plain.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=MAX_TOKENS)
    assert whole.choices[0].message.content == same.choices[0].message.content

    chunks = list(client.chat.completions.create(
        model="gpt-4o", messages=msgs, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices == [] and "prompt_filter_results" in chunks[0].model_extra
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    tool = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}],
        tool_choice="required",
    )
    call = tool.choices[0].message.tool_calls[0]
    assert tool.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)

    fresh.add_fault(kind="error", status=429, retry_after_s=2, count=1)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="gpt-4o", messages=msgs)
    assert e.value.status_code == 429
    assert e.value.response.headers["retry-after-ms"] == "2000"
    assert e.value.body["code"] == "429"


# --- Gemini (AI Studio) ---------------------------------------------------------------------

def gemini(sim):
    return genai.Client(api_key="k", http_options=types.HttpOptions(base_url=sim.base))


def weather_tool():
    return types.Tool(function_declarations=[types.FunctionDeclaration(
        name="get_weather", description="The weather in a city",
        parameters=types.Schema(
            type="OBJECT", properties={"city": types.Schema(type="STRING")}, required=["city"]
        ),
    )])


def test_gemini_whole_stream_prefill_tool_and_429(fresh):
    client = gemini(fresh)
    config = types.GenerateContentConfig(max_output_tokens=MAX_TOKENS)
    whole = client.models.generate_content(model="gemini-2.0-flash", contents=PROMPT, config=config)
    assert whole.text == reference_text(fresh)
    assert whole.candidates[0].finish_reason == types.FinishReason.STOP
    assert whole.usage_metadata.prompt_token_count > 0
    assert whole.usage_metadata.candidates_token_count > 0

    chunks = list(client.models.generate_content_stream(
        model="gemini-2.0-flash", contents=PROMPT, config=config
    ))
    assert "".join(c.text or "" for c in chunks) == whole.text
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    assert chunks[-1].usage_metadata.candidates_token_count == whole.usage_metadata.candidates_token_count

    # A trailing `model` turn is continued, as an Anthropic prefill is.
    cut = len(whole.text) // 2
    cut = whole.text.rindex(" ", 0, cut)
    rest = client.models.generate_content(
        model="gemini-2.0-flash",
        contents=[
            types.Content(role="user", parts=[types.Part(text=PROMPT)]),
            types.Content(role="model", parts=[types.Part(text=whole.text[:cut])]),
        ],
        config=config,
    )
    assert whole.text[:cut] + rest.text == whole.text

    tool = client.models.generate_content(
        model="gemini-2.0-flash", contents="What is the weather in Oslo?",
        config=types.GenerateContentConfig(
            tools=[weather_tool()],
            tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(mode="ANY")),
        ),
    )
    assert tool.function_calls[0].name == "get_weather"
    assert "city" in tool.function_calls[0].args

    fresh.add_fault(kind="error", status=429, count=1)
    with pytest.raises(genai_errors.ClientError) as e:
        client.models.generate_content(model="gemini-2.0-flash", contents=PROMPT)
    assert e.value.code == 429 and e.value.status == "RESOURCE_EXHAUSTED"

    # A safety stop is a finished answer, not an error.
    fresh.add_fault(kind="refusal", after_tokens=2, count=1)
    stopped = client.models.generate_content(model="gemini-2.0-flash", contents=PROMPT, config=config)
    assert stopped.candidates[0].finish_reason == types.FinishReason.SAFETY


# --- Vertex AI (Gemini through a service account's JWT grant; Claude) ------------------------

def service_account_credentials(sim):
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    info = {
        "type": "service_account", "project_id": "sim-project", "private_key_id": "sim-key-1",
        "private_key": pem, "client_email": "keel@sim-project.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": sim.base + "/token",
    }
    return service_account.Credentials.from_service_account_info(
        info, scopes=["https://www.googleapis.com/auth/cloud-platform"]
    )


def test_vertex_gemini_through_the_jwt_grant(fresh):
    creds = service_account_credentials(fresh)
    client = genai.Client(
        vertexai=True, project="sim-project", location="us-central1", credentials=creds,
        http_options=types.HttpOptions(base_url=fresh.base),
    )
    config = types.GenerateContentConfig(max_output_tokens=MAX_TOKENS)
    before = fresh.stats()["tokens_issued"]
    whole = client.models.generate_content(model="gemini-2.0-flash", contents=PROMPT, config=config)
    assert fresh.stats()["tokens_issued"] == before + 1
    assert whole.text == reference_text(fresh)
    chunks = list(client.models.generate_content_stream(
        model="gemini-2.0-flash", contents=PROMPT, config=config
    ))
    assert "".join(c.text or "" for c in chunks) == whole.text
    tool = client.models.generate_content(
        model="gemini-2.0-flash", contents="What is the weather in Oslo?",
        config=types.GenerateContentConfig(
            tools=[weather_tool()],
            tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(mode="ANY")),
        ),
    )
    assert tool.function_calls[0].name == "get_weather"
    # The token is reused: no fetch after the first.
    assert fresh.stats()["tokens_issued"] == before + 1

    fresh.add_fault(kind="error", status=503, count=1)
    with pytest.raises(genai_errors.ServerError) as e:
        client.models.generate_content(model="gemini-2.0-flash", contents=PROMPT)
    assert e.value.code == 503 and e.value.status == "UNAVAILABLE"


def test_vertex_wants_a_bearer(fresh):
    # Without a bearer at all, Vertex answers 401 in Google's words.
    req = urllib.request.Request(
        fresh.base + "/v1/projects/p/locations/l/publishers/google/models/m:generateContent",
        data=json.dumps({"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}).encode(),
        method="POST", headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401
    assert json.load(e.value)["error"]["status"] == "UNAUTHENTICATED"


def test_anthropic_vertex_whole_stream_tool_and_429(fresh):
    creds = service_account_credentials(fresh)
    creds.refresh(google.auth.transport.requests.Request())
    client = anthropic.AnthropicVertex(
        region="us-east5", project_id="sim-project", access_token=creds.token,
        base_url=fresh.base + "/v1", max_retries=0,
    )
    model = "claude-sonnet-4@20250514"
    msgs = [{"role": "user", "content": PROMPT}]
    whole = client.messages.create(model=model, max_tokens=MAX_TOKENS, messages=msgs)
    assert whole.content[0].text == reference_text(fresh)
    assert whole.stop_reason == "end_turn" and whole.model == model
    with client.messages.stream(model=model, max_tokens=MAX_TOKENS, messages=msgs) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text and final.stop_reason == "end_turn"

    tool = client.messages.create(
        model=model, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=[{"name": "get_weather", "input_schema": WEATHER_SCHEMA}],
        tool_choice={"type": "any"},
    )
    assert tool.stop_reason == "tool_use"
    assert tool.content[0].name == "get_weather" and "city" in tool.content[0].input

    fresh.add_fault(kind="error", status=429, count=1)
    with pytest.raises(anthropic.RateLimitError) as e:
        client.messages.create(model=model, max_tokens=MAX_TOKENS, messages=msgs)
    assert e.value.status_code == 429

    # Vertex wants `anthropic_version` in the body.
    req = urllib.request.Request(
        fresh.base + f"/v1/projects/p/locations/us-east5/publishers/anthropic/models/{model}:rawPredict",
        data=json.dumps({"max_tokens": 8, "messages": msgs}).encode(), method="POST",
        headers={"content-type": "application/json", "authorization": f"Bearer {creds.token}"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400
    assert "anthropic_version" in json.load(e.value)["error"]["message"]


# --- Bedrock Converse -----------------------------------------------------------------------

def bedrock(sim):
    return boto3.client(
        "bedrock-runtime", region_name="us-east-1", endpoint_url=sim.base,
        aws_access_key_id="AKIDSIMULATED", aws_secret_access_key="not-a-secret",
        config=botocore.config.Config(retries={"total_max_attempts": 1, "mode": "standard"}),
    )


BEDROCK_MODEL = "anthropic.claude-3-5-sonnet-20240620-v1:0"


def test_bedrock_converse_whole_stream_tool_and_errors(fresh):
    client = bedrock(fresh)
    msgs = [{"role": "user", "content": [{"text": PROMPT}]}]
    cfg = {"maxTokens": MAX_TOKENS}
    whole = client.converse(modelId=BEDROCK_MODEL, messages=msgs, inferenceConfig=cfg)
    text = whole["output"]["message"]["content"][0]["text"]
    assert text == reference_text(fresh)
    assert whole["stopReason"] == "end_turn"
    assert whole["usage"]["outputTokens"] > 0

    events = list(client.converse_stream(modelId=BEDROCK_MODEL, messages=msgs, inferenceConfig=cfg)["stream"])
    assert "messageStart" in events[0]
    streamed = "".join(e["contentBlockDelta"]["delta"]["text"] for e in events if "contentBlockDelta" in e)
    assert streamed == text
    assert [e["messageStop"]["stopReason"] for e in events if "messageStop" in e] == ["end_turn"]
    assert events[-1]["metadata"]["usage"]["outputTokens"] == whole["usage"]["outputTokens"]

    tool_cfg = {
        "tools": [{"toolSpec": {"name": "get_weather", "inputSchema": {"json": WEATHER_SCHEMA}}}],
        "toolChoice": {"any": {}},
    }
    ask = [{"role": "user", "content": [{"text": "What is the weather in Oslo?"}]}]
    tool = client.converse(modelId=BEDROCK_MODEL, messages=ask, toolConfig=tool_cfg)
    use = tool["output"]["message"]["content"][0]["toolUse"]
    assert tool["stopReason"] == "tool_use" and use["name"] == "get_weather" and "city" in use["input"]
    events = list(client.converse_stream(modelId=BEDROCK_MODEL, messages=ask, toolConfig=tool_cfg)["stream"])
    start = [e["contentBlockStart"]["start"]["toolUse"] for e in events if "contentBlockStart" in e]
    assert start[0]["name"] == "get_weather"
    args = "".join(e["contentBlockDelta"]["delta"]["toolUse"]["input"] for e in events if "contentBlockDelta" in e)
    assert json.loads(args) == use["input"]

    fresh.add_fault(kind="error", status=429, count=1)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        client.converse(modelId=BEDROCK_MODEL, messages=msgs, inferenceConfig=cfg)
    assert e.value.response["Error"]["Code"] == "ThrottlingException"
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 429

    # A mid-stream error arrives as the stream's exception frame.
    fresh.add_fault(kind="stream_error", status=429, after_tokens=3, count=1)
    stream = client.converse_stream(modelId=BEDROCK_MODEL, messages=msgs, inferenceConfig=cfg)["stream"]
    with pytest.raises(botocore.exceptions.EventStreamError) as e:
        list(stream)
    assert e.value.response["Error"]["Code"] == "throttlingException"

    fresh.add_fault(kind="refusal", after_tokens=2, count=1)
    stopped = client.converse(modelId=BEDROCK_MODEL, messages=msgs, inferenceConfig=cfg)
    assert stopped["stopReason"] == "content_filtered"


# --- OpenAI Responses -----------------------------------------------------------------------

def test_responses_whole_stream_prefill_tool_and_429(fresh):
    client = openai.OpenAI(base_url=fresh.base + "/v1", api_key="k", max_retries=0)
    whole = client.responses.create(model="gpt-4o", input=PROMPT, store=False, max_output_tokens=MAX_TOKENS)
    assert whole.status == "completed" and whole.output_text
    assert whole.usage.output_tokens > 0
    chat = openai.OpenAI(base_url=fresh.base + "/v1", api_key="k", max_retries=0).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=MAX_TOKENS
    )
    assert whole.output_text == chat.choices[0].message.content

    events = list(client.responses.create(
        model="gpt-4o", input=PROMPT, store=False, max_output_tokens=MAX_TOKENS, stream=True
    ))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens

    # A trailing assistant message is continued, as a prefill.
    cut = whole.output_text.rindex(" ", 0, len(whole.output_text) // 2)
    rest = client.responses.create(
        model="gpt-4o", store=False, max_output_tokens=MAX_TOKENS,
        input=[{"role": "user", "content": PROMPT},
               {"role": "assistant", "content": whole.output_text[:cut]}],
    )
    assert whole.output_text[:cut] + rest.output_text == whole.output_text

    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}]
    tool = client.responses.create(
        model="gpt-4o", input="What is the weather in Oslo?", store=False,
        tools=tools, tool_choice="required",
    )
    call = tool.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert "city" in json.loads(call.arguments)
    # The call's result sent back (stateless: the whole conversation again).
    after = client.responses.create(
        model="gpt-4o", store=False, tools=tools,
        input=[{"role": "user", "content": "What is the weather in Oslo?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert after.output[0].type == "message" and after.output_text

    fresh.add_fault(kind="error", status=429, count=1)
    with pytest.raises(openai.RateLimitError) as e:
        client.responses.create(model="gpt-4o", input=PROMPT, store=False)
    assert e.value.status_code == 429
