// The official JavaScript SDKs against keel demo: embeddings (`demo-embed`, whose flaky variant
// keel fails over from), structured output with a JSON schema on a same-protocol and a
// cross-protocol pool, and Anthropic's count_tokens.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";

import { startDemo } from "./keel_demo.mjs";

let demo;

before(async () => {
  // Fleet ports a block away from the other files'.
  demo = await startDemo({ simRange: [22000, 30000] });
});

after(() => {
  demo?.stop();
});

const openai = () => new OpenAI({ baseURL: `${demo.url}/v1`, apiKey: "not-needed", maxRetries: 0 });
const anthropic = () => new Anthropic({ baseURL: demo.url, apiKey: "not-needed", maxRetries: 0 });

const norm = (v) => Math.sqrt(v.reduce((s, x) => s + x * x, 0));

test("openai SDK: embeddings, float and base64 (decoded by the SDK) agree", async () => {
  const client = openai();
  const input = ["keel routes requests", "to healthy servers", "and fails over"];
  // Several rounds: the flaky variant fails some, keel fails over before the answer.
  for (let round = 0; round < 4; round++) {
    const floats = await client.embeddings.create({ model: "demo-embed", input, encoding_format: "float" });
    assert.equal(floats.model, "demo-embed");
    assert.equal(floats.data.length, input.length);
    floats.data.forEach((d, i) => {
      assert.equal(d.index, i);
      assert.equal(d.embedding.length, 256);
      assert.ok(Math.abs(norm(d.embedding) - 1) < 1e-4);
    });
    assert.ok(floats.usage.prompt_tokens > 0);
    // Without encoding_format the SDK asks for base64 and decodes it into float32 values.
    const decoded = await client.embeddings.create({ model: "demo-embed", input });
    decoded.data.forEach((d, i) => {
      assert.deepEqual(Array.from(d.embedding), floats.data[i].embedding.map(Math.fround));
    });
  }
  const short = await client.embeddings.create({ model: "demo-embed", input: "short", dimensions: 16 });
  assert.equal(short.data[0].embedding.length, 16);
});

test("openai SDK: embeddings on a pool without an OpenAI-protocol variant are a 400", async () => {
  await assert.rejects(
    openai().embeddings.create({ model: "demo-claude", input: "x" }),
    (e) => e instanceof OpenAI.BadRequestError && /demo-claude/.test(e.message),
  );
});

const person = {
  type: "object",
  additionalProperties: false,
  required: ["name", "age", "hobbies"],
  properties: {
    name: { type: "string" },
    age: { type: "integer", minimum: 0, maximum: 120 },
    hobbies: { type: "array", items: { type: "string", enum: ["chess", "rowing", "baking"] } },
  },
};

for (const model of ["demo-gpt", "demo-claude", "demo-clouds"]) {
  test(`openai SDK: chat.completions.parse with a JSON schema on ${model}`, async () => {
    const completion = await openai().chat.completions.parse({
      model,
      max_tokens: 200,
      messages: [{ role: "user", content: "Describe a person." }],
      response_format: { type: "json_schema", json_schema: { name: "person", schema: person, strict: true } },
    });
    const message = completion.choices[0].message;
    // Without zod the SDK leaves `parsed` to the caller: the content is the JSON text.
    const parsed = message.parsed ?? JSON.parse(message.content);
    assert.equal(typeof parsed.name, "string");
    assert.ok(Number.isInteger(parsed.age) && parsed.age >= 0 && parsed.age <= 120);
    assert.ok(parsed.hobbies.every((h) => ["chess", "rowing", "baking"].includes(h)));
    assert.deepEqual(Object.keys(parsed).sort(), ["age", "hobbies", "name"]);
    assert.equal(completion.choices[0].finish_reason, "stop");
  });
}

for (const model of ["demo-claude", "demo-gpt", "demo-mixed"]) {
  test(`anthropic SDK: messages.countTokens on ${model}`, async () => {
    const client = anthropic();
    const short = await client.messages.countTokens({
      model,
      messages: [{ role: "user", content: "hello" }],
    });
    const long = await client.messages.countTokens({
      model,
      system: "You are a careful assistant.",
      messages: [{ role: "user", content: "hello, and please count these extra words too" }],
    });
    assert.ok(short.input_tokens > 0);
    assert.ok(long.input_tokens > short.input_tokens);
  });
}
