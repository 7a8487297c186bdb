// The official JavaScript/TypeScript SDKs see keel's resilience as one clean answer, or as
// their own error types. Runs against a `keel demo` of its own, into whose simulated servers
// the tests inject faults; the demo lets a request pin its first attempt to a variant
// (`x-keel-force-variant`), so a fault aimed at that variant's server hits this request. The
// simulator's answer is deterministic per prompt: an answer that survived a migration must
// equal the same request's un-faulted answer.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";

import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";

import { startDemo } from "./keel_demo.mjs";

let demo;

before(async () => {
  demo = await startDemo();
});

afterEach(async () => {
  await demo.clearFaults();
});

after(() => {
  demo?.stop();
});

const PROMPT = [{ role: "user", content: "tell me how a gateway survives a broken stream" }];
const MAX_TOKENS = 48;
// (pool, the variant the stream starts on and loses after a few tokens): same protocol for
// each client, across protocols, and both ways through the mixed pool.
const MIGRATIONS = [
  ["demo-gpt", "gpt-b"],
  ["demo-claude", "claude-a"],
  ["demo-mixed", "mixed-openai"],
  ["demo-mixed", "mixed-anthropic"],
  ["demo-clouds", "clouds-bedrock"],
  ["demo-clouds", "clouds-gemini"],
];
const WEATHER = {
  name: "get_weather",
  description: "Current weather in a city",
  schema: {
    type: "object",
    properties: { city: { type: "string" }, unit: { type: "string", enum: ["c", "f"] } },
    required: ["city"],
  },
};
// Over the demo's max_body_bytes (the default, 10 MiB): keel answers 413.
const huge = [{ role: "user", content: "x".repeat(10 * 1024 * 1024 + 1) }];
const TOOL_PROMPT = [{ role: "user", content: "what is the weather in Paris" }];

const openai = (opts = {}) => new OpenAI({ baseURL: `${demo.url}/v1`, apiKey: "not-needed", maxRetries: 0, ...opts });
const anthropic = (opts = {}) => new Anthropic({ baseURL: demo.url, apiKey: "not-needed", maxRetries: 0, ...opts });
const pinned = (variant) => ({ headers: { "x-keel-force-variant": variant } });

/** The variant's server drops the connection after five tokens of every answer. */
const breakStreamOf = (variant) => demo.addFault(variant, { kind: "close", after_tokens: 5 });

/** keel's record of the request: the pinned variant failed mid-stream and a continuation on
 * another variant finished the answer (a hedge raced against a late first token may be
 * recorded too). */
async function assertMigrated(requestId, variant) {
  const { attempts } = await demo.decision(requestId);
  const first = attempts.find((a) => a.kind === "first");
  // Attempts are listed as they settle: a hedge that lost its race may end after the
  // continuation that finished the answer.
  const finished = attempts.filter((a) => a.kind === "continuation" && a.outcome === "ok");
  const seen = JSON.stringify(attempts);
  assert.ok(first.variant === variant && first.outcome !== "ok", seen);
  assert.ok(finished.length === 1 && finished[0].variant !== variant, seen);
}

/** Whether a hedge won the race for the first token: the pinned first attempt was cancelled
 * before it answered, so the fault aimed at it never met this request. */
function hedgeWonFirst(attempts) {
  const first = attempts.find((a) => a.kind === "first");
  const won = attempts.some((a) => a.kind === "hedge" && a.outcome === "ok");
  return Boolean(first) && won && first.outcome === "race_cancelled";
}

/** Runs `attempt()` (a request pinned to `variant`, with its own checks; it returns the request
 * id) until keel's record shows the stream started on `variant`, then checks the migration. On a
 * loaded machine a late first token can be hedged and the hedge win: keel did its job, but not
 * the one under test, so the scenario is run again. */
async function migrating(variant, attempt, tries = 3) {
  for (let i = 0; i < tries; i++) {
    const id = await attempt();
    const { attempts } = await demo.decision(id);
    if (!hedgeWonFirst(attempts)) return assertMigrated(id, variant);
  }
  assert.fail(`a hedge won the first token in each of ${tries} tries: no migration was exercised`);
}

function assertSchemaValid(args) {
  const props = WEATHER.schema.properties;
  assert.equal(typeof args.city, "string");
  assert.ok(args.city);
  for (const key of Object.keys(args)) assert.ok(key in props, key);
  if ("unit" in args) assert.ok(props.unit.enum.includes(args.unit));
}

// 1. A stream that breaks mid-way migrates; the SDK sees one clean answer.

for (const [pool, variant] of MIGRATIONS) {
  test(`openai SDK: a stream on ${pool} survives losing ${variant}`, async () => {
    const client = openai();
    const expected = await client.chat.completions.create({ model: pool, max_tokens: MAX_TOKENS, messages: PROMPT });
    await breakStreamOf(variant);
    await migrating(variant, async () => {
      const { data: stream, response } = await client.chat.completions
        .create(
          { model: pool, max_tokens: MAX_TOKENS, messages: PROMPT, stream: true, stream_options: { include_usage: true } },
          pinned(variant),
        )
        .withResponse();
      let text = "";
      let finish = null;
      let usage = null;
      for await (const chunk of stream) {
        usage = chunk.usage ?? usage;
        for (const choice of chunk.choices) {
          text += choice.delta.content ?? "";
          finish = choice.finish_reason ?? finish;
        }
      }
      assert.equal(text, expected.choices[0].message.content);
      assert.equal(finish, expected.choices[0].finish_reason);
      assert.equal(usage?.completion_tokens, expected.usage.completion_tokens);
      return response.headers.get("x-keel-request-id");
    });
  });

  test(`openai SDK: a whole answer on ${pool} survives losing ${variant}, and says migrated`, async () => {
    const client = openai();
    const expected = await client.chat.completions.create({ model: pool, max_tokens: MAX_TOKENS, messages: PROMPT });
    await breakStreamOf(variant);
    await migrating(variant, async () => {
      const { data, response } = await client.chat.completions
        .create({ model: pool, max_tokens: MAX_TOKENS, messages: PROMPT }, pinned(variant))
        .withResponse();
      const id = response.headers.get("x-keel-request-id");
      if (!hedgeWonFirst((await demo.decision(id)).attempts)) {
        assert.equal(response.headers.get("x-keel-route"), "migrated");
      }
      assert.equal(data.choices[0].message.content, expected.choices[0].message.content);
      return id;
    });
  });

  test(`anthropic SDK: messages.stream on ${pool} survives losing ${variant}`, async () => {
    const client = anthropic();
    const expected = await client.messages.create({ model: pool, max_tokens: MAX_TOKENS, messages: PROMPT });
    await breakStreamOf(variant);
    await migrating(variant, async () => {
      const stream = client.messages.stream({ model: pool, max_tokens: MAX_TOKENS, messages: PROMPT }, pinned(variant));
      let text = "";
      stream.on("text", (t) => (text += t));
      const { response } = await stream.withResponse();
      const final = await stream.finalMessage();
      assert.equal(text, expected.content[0].text);
      assert.equal(final.content[0].text, text);
      assert.equal(final.stop_reason, expected.stop_reason);
      assert.equal(final.usage.output_tokens, expected.usage.output_tokens);
      return response.headers.get("x-keel-request-id");
    });
  });
}

// 2. Streamed tool use through the SDKs' stream helpers, same protocol and across.

for (const pool of ["demo-claude", "demo-gpt", "demo-clouds"]) {
  test(`anthropic SDK: messages.stream with a forced tool on ${pool}`, async () => {
    const stream = anthropic().messages.stream({
      model: pool,
      max_tokens: MAX_TOKENS,
      tools: [{ name: WEATHER.name, description: WEATHER.description, input_schema: WEATHER.schema }],
      tool_choice: { type: "tool", name: WEATHER.name },
      messages: TOOL_PROMPT,
    });
    let partial = "";
    let snapshot;
    stream.on("inputJson", (delta, snap) => {
      partial += delta;
      snapshot = snap;
    });
    const final = await stream.finalMessage();
    assert.ok(partial, "no inputJson events");
    assert.equal(final.stop_reason, "tool_use");
    const used = final.content.filter((b) => b.type === "tool_use");
    assert.equal(used.length, 1);
    assert.equal(used[0].name, WEATHER.name);
    assert.deepEqual(used[0].input, JSON.parse(partial));
    assert.deepEqual(used[0].input, snapshot);
    assertSchemaValid(used[0].input);
  });

  test(`openai SDK: chat.completions.stream with a forced tool on ${pool}`, async () => {
    const stream = openai().chat.completions.stream({
      model: pool,
      max_tokens: MAX_TOKENS,
      tools: [{ type: "function", function: { name: WEATHER.name, description: WEATHER.description, parameters: WEATHER.schema } }],
      tool_choice: { type: "function", function: { name: WEATHER.name } },
      messages: TOOL_PROMPT,
    });
    let deltas = "";
    let done;
    stream.on("tool_calls.function.arguments.delta", (e) => (deltas += e.arguments_delta));
    stream.on("tool_calls.function.arguments.done", (e) => (done = e));
    const final = await stream.finalChatCompletion();
    assert.equal(final.choices[0].finish_reason, "tool_calls");
    const calls = final.choices[0].message.tool_calls;
    assert.equal(calls.length, 1);
    assert.equal(calls[0].function.name, WEATHER.name);
    assert.equal(done?.name, WEATHER.name);
    const args = JSON.parse(calls[0].function.arguments);
    assert.deepEqual(args, JSON.parse(deltas));
    assert.deepEqual(args, JSON.parse(done.arguments));
    assertSchemaValid(args);
  });
}

// 3. keel's 503 with retry-after: each SDK waits exactly what keel told it.

// What the pool's two servers ask for (keel passes the variants' own wait on to the client).
const UPSTREAM_WAIT_S = { "claude-a": 0.45, "claude-b": 0.65 };

async function refuseEveryVariant(status) {
  for (const [variant, wait] of Object.entries(UPSTREAM_WAIT_S)) {
    await demo.addFault(variant, { kind: "error", status, retry_after_s: wait });
  }
}

/** A fetch that notes when each request leaves and each response head arrives. */
function timedFetch(events) {
  return async (url, init) => {
    events.push({ kind: "request", at: performance.now() });
    const response = await fetch(url, init);
    events.push({ kind: "response", at: performance.now(), headers: response.headers });
    return response;
  };
}

for (const [name, status, makeClient, ask] of [
  ["openai", 429, (fetch) => openai({ maxRetries: 1, fetch }), (c) => c.chat.completions.create({ model: "demo-claude", max_tokens: 16, messages: PROMPT })],
  ["anthropic", 503, (fetch) => anthropic({ maxRetries: 1, fetch }), (c) => c.messages.create({ model: "demo-claude", max_tokens: 16, messages: PROMPT })],
]) {
  test(`${name} SDK waits keel's retry-after-ms before its retry (within 50 ms)`, async () => {
    // The one timing check issue 13 asks for. Both SDKs honour `retry-after-ms` exactly,
    // without jitter, below a minute.
    await refuseEveryVariant(status);
    const Sdk = name === "openai" ? OpenAI : Anthropic;
    // Never earlier than told; at most 50 ms later. A loaded machine can only delay a timer, so
    // the overshoot is judged on the best of three tries (each is printed).
    const overshoots = [];
    for (let i = 0; i < 3; i++) {
      const events = [];
      await assert.rejects(ask(makeClient(timedFetch(events))), (e) => {
        assert.ok(e instanceof Sdk.InternalServerError, String(e));
        assert.equal(e.status, 503);
        assert.match(e.message, /no variant of `demo-claude` could serve the request/);
        return true;
      });
      assert.deepEqual(
        events.map((e) => e.kind),
        ["request", "response", "request", "response"],
      );
      const told = Number(events[1].headers.get("retry-after-ms"));
      const waited = events[2].at - events[1].at;
      console.log(`${name}: keel said ${told} ms, the SDK waited ${waited.toFixed(1)} ms`);
      assert.equal(Number(events[1].headers.get("retry-after")), Math.ceil(told / 1000));
      assert.ok(told >= 300 && told <= 800, `retry-after-ms ${told}`);
      assert.ok(waited >= told - 5, `the SDK retried after ${waited} ms, before keel's ${told} ms`);
      overshoots.push(waited - told);
      if (waited - told <= 50) break;
    }
    assert.ok(Math.min(...overshoots) <= 50, `overshoots ${overshoots} ms`);
  });
}

// 4. keel's own 4xx arrive as each SDK's own exception types, with keel's message.

test("openai SDK: keel's 4xx as the SDK's error classes", async () => {
  const client = openai();
  await assert.rejects(
    client.chat.completions.create({ model: "no-such-model", messages: PROMPT }),
    (e) => e instanceof OpenAI.NotFoundError && /no-such-model/.test(e.message) && /models you may use/.test(e.message),
  );
  await assert.rejects(
    client.chat.completions.create({ model: "demo-gpt", messages: "not a list" }),
    (e) => e instanceof OpenAI.BadRequestError && /messages/.test(e.message),
  );
  await assert.rejects(
    client.get("/chat/completions"),
    (e) => e instanceof OpenAI.APIError && e.status === 405 && /method GET is not allowed/.test(e.message),
  );
  await assert.rejects(
    client.chat.completions.create({ model: "demo-gpt", messages: huge }),
    (e) => e instanceof OpenAI.APIError && e.status === 413 && /exceeds the limit/.test(e.message),
  );
});

test("anthropic SDK: keel's 4xx as the SDK's error classes", async () => {
  const client = anthropic();
  await assert.rejects(
    client.messages.create({ model: "no-such-model", max_tokens: 16, messages: PROMPT }),
    (e) => e instanceof Anthropic.NotFoundError && /no-such-model/.test(e.message) && /models you may use/.test(e.message),
  );
  await assert.rejects(
    client.messages.create({ model: "demo-claude", max_tokens: -1, messages: PROMPT }),
    (e) => e instanceof Anthropic.BadRequestError && /max_tokens/.test(e.message),
  );
  await assert.rejects(
    client.get("/v1/messages"),
    (e) => e instanceof Anthropic.APIError && e.status === 405 && /method GET is not allowed/.test(e.message),
  );
  await assert.rejects(
    client.messages.create({ model: "demo-claude", max_tokens: 16, messages: huge }),
    (e) => e instanceof Anthropic.APIError && e.status === 413 && /exceeds the limit/.test(e.message),
  );
});
