// `idemgate proxy --protocol mcp` (docs/mcp.md) in front of an unmodified MCP
// server made with the official Python SDK (tests/mcp/server.py), driven by
// the official TypeScript client (@modelcontextprotocol/sdk:
// StreamableHTTPClientTransport + Client), in both of the server's answer
// forms (event stream and JSON). The server logs every execution of a tool;
// each test counts them, for a customer of its own.
//
//   npm ci && IDEMGATE_BIN=... MCP_PYTHON=... npm test     (.ci/mcp runs it)
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import type { Client } from "@modelcontextprotocol/sdk/client/index.js";

import { callToolOnce, derive_key, IDEMPOTENCY_KEY_ARGUMENT, type ToolCaller } from "../../../clients/typescript/src/index.js";
import { connect, REQUEST, Rig, withSession } from "./rig.js";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const key = () => `step-${randomUUID()}`;
const customer = () => `c-${randomUUID().slice(0, 8)}`;

type ToolResult = Awaited<ReturnType<Client["callTool"]>>;

/** A result's structuredContent, which every result of these tools carries. */
function structured(result: ToolResult): Record<string, unknown> {
  const content = result["structuredContent"];
  assert.ok(content !== null && typeof content === "object", `no structuredContent in ${JSON.stringify(result)}`);
  return content as Record<string, unknown>;
}

/** The problem's name of a refusal (an `isError` result): the last part of its
 * `type`, from `_meta["dev.idemgate/problem"]`, which a refusal always has. */
function problemType(result: ToolResult): string {
  assert.equal(result["isError"], true, JSON.stringify(result));
  const meta = result["_meta"] as Record<string, unknown> | undefined;
  const problem = meta?.["dev.idemgate/problem"] as Record<string, unknown> | undefined;
  assert.ok(problem, `no problem in _meta: ${JSON.stringify(result)}`);
  return String(problem["type"]).split("/").pop() ?? "";
}

function text(result: ToolResult): string {
  const content = result["content"];
  assert.ok(Array.isArray(content), JSON.stringify(result));
  return content.map((c: { text?: string }) => c.text ?? "").join("\n");
}

for (const form of ["event-stream", "json"] as const) describe(form, () => {
  let rig: Rig;
  let url: string;

  before(async () => {
    rig = await Rig.start(form === "json");
    url = await rig.proxy("door");
  });
  after(async () => {
    await rig?.stop();
  });

  test("tools/list offers the key to write tools only", async () => {
    const tools = await withSession(url, async (c) => (await c.listTools(undefined, REQUEST)).tools);
    const schemas = new Map(tools.map((t) => [t.name, t.inputSchema]));
    for (const write of ["charge", "slow_charge"]) {
      const schema = schemas.get(write);
      assert.ok(schema?.properties?.[IDEMPOTENCY_KEY_ARGUMENT], `${write}: ${JSON.stringify(schema)}`);
      assert.ok(!(schema.required ?? []).includes(IDEMPOTENCY_KEY_ARGUMENT));
    }
    assert.equal(schemas.get("balance")?.properties?.[IDEMPOTENCY_KEY_ARGUMENT], undefined);
  });

  test("a repeated call runs once and every call gets the result", async () => {
    // Each repeat is a new JSON-RPC request (its own id) on the same session:
    // the replay must answer that id, or the client never matches it.
    const who = customer();
    const args = { customer: who, amount: 500, idempotency_key: key() };
    const results = await withSession(url, async (c) => {
      await c.listTools(undefined, REQUEST);
      const out: ToolResult[] = [];
      for (let i = 0; i < 3; i++) out.push(await c.callTool({ name: "charge", arguments: args }, undefined, REQUEST));
      return out;
    });
    assert.deepEqual(results.map((r) => r["isError"] ?? false), [false, false, false]);
    const charges = new Set(results.map((r) => structured(r)["charge"]));
    assert.equal(charges.size, 1, JSON.stringify(results));
    const executed = rig.executions("charge", who);
    assert.equal(executed.length, 1);
    assert.ok(charges.has(executed[0]!.charge));
    // The server never sees the key: it is not one of its arguments.
    assert.ok(!(IDEMPOTENCY_KEY_ARGUMENT in executed[0]!));
  });

  test("another amount under the same key is an error result: key-reused", async () => {
    const who = customer();
    const k = key();
    const [first, other] = await withSession(url, async (c) => {
      // Listed first, as an agent does: the client then checks results against the tools' output schemas.
      await c.listTools(undefined, REQUEST);
      const first = await c.callTool({ name: "charge", arguments: { customer: who, amount: 500, idempotency_key: k } }, undefined, REQUEST);
      const other = await c.callTool({ name: "charge", arguments: { customer: who, amount: 900, idempotency_key: k } }, undefined, REQUEST);
      return [first, other];
    });
    assert.ok(!first["isError"], JSON.stringify(first));
    assert.equal(problemType(other), "key-reused");
    assert.match(String(structured(other)["type"]), /key-reused$/); // an open output schema: the problem is structuredContent too
    assert.match(text(other), /key-reused/);
    assert.equal(rig.executions("charge", who).length, 1);
  });

  test("a typed tool's refusal reaches the client as a result, not a schema error", async () => {
    // typed_charge declares an outputSchema; the SDK checks even an error
    // result's structuredContent against it, so the door leaves that out.
    const who = customer();
    const k = key();
    const [first, other] = await withSession(url, async (c) => {
      await c.listTools(undefined, REQUEST);
      const first = await c.callTool({ name: "typed_charge", arguments: { customer: who, amount: 5, idempotency_key: k } }, undefined, REQUEST);
      const other = await c.callTool({ name: "typed_charge", arguments: { customer: who, amount: 6, idempotency_key: k } }, undefined, REQUEST);
      return [first, other];
    });
    assert.ok(!first["isError"], JSON.stringify(first));
    assert.equal(problemType(other), "key-reused");
    assert.equal(other["structuredContent"], undefined);
    assert.equal(rig.executions("typed_charge", who).length, 1);
  });

  test("a repeat during a slow call, on another session, waits and gets the same result", async () => {
    const who = customer();
    const args = { customer: who, amount: 300, seconds: 2, idempotency_key: key() };
    const [one, two] = [await connect(url), await connect(url)];
    try {
      const started = Date.now();
      const first = one.callTool({ name: "slow_charge", arguments: args }, undefined, REQUEST);
      await sleep(500);
      const second = two.callTool({ name: "slow_charge", arguments: args }, undefined, REQUEST)
        .then((r) => ({ r, at: Date.now() - started }));
      const [a, b] = await Promise.all([first, second]);
      assert.ok(!a["isError"] && !b.r["isError"], JSON.stringify([a, b.r]));
      assert.deepEqual(structured(b.r), structured(a));
      assert.ok(b.at >= 1500, `the repeat was answered after ${b.at} ms, before the first call could end`);
    } finally {
      await Promise.all([one.close(), two.close()]);
    }
    assert.equal(rig.executions("slow_charge", who).length, 1);
  });

  test("a retry on a new session is the same caller", async () => {
    const who = customer();
    const args = { customer: who, amount: 700, idempotency_key: key() };
    const call = () => withSession(url, (c) => c.callTool({ name: "charge", arguments: args }, undefined, REQUEST));
    const first = await call();
    const retry = await call();
    assert.ok(!first["isError"] && !retry["isError"], JSON.stringify([first, retry]));
    assert.deepEqual(structured(retry), structured(first));
    assert.equal(rig.executions("charge", who).length, 1);
  });

  test("read-only balance passes through: two calls, two executions", async () => {
    const who = customer();
    const results = await withSession(url, async (c) => {
      await c.listTools(undefined, REQUEST);
      return [
        await c.callTool({ name: "balance", arguments: { customer: who } }, undefined, REQUEST),
        await c.callTool({ name: "balance", arguments: { customer: who } }, undefined, REQUEST),
      ];
    });
    assert.ok(results.every((r) => !r["isError"]), JSON.stringify(results));
    assert.equal(rig.executions("balance", who).length, 2);
  });

  test("callToolOnce: a step retried on a new session runs once, under its derived key", async () => {
    const who = customer();
    const step = { tenant: "acme", run: `run-${randomUUID()}`, step: 1 };
    const call = () => withSession(url, (c) =>
      callToolOnce(c, { name: "charge", arguments: { customer: who, amount: 250 } }, step, { requestOptions: REQUEST }));
    const first = await call();
    const retry = await call();
    assert.ok(!first["isError"] && !retry["isError"], JSON.stringify([first, retry]));
    assert.deepEqual(structured(retry), structured(first));
    assert.equal(rig.executions("charge", who).length, 1);
    // The key is the step's: the same call with it by hand is a replay too.
    const byHand = await withSession(url, (c) => c.callTool({
      name: "charge",
      arguments: { customer: who, amount: 250, idempotency_key: derive_key({ ...step, tool: "charge" }) },
    }, undefined, REQUEST));
    assert.deepEqual(structured(byHand), structured(first));
    assert.equal(rig.executions("charge", who).length, 1);
  });

  test("callToolOnce waits out request-in-flight (a door that holds no repeat) and gets the result", async () => {
    // This proxy answers a repeat at once with request-in-flight (retry_after_seconds 1).
    const impatient = await rig.proxy(`wait0-${randomUUID().slice(0, 8)}`, "--default-wait", "0");
    const who = customer();
    const step = { tenant: "acme", run: `run-${randomUUID()}`, step: 7 };
    const params = { name: "slow_charge", arguments: { customer: who, amount: 300, seconds: 2 } };
    const [one, two] = [await connect(impatient), await connect(impatient)];
    try {
      let calls = 0;
      const counting: ToolCaller<ToolResult, typeof REQUEST> = {
        callTool: (p, s, o) => {
          calls += 1;
          return two.callTool(p, s, o);
        },
      };
      const first = callToolOnce(one, params, step, { requestOptions: REQUEST });
      await sleep(500);
      const second = callToolOnce(counting, params, step, { requestOptions: REQUEST, waitBudgetMs: 10_000 });
      const [a, b] = await Promise.all([first, second]);
      assert.ok(!a["isError"] && !b["isError"], JSON.stringify([a, b]));
      assert.deepEqual(structured(b), structured(a));
      assert.ok(calls >= 2, `the repeat was sent ${calls} time(s): request-in-flight was not waited out`);
    } finally {
      await Promise.all([one.close(), two.close()]);
    }
    assert.equal(rig.executions("slow_charge", who).length, 1);
  });
});
