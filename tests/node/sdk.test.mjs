// The official JavaScript/TypeScript SDKs, pointed at keel's base URL, work unchanged: same
// protocol and across protocols (keel translates), whole and streamed. Starts `keel demo` (a
// simulated fleet and the gateway) once for the file.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";

import { startDemo } from "./keel_demo.mjs";

let demo;
let url;

before(async () => {
  // Fleet ports a block away from the Python tests'.
  demo = await startDemo({ simRange: [10000, 12000] });
  url = demo.url;
});

after(() => {
  demo?.stop();
});

const openai = () => new OpenAI({ baseURL: `${url}/v1`, apiKey: "not-needed", maxRetries: 0 });
const anthropic = () => new Anthropic({ baseURL: url, apiKey: "not-needed", maxRetries: 0 });

async function openaiStreamText(client, model) {
  const stream = await client.chat.completions.create({
    model,
    max_tokens: 64,
    messages: [{ role: "user", content: "stream please" }],
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = "";
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      text += choice.delta.content ?? "";
      finish = choice.finish_reason ?? finish;
    }
  }
  return { text, finish, usage };
}

for (const model of ["demo-gpt", "demo-claude", "demo-mixed", "demo-clouds"]) {
  test(`openai SDK: whole and streamed answers agree on ${model}`, async () => {
    const client = openai();
    const whole = await client.chat.completions.create({
      model,
      max_tokens: 64,
      messages: [{ role: "user", content: "stream please" }],
    });
    const expected = whole.choices[0].message.content;
    assert.ok(expected);
    assert.equal(whole.model, model);
    for (let i = 0; i < 3; i++) {
      const { text, finish, usage } = await openaiStreamText(client, model);
      assert.equal(text, expected);
      assert.ok(["stop", "length"].includes(finish));
      assert.ok(usage && usage.completion_tokens > 0);
    }
  });

  test(`anthropic SDK: messages.stream agrees with messages.create on ${model}`, async () => {
    const client = anthropic();
    const msg = await client.messages.create({
      model,
      max_tokens: 64,
      messages: [{ role: "user", content: "hello" }],
    });
    assert.equal(msg.model, model);
    assert.ok(["end_turn", "max_tokens"].includes(msg.stop_reason));
    const expected = msg.content.filter((b) => b.type === "text").map((b) => b.text).join("");
    assert.ok(expected);
    const stream = client.messages.stream({
      model,
      max_tokens: 64,
      messages: [{ role: "user", content: "hello" }],
    });
    let text = "";
    stream.on("text", (t) => (text += t));
    const final = await stream.finalMessage();
    assert.equal(text, expected);
    assert.ok(final.usage.output_tokens > 0);
  });
}

test("openai SDK: a streamed tool call from an Anthropic-protocol pool", async () => {
  const client = openai();
  const stream = await client.chat.completions.create({
    model: "demo-claude",
    max_tokens: 64,
    stream: true,
    tool_choice: "required",
    tools: [
      {
        type: "function",
        function: {
          name: "get_weather",
          parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
        },
      },
    ],
    messages: [{ role: "user", content: "what is the weather in Paris" }],
  });
  let name = "";
  let args = "";
  let finish = null;
  for await (const chunk of stream) {
    for (const choice of chunk.choices) {
      finish = choice.finish_reason ?? finish;
      for (const tc of choice.delta.tool_calls ?? []) {
        name += tc.function?.name ?? "";
        args += tc.function?.arguments ?? "";
      }
    }
  }
  assert.equal(finish, "tool_calls");
  assert.equal(name, "get_weather");
  assert.ok("city" in JSON.parse(args));
});

test("openai SDK: models.list and errors", async () => {
  const client = openai();
  const models = [];
  for await (const m of client.models.list()) models.push(m.id);
  assert.deepEqual(models, ["demo-gpt", "gpt-4o-mini", "demo-claude", "demo-mixed", "demo-clouds", "demo-embed", "demo-guarded"]);
  await assert.rejects(
    client.chat.completions.create({ model: "no-such-model", messages: [{ role: "user", content: "hi" }] }),
    (e) => e instanceof OpenAI.NotFoundError && /models you may use/.test(e.message),
  );
});
