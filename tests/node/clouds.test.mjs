// The official JavaScript/TypeScript SDKs through keel against every cloud dialect: each of the
// demo's `demo-clouds` variants (Bedrock, Vertex AI Claude, Gemini, Azure OpenAI, the Responses
// API, all on keel-sim in their own wire formats) pinned in turn, whole and streamed, a forced
// tool, and an upstream error raised as the SDK's own exception.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";

import { startDemo } from "./keel_demo.mjs";

let demo;

before(async () => {
  // Fleet ports a block away from the other files'.
  demo = await startDemo({ simRange: [61000, 65000] });
});

after(() => {
  demo?.stop();
});

const CLOUDS = ["clouds-bedrock", "clouds-vertex", "clouds-gemini", "clouds-azure", "clouds-responses"];
const MODEL = "demo-clouds";
const messages = [{ role: "user", content: "tell me about the clouds" }];
const openai = () => new OpenAI({ baseURL: `${demo.url}/v1`, apiKey: "not-needed", maxRetries: 0 });
const anthropic = () => new Anthropic({ baseURL: demo.url, apiKey: "not-needed", maxRetries: 0 });
const pinned = (variant) => ({ headers: { "x-keel-force-variant": variant } });

for (const variant of CLOUDS) {
  test(`openai and anthropic SDKs, whole and streamed, on ${variant}`, async () => {
    const { data: whole, response } = await openai()
      .chat.completions.create({ model: MODEL, max_tokens: 48, messages }, pinned(variant))
      .withResponse();
    assert.equal(response.headers.get("x-keel-variant"), variant);
    assert.ok(whole.choices[0].message.content);
    let text = "";
    const stream = await openai().chat.completions.create(
      { model: MODEL, max_tokens: 48, messages, stream: true },
      pinned(variant),
    );
    for await (const chunk of stream) for (const c of chunk.choices) text += c.delta.content ?? "";
    assert.equal(text, whole.choices[0].message.content);

    const message = await anthropic().messages.create({ model: MODEL, max_tokens: 48, messages }, pinned(variant));
    const streamed = anthropic().messages.stream({ model: MODEL, max_tokens: 48, messages }, pinned(variant));
    const final = await streamed.finalMessage();
    assert.equal(final.content[0].text, message.content[0].text);
    assert.equal(final.stop_reason, message.stop_reason);
  });

  test(`a forced tool and an upstream 400 on ${variant}`, async () => {
    const r = await openai().chat.completions.create(
      {
        model: MODEL,
        max_tokens: 64,
        messages: [{ role: "user", content: "weather in Paris?" }],
        tools: [{ type: "function", function: { name: "get_weather", parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } }],
        tool_choice: "required",
      },
      pinned(variant),
    );
    assert.equal(r.choices[0].finish_reason, "tool_calls");
    assert.equal(typeof JSON.parse(r.choices[0].message.tool_calls[0].function.arguments).city, "string");

    await demo.addFault(variant, { kind: "error", status: 400 });
    try {
      await assert.rejects(
        openai().chat.completions.create({ model: MODEL, max_tokens: 16, messages }, pinned(variant)),
        (e) => e instanceof OpenAI.BadRequestError,
      );
      await assert.rejects(
        anthropic().messages.create({ model: MODEL, max_tokens: 16, messages }, pinned(variant)),
        (e) => e instanceof Anthropic.BadRequestError,
      );
    } finally {
      await demo.clearFaults();
    }
  });
}
