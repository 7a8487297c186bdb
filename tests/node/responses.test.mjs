// The npm openai SDK's Responses API (`client.responses`) against keel demo: a same-protocol,
// an Anthropic-protocol (translated) and the mixed pool; whole, streamed, the stream helper,
// a forced tool call and structured output.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";

import { startDemo } from "./keel_demo.mjs";

let demo;

before(async () => {
  // Fleet ports a block away from the other files'.
  demo = await startDemo({ simRange: [12000, 20000] });
});

after(() => {
  demo?.stop();
});

const client = () => new OpenAI({ baseURL: `${demo.url}/v1`, apiKey: "not-needed", maxRetries: 0 });

const WEATHER = {
  type: "function",
  name: "get_weather",
  description: "The weather in a city now.",
  parameters: {
    type: "object",
    properties: { city: { type: "string" }, unit: { type: "string", enum: ["c", "f"] } },
    required: ["city", "unit"],
    additionalProperties: false,
  },
  strict: true,
};

for (const model of ["demo-gpt", "demo-claude", "demo-mixed"]) {
  test(`responses on ${model}: whole, raw stream and the stream helper agree`, async () => {
    const c = client();
    const ask = { model, instructions: "Be brief.", input: "tell me about gateways", max_output_tokens: 400 };
    const whole = await c.responses.create(ask);
    assert.equal(whole.object, "response");
    assert.equal(whole.model, model);
    assert.ok(whole.output_text.length > 0);
    assert.ok(whole.usage.output_tokens > 0);

    let deltas = "";
    const kinds = [];
    for await (const event of await c.responses.create({ ...ask, stream: true })) {
      kinds.push(event.type);
      if (event.type === "response.output_text.delta") deltas += event.delta;
    }
    assert.equal(kinds[0], "response.created");
    assert.ok(["response.completed", "response.incomplete"].includes(kinds.at(-1)), kinds.at(-1));
    assert.equal(deltas, whole.output_text);

    if (whole.status === "completed") {
      const stream = c.responses.stream(ask);
      let text = "";
      stream.on("response.output_text.delta", (e) => (text += e.delta));
      const final = await stream.finalResponse();
      assert.equal(text, whole.output_text);
      assert.equal(final.output_text, whole.output_text);
    }
  });

  test(`responses on ${model}: a forced tool call, streamed argument deltas, and its result`, async () => {
    const c = client();
    const ask = { model, input: "What is the weather in Oslo?", tools: [WEATHER], tool_choice: { type: "function", name: "get_weather" } };
    const r = await c.responses.create(ask);
    const calls = r.output.filter((o) => o.type === "function_call");
    assert.equal(calls.length, 1);
    const args = JSON.parse(calls[0].arguments);
    assert.equal(typeof args.city, "string");
    assert.ok(["c", "f"].includes(args.unit));

    let streamed = "";
    let done;
    for await (const e of await c.responses.create({ ...ask, stream: true })) {
      if (e.type === "response.function_call_arguments.delta") streamed += e.delta;
      if (e.type === "response.function_call_arguments.done") done = e.arguments;
    }
    assert.equal(done, streamed);
    JSON.parse(streamed);

    const follow = await c.responses.create({
      model,
      max_output_tokens: 64,
      tools: [WEATHER],
      input: [
        { role: "user", content: "What is the weather in Oslo?" },
        { type: "function_call", call_id: calls[0].call_id, name: calls[0].name, arguments: calls[0].arguments },
        { type: "function_call_output", call_id: calls[0].call_id, output: "3 C, clear" },
      ],
    });
    assert.ok(follow.output_text.length > 0);
  });
}

test("responses.parse with a JSON schema returns a parsed object (Anthropic-protocol pool)", async () => {
  const r = await client().responses.parse({
    model: "demo-claude",
    input: "Describe Oslo.",
    text: {
      format: {
        type: "json_schema",
        name: "city",
        strict: true,
        schema: {
          type: "object",
          properties: { name: { type: "string" }, population: { type: "integer" }, coastal: { type: "boolean" } },
          required: ["name", "population", "coastal"],
          additionalProperties: false,
        },
      },
    },
  });
  assert.equal(typeof r.output_parsed.name, "string");
  assert.ok(Number.isInteger(r.output_parsed.population));
  assert.equal(typeof r.output_parsed.coastal, "boolean");
  assert.deepEqual(JSON.parse(r.output_text), r.output_parsed);
});

test("what keel cannot serve is a BadRequestError naming the field", async () => {
  await assert.rejects(client().responses.create({ model: "demo-gpt", input: "x", previous_response_id: "resp_1" }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError, String(e));
    assert.match(e.message, /previous_response_id/);
    return true;
  });
});
