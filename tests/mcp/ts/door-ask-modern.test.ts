// A tool that asks before it acts (tests/mcp/server.py's `confirmed_charge`,
// whose confirmation is an elicitation) through `idemgate proxy --protocol mcp`
// with the official TypeScript client's v2 package on protocol 2026-07-28
// (`versionNegotiation: { mode: "auto" }`): the server answers the first round
// `input_required`, and the client's default auto-fulfilment answers it through
// its `elicitation/create` handler and sends the second round. SPEC §12: the
// call completes once per key, its repeat replays without asking, and a
// declined or cancelled question leaves nothing stored and nothing charged.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";

import { REQUEST, Rig } from "./rig.js";

const KEY_META = "dev.idemgate/idempotency-key";
type Action = "accept" | "decline" | "cancel";

/** One call of confirmed_charge through a new v2 client on 2026-07-28 whose user answers `action` (after `delayMs`). */
async function confirmedCharge(url: string, who: string, key: string, action: Action, delayMs = 0) {
  const questions: string[] = [];
  const client = new Client(
    { name: "idemgate-door-test-ask", version: "0.0.0" },
    { versionNegotiation: { mode: "auto" }, capabilities: { elicitation: { form: {} } } },
  );
  client.setRequestHandler("elicitation/create", async (request) => {
    questions.push(String(request.params.message));
    if (delayMs > 0) await new Promise((r) => setTimeout(r, delayMs));
    return action === "accept" ? { action, content: { confirm: true } } : { action };
  });
  await client.connect(new StreamableHTTPClientTransport(new URL(url)), REQUEST);
  try {
    assert.equal(client.getProtocolEra(), "modern", `negotiated ${client.getNegotiatedProtocolVersion()}`);
    const result = await client.callTool(
      { name: "confirmed_charge", arguments: { customer: who, amount: 7 }, _meta: { [KEY_META]: key } },
      REQUEST,
    );
    return { result, questions };
  } finally {
    await client.close();
  }
}

function chargeOf(result: Record<string, unknown>): string {
  assert.notEqual(result["isError"], true, JSON.stringify(result));
  const content = result["structuredContent"] as Record<string, unknown>;
  return String(content["charge"]);
}

for (const form of ["event-stream", "json"] as const) describe(`v2 client on 2026-07-28, ${form}: a tool that asks`, () => {
  let rig: Rig;
  let url: string;

  before(async () => {
    rig = await Rig.start(form === "json");
    url = await rig.proxy("ask-modern");
  });
  after(async () => {
    await rig?.stop();
  });

  test("accepted: charged once; the repeat replays without asking", async () => {
    const who = `ask-${randomUUID().slice(0, 8)}`;
    const key = `order-${randomUUID()}`;
    const first = await confirmedCharge(url, who, key, "accept");
    const charge = chargeOf(first.result);
    assert.deepEqual(first.questions, [`Charge ${who} 7?`]);
    const repeat = await confirmedCharge(url, who, key, "accept");
    assert.equal(chargeOf(repeat.result), charge);
    assert.deepEqual(repeat.questions, [], "a completed call is replayed, never asked again");
    assert.deepEqual(rig.executions("confirmed_charge", who).map((e) => e.charge), [charge]);
  });

  test("two clients racing one key: charged once", async () => {
    const who = `ask-${randomUUID().slice(0, 8)}`;
    const key = `order-${randomUUID()}`;
    const both = await Promise.all([
      confirmedCharge(url, who, key, "accept", 300),
      confirmedCharge(url, who, key, "accept", 300),
    ]);
    const charged = rig.executions("confirmed_charge", who).map((e) => e.charge);
    assert.equal(charged.length, 1, JSON.stringify(charged));
    for (const { result } of both) {
      if (result["isError"] === true) {
        // Held past the door's wait while the other waited for its user.
        const meta = result["_meta"] as Record<string, Record<string, unknown>>;
        assert.match(String(meta["dev.idemgate/problem"]?.["type"]), /request-in-flight$/, JSON.stringify(result));
      } else {
        assert.equal(chargeOf(result), charged[0]);
      }
    }
    assert.ok(both.some(({ result }) => result["isError"] !== true), JSON.stringify(both));
  });

  for (const action of ["decline", "cancel"] as const) {
    test(`${action === "cancel" ? "cancelled" : "declined"}: nothing stored, nothing charged; asked again, then charged once`, async () => {
      const who = `ask-${randomUUID().slice(0, 8)}`;
      const key = `order-${randomUUID()}`;
      const no = await confirmedCharge(url, who, key, action);
      assert.equal(no.result["isError"], true, JSON.stringify(no.result));
      assert.equal(no.questions.length, 1);
      assert.deepEqual(rig.executions("confirmed_charge", who), []);
      const yes = await confirmedCharge(url, who, key, "accept");
      assert.equal(yes.questions.length, 1, "the key was released: the call is asked again");
      assert.deepEqual(rig.executions("confirmed_charge", who).map((e) => e.charge), [chargeOf(yes.result)]);
    });
  }
});
