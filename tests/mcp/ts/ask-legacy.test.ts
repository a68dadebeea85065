// A tool that asks before it acts (tests/mcp/server.py's confirmed_charge:
// an elicitation mid-call, on the call's event stream under 2025-11-25)
// through `idemgate proxy --protocol mcp` with a runtime's key, driven by the
// official TypeScript clients in their legacy handshake: v1's
// @modelcontextprotocol/sdk Client, and v2's @modelcontextprotocol/client in
// its default connect. The question reaches the client, its answer reaches
// the server, the tool charges once, and a repeat of the whole call replays
// the result without asking again (docs/mcp.md, "Questions mid-call").
//
//   npm ci && IDEMGATE_BIN=... MCP_PYTHON=... npm test     (.ci/mcp runs it)
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import { Client as ClientV2, StreamableHTTPClientTransport as TransportV2 } from "@modelcontextprotocol/client";
import { Client as ClientV1 } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport as TransportV1 } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { ElicitRequestSchema } from "@modelcontextprotocol/sdk/types.js";

import { REQUEST, Rig } from "./rig.js";

const KEY_META = "dev.idemgate/idempotency-key";
const LEGACY = "2025-11-25";

/** One call of confirmed_charge, on a session of its own that confirms; what it was asked. */
type Confirmed = { result: Record<string, unknown>; asked: string[] };

async function v1(url: string, args: Record<string, unknown>, key: string): Promise<Confirmed> {
  const asked: string[] = [];
  const client = new ClientV1({ name: "idemgate-ask-test-v1", version: "0.0.0" }, { capabilities: { elicitation: {} } });
  client.setRequestHandler(ElicitRequestSchema, async (request) => {
    asked.push(request.params.message);
    return { action: "accept", content: { confirm: true } };
  });
  await client.connect(new TransportV1(new URL(url)), REQUEST);
  try {
    const result = await client.callTool({ name: "confirmed_charge", arguments: args, _meta: { [KEY_META]: key } }, undefined, REQUEST);
    return { result: result as Record<string, unknown>, asked };
  } finally {
    await client.close();
  }
}

async function v2(url: string, args: Record<string, unknown>, key: string): Promise<Confirmed> {
  const asked: string[] = [];
  const client = new ClientV2({ name: "idemgate-ask-test-v2", version: "0.0.0" }, { capabilities: { elicitation: {} } });
  client.setRequestHandler("elicitation/create", async (request) => {
    asked.push(request.params.message);
    return { action: "accept", content: { confirm: true } };
  });
  await client.connect(new TransportV2(new URL(url)), REQUEST);
  try {
    // The v2 client's default connect is the legacy handshake.
    assert.equal(client.getNegotiatedProtocolVersion(), LEGACY);
    const result = await client.callTool({ name: "confirmed_charge", arguments: args, _meta: { [KEY_META]: key } }, REQUEST);
    return { result: result as Record<string, unknown>, asked };
  } finally {
    await client.close();
  }
}

describe("a tool that asks mid-call (2025-11-25)", () => {
  let rig: Rig;
  let url: string;

  before(async () => {
    rig = await Rig.start(false);
    url = await rig.proxy("ask");
  });
  after(async () => {
    await rig?.stop();
  });

  for (const [name, session] of [["v1 (@modelcontextprotocol/sdk)", v1], ["v2 (@modelcontextprotocol/client)", v2]] as const) {
    test(`${name}: the question reaches the client, the tool charges once, and a repeat replays`, async () => {
      const who = `ask-${randomUUID().slice(0, 8)}`;
      const args = { customer: who, amount: 700 };
      const key = `ask-${randomUUID()}`;
      const first = await session(url, args, key);
      assert.deepEqual(first.asked, [`Charge ${who} 700?`]);
      assert.equal(first.result["isError"], false, JSON.stringify(first.result));
      const charged = rig.executions("confirmed_charge", who);
      assert.equal(charged.length, 1);
      assert.deepEqual(first.result["structuredContent"], { charge: charged[0]?.charge, amount: 700 });
      // The whole call again, on a new session: replayed, never asked again.
      const again = await session(url, args, key);
      assert.deepEqual(again.asked, []);
      assert.deepEqual(again.result["structuredContent"], first.result["structuredContent"]);
      assert.equal(rig.executions("confirmed_charge", who).length, 1);
      assert.equal(rig.executions("confirmed_charge.asked", who).length, 1);
    });
  }
});
