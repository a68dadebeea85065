// callToolOnce against a structural fake of the MCP SDK's Client: the key it
// adds, the wait on request-in-flight, and the refusals it never retries.
// (The real SDK client through idemgate's MCP door: tests/mcp/ts.)
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import {
  callToolOnce, derive_key, IDEMPOTENCY_KEY_ARGUMENT, InFlight, KeyInvalid, KeyReused, OutcomeUnknown, toolRefusal,
  type ToolCaller, type ToolCallParams,
} from "../src/index.js";

interface Result {
  content: { type: string; text: string }[];
  structuredContent?: Record<string, unknown>;
  isError?: boolean;
}

const BASE = "https://idemgate.dev/problems/";

/** A tool result as the door refuses a call. */
function refusal(slug: string, status: number, extra: Record<string, unknown> = {}): Result {
  return {
    content: [{ type: "text", text: `idemgate refused this call (${slug})` }],
    structuredContent: { type: BASE + slug, title: slug, status, detail: `${slug} detail`, ...extra },
    isError: true,
  };
}

const ok = (charge: string): Result => ({ content: [{ type: "text", text: charge }], structuredContent: { charge } });

/** A client whose `callTool` answers from a script, recording each call and when it came. */
class FakeClient implements ToolCaller<Result, { timeout: number }> {
  readonly calls: { params: ToolCallParams; options: { timeout: number } | undefined; at: number }[] = [];
  constructor(private readonly script: Result[]) {}
  async callTool(params: ToolCallParams, _schema?: undefined, options?: { timeout: number }): Promise<Result> {
    this.calls.push({ params, options, at: Date.now() });
    const next = this.script.shift();
    if (next === undefined) throw new Error("the fake was called more often than scripted");
    return next;
  }
}

const STEP = { tenant: "acme", run: "run-42", step: 3 };
const KEY = derive_key({ ...STEP, tool: "charge" });
const CALL = { name: "charge", arguments: { customer: "c1", amount: 500 } };

describe("callToolOnce", () => {
  test("adds the step's derived key to the arguments and returns the result", async () => {
    const client = new FakeClient([ok("ch_1")]);
    const params = { name: "charge", arguments: { customer: "c1", amount: 500 } };
    const result = await callToolOnce(client, params, STEP);
    assert.deepEqual(result, ok("ch_1"));
    assert.equal(client.calls.length, 1);
    assert.deepEqual(client.calls[0]!.params, {
      name: "charge", arguments: { customer: "c1", amount: 500, [IDEMPOTENCY_KEY_ARGUMENT]: KEY },
    });
    assert.deepEqual(params.arguments, { customer: "c1", amount: 500 }, "the caller's params are not changed");
    assert.equal(client.calls[0]!.options, undefined);
  });

  test("the key is the same for every retry of the step, and another for another step or tool", async () => {
    const client = new FakeClient([ok("a"), ok("b"), ok("c"), ok("d")]);
    await callToolOnce(client, CALL, STEP);
    await callToolOnce(client, CALL, { ...STEP });
    await callToolOnce(client, CALL, { ...STEP, step: 4 });
    await callToolOnce(client, CALL, { ...STEP, tool: "payments.charge" });
    const keys = client.calls.map((c) => c.params.arguments?.[IDEMPOTENCY_KEY_ARGUMENT]);
    assert.equal(keys[0], KEY);
    assert.equal(keys[1], KEY);
    assert.equal(keys[2], derive_key({ ...STEP, step: 4, tool: "charge" }));
    assert.equal(keys[3], derive_key({ ...STEP, tool: "payments.charge" }));
  });

  test("a call without arguments gets them, and the request options go to every call", async () => {
    const client = new FakeClient([refusal("request-in-flight", 409, { retry_after_seconds: 0 }), ok("ch_1")]);
    await callToolOnce(client, { name: "ping" }, STEP, { requestOptions: { timeout: 1234 } });
    assert.equal(client.calls.length, 2);
    for (const call of client.calls) {
      assert.deepEqual(call.params.arguments, { [IDEMPOTENCY_KEY_ARGUMENT]: derive_key({ ...STEP, tool: "ping" }) });
      assert.deepEqual(call.options, { timeout: 1234 });
    }
  });

  test("a call that carries another key is refused before it is sent; the same key is fine", async () => {
    const client = new FakeClient([ok("ch_1")]);
    await assert.rejects(
      callToolOnce(client, { name: "charge", arguments: { amount: 1, idempotency_key: "other" } }, STEP),
      TypeError,
    );
    assert.equal(client.calls.length, 0);
    await callToolOnce(client, { name: "charge", arguments: { amount: 1, idempotency_key: KEY } }, STEP);
    assert.equal(client.calls.length, 1);
  });

  test("request-in-flight is waited for retry_after_seconds and repeated with the same key", async () => {
    const client = new FakeClient([
      refusal("request-in-flight", 409, { retry_after_seconds: 0.2 }),
      refusal("request-in-flight", 409, { retry_after_seconds: 0.2 }),
      ok("ch_1"),
    ]);
    const result = await callToolOnce(client, CALL, STEP);
    assert.deepEqual(result, ok("ch_1"));
    assert.equal(client.calls.length, 3);
    for (const call of client.calls) assert.equal(call.params.arguments?.[IDEMPOTENCY_KEY_ARGUMENT], KEY);
    const gaps = client.calls.slice(1).map((c, i) => c.at - client.calls[i]!.at);
    for (const gap of gaps) assert.ok(gap >= 190, `waited ${gap} ms, not the 200 ms asked`);
  });

  test("request-in-flight past the wait budget throws InFlight, for the dead-letter queue", async () => {
    const lease = "2030-01-01T00:00:00.000Z";
    const busy = () => refusal("request-in-flight", 409, { retry_after_seconds: 1, lease_expires_at: lease });
    const client = new FakeClient([busy(), busy(), busy(), busy()]);
    const started = Date.now();
    const error = await callToolOnce(client, CALL, STEP, { waitBudgetMs: 300 }).then(
      () => assert.fail("resolved"),
      (e: unknown) => e,
    );
    assert.ok(error instanceof InFlight, String(error));
    assert.equal(error.key, KEY);
    assert.equal(error.deadLetterReason, "idempotency_in_flight");
    assert.equal(error.leaseExpiresAt?.toISOString(), lease);
    assert.equal(client.calls.length, 2, "one call, a wait cut to the budget, one more call");
    const took = Date.now() - started;
    assert.ok(took >= 290 && took < 900, `took ${took} ms for a 300 ms budget`);
  });

  for (const [slug, status, cls] of [
    ["key-reused", 422, KeyReused],
    ["outcome-unknown", 409, OutcomeUnknown],
    ["key-invalid", 400, KeyInvalid],
  ] as const) {
    test(`${slug} is thrown as ${cls.name} and never retried`, async () => {
      const client = new FakeClient([refusal(slug, status, { retry_after_seconds: 0 }), ok("never")]);
      const error = await callToolOnce(client, CALL, STEP).then(() => assert.fail("resolved"), (e: unknown) => e);
      assert.ok(error instanceof cls, String(error));
      assert.equal(error.status, status);
      assert.equal(error.type, BASE + slug);
      assert.equal(error.detail, `${slug} detail`);
      assert.equal(client.calls.length, 1);
    });
  }

  test("an outcome-unknown refusal names its dead-letter reason", async () => {
    const client = new FakeClient([refusal("outcome-unknown", 409)]);
    await assert.rejects(callToolOnce(client, CALL, STEP), (e: unknown) => {
      assert.ok(e instanceof OutcomeUnknown);
      assert.equal(e.deadLetterReason, "outcome_unknown");
      return true;
    });
  });

  test("the tool's own error results are returned as they are, not retried", async () => {
    const declined: Result = {
      content: [{ type: "text", text: "card declined" }],
      structuredContent: { type: "https://payments.example/errors/card-declined", code: "declined" },
      isError: true,
    };
    const bare: Result = { content: [{ type: "text", text: "boom" }], isError: true };
    const client = new FakeClient([declined, bare]);
    assert.deepEqual(await callToolOnce(client, CALL, STEP), declined);
    assert.deepEqual(await callToolOnce(client, CALL, STEP), bare);
    assert.equal(client.calls.length, 2);
  });

  test("a refusal's problem shape in a result that is no error is the tool's own result", () => {
    assert.equal(toolRefusal({ structuredContent: { type: BASE + "key-reused" } }), undefined);
    assert.equal(toolRefusal({ isError: false, structuredContent: { type: BASE + "key-reused" } }), undefined);
    assert.ok(toolRefusal({ isError: true, structuredContent: { type: BASE + "key-reused" } }) instanceof KeyReused);
    assert.equal(toolRefusal(null), undefined);
    assert.equal(toolRefusal("text"), undefined);
  });

  test("what the client throws is thrown as it is", async () => {
    const client: ToolCaller<Result> = {
      callTool: async () => {
        throw new Error("MCP error -32001: Request timed out");
      },
    };
    await assert.rejects(callToolOnce(client, CALL, STEP), /Request timed out/);
  });
});
