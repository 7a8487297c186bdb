"""keel's PII and secret guard through the official SDKs, on the demo's `demo-guarded` pool
(`request = { default = "mask", secret = "block" }`, `answer = { secret = "redact" }`).

The simulated servers are told what to answer (`POST /sim/faults` kind `answer`), so a test
knows where the placeholder falls in the stream. (That the servers see only placeholders is
tested in crates/keel-gateway/tests/it/guard.rs, which reads what they received.)
"""
import json
import urllib.request

import anthropic
import openai
import pytest

from sdk_helpers import read_openai_stream

POOL = "demo-guarded"
VARIANTS = ["guarded-a", "guarded-b"]
EMAIL = "jane.doe@corp.example"
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"


def openai_client(demo):
    return openai.OpenAI(base_url=demo.url + "/v1", api_key="not-needed", max_retries=0)


def anthropic_client(demo):
    return anthropic.Anthropic(base_url=demo.url, api_key="not-needed", max_retries=0)


def answer_with(demo, text):
    for v in VARIANTS:
        demo.add_fault(v, kind="answer", body=text)


def ask(email=EMAIL):
    return [{"role": "user", "content": f"Send the report to {email} please."}]


@pytest.mark.parametrize("pad", range(0, 12))
def test_a_masked_email_is_restored_in_a_streamed_answer_wherever_chunks_split_it(faults, pad):
    # The padding moves the placeholder across the simulator's token boundaries.
    answer = "x" * pad + " I sent it to <EMAIL_1>, as asked."
    answer_with(faults, answer)
    stream = openai_client(faults).chat.completions.create(
        model=POOL, messages=ask(), max_tokens=64, stream=True
    )
    text, finish, _ = read_openai_stream(stream)
    assert text == answer.replace("<EMAIL_1>", EMAIL)
    assert finish == "stop"


def test_a_masked_email_is_restored_in_anthropic_streams_and_whole_answers(faults):
    answer_with(faults, "Done: <EMAIL_1> has it.")
    client = anthropic_client(faults)
    with client.messages.stream(model=POOL, max_tokens=64, messages=ask()) as s:
        text = "".join(s.text_stream)
    assert text == f"Done: {EMAIL} has it."
    whole = openai_client(faults).chat.completions.with_raw_response.create(
        model=POOL, messages=ask(), max_tokens=64
    )
    assert whole.headers["x-keel-guard"] == "masked=email:1"
    assert whole.parse().choices[0].message.content == f"Done: {EMAIL} has it."


def test_a_migrated_stream_keeps_the_placeholder_upstream_and_the_value_for_the_client(faults):
    answer = "Noted: <EMAIL_1> will get the weekly report from now on, every Monday."
    answer_with(faults, answer)
    faults.add_fault("guarded-a", kind="close", after_tokens=8)
    stream = openai_client(faults).chat.completions.create(
        model=POOL, messages=ask(), max_tokens=64, stream=True,
        extra_headers={"x-keel-force-variant": "guarded-a"},
    )
    text, _, _ = read_openai_stream(stream)
    assert text == answer.replace("<EMAIL_1>", EMAIL)


def test_block_raises_the_sdks_own_bad_request_error_naming_types_not_values(keel_demo):
    prompt = [{"role": "user", "content": f"my key is {AWS_KEY}"}]
    client = openai.OpenAI(base_url=keel_demo + "/v1", api_key="not-needed", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=POOL, messages=prompt, max_tokens=16)
    assert "secret: 1" in str(e.value) and AWS_KEY not in str(e.value)
    client = anthropic.Anthropic(base_url=keel_demo, api_key="not-needed", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=POOL, messages=prompt, max_tokens=16)
    assert "secret: 1" in str(e.value) and AWS_KEY not in str(e.value)


def test_no_value_reaches_the_servers_records_or_metrics(faults):
    answer_with(faults, "Mailed <EMAIL_1>.")
    resp = openai_client(faults).chat.completions.with_raw_response.create(
        model=POOL, messages=ask(), max_tokens=16
    )
    request_id = resp.headers["x-keel-request-id"]
    record = json.dumps(faults.decision(request_id))
    with urllib.request.urlopen(faults.url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert EMAIL not in record and "masked=email:1" in record
    assert EMAIL not in metrics
    guard_lines = [line for line in metrics.splitlines() if line.startswith("keel_guard_findings_total")]
    assert any('entity="email"' in line and 'action="mask"' in line for line in guard_lines), guard_lines


# A tool whose schema makes the simulated model put the placeholder it was given into the
# call's arguments, as a model fills a tool call with a value from the conversation.
SEND_REPORT = {
    "name": "send_report",
    "description": "Send the report by email.",
    "parameters": {
        "type": "object",
        "properties": {"to": {"type": "string", "const": "<EMAIL_1>"}},
        "required": ["to"],
    },
}


def test_a_masked_email_is_restored_in_streamed_tool_call_arguments_openai(faults):
    stream = openai_client(faults).chat.completions.create(
        model=POOL,
        messages=ask(),
        max_tokens=64,
        stream=True,
        tools=[{"type": "function", "function": SEND_REPORT}],
        tool_choice={"type": "function", "function": {"name": "send_report"}},
    )
    arguments = ""
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                arguments += call.function.arguments or ""
    assert json.loads(arguments)["to"] == EMAIL
    assert "<EMAIL_1>" not in arguments


def test_a_masked_email_is_restored_in_streamed_tool_use_input_anthropic(faults):
    tool = {
        "name": SEND_REPORT["name"],
        "description": SEND_REPORT["description"],
        "input_schema": SEND_REPORT["parameters"],
    }
    client = anthropic_client(faults)
    with client.messages.stream(
        model=POOL,
        max_tokens=64,
        messages=ask(),
        tools=[tool],
        tool_choice={"type": "tool", "name": "send_report"},
    ) as s:
        final = s.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert uses and uses[0].input["to"] == EMAIL
