// `idemgate proxy --protocol mcp --stdio -- COMMAND` (docs/mcp.md, "stdio
// servers") started as an MCP host starts a local server, by the official
// TypeScript clients' stdio transports (v1's @modelcontextprotocol/sdk
// StdioClientTransport; v2's @modelcontextprotocol/client/stdio, in its
// default connect and in versionNegotiation 'auto', 2026-07-28), with
// tests/mcp/server.py on the Python SDK's stdio server as the command. A
// keyed call charges once, its repeat (and a new door's) replays, another
// call under the key is refused as a tool result; and the TypeScript
// package's callToolOnce works through it.
//
//   npm ci && IDEMGATE_BIN=... MCP_PYTHON=... npm test     (.ci/mcp runs it)
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, describe, test } from "node:test";

import { Client as ClientV1 } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport as StdioV1 } from "@modelcontextprotocol/sdk/client/stdio.js";
import { Client as ClientV2 } from "@modelcontextprotocol/client";
import { StdioClientTransport as StdioV2 } from "@modelcontextprotocol/client/stdio";

import { callToolOnce, derive_key } from "../../../clients/typescript/src/index.js";
import { BIN, PYTHON, REQUEST, SERVER } from "./rig.js";

const dir = mkdtempSync(join(tmpdir(), "idemgate-mcp-stdio-ts-"));
after(() => rmSync(dir, { recursive: true, force: true }));
const log = join(dir, "executions.jsonl");

/** The door's environment: no IDEMGATE_ setting, no DATABASE_URL (the keys go to the data directory). */
function env(): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [name, value] of Object.entries(process.env)) {
    if (value !== undefined && !name.startsWith("IDEMGATE_") && name !== "DATABASE_URL") env[name] = value;
  }
  return { ...env, CHARGES_LOG: log, XDG_DATA_HOME: join(dir, "data"), RUST_LOG: "warn" };
}

const server = () => ({
  command: BIN,
  args: ["proxy", "--protocol", "mcp", "--stdio", "--", PYTHON, SERVER, "--stdio"],
  env: env(),
  stderr: "ignore" as const,
});

interface Caller {
  call(name: string, args: Record<string, unknown>): Promise<Record<string, unknown>>;
  close(): Promise<void>;
}

type Way = "v1" | "v2" | "v2-auto";

async function connect(way: Way): Promise<Caller> {
  if (way === "v1") {
    const client = new ClientV1({ name: "idemgate-stdio-test", version: "0.0.0" });
    await client.connect(new StdioV1(server()), REQUEST);
    return {
      call: async (name, args) => (await client.callTool({ name, arguments: args }, undefined, REQUEST)) as Record<string, unknown>,
      close: () => client.close(),
    };
  }
  const client = new ClientV2(
    { name: "idemgate-stdio-test-v2", version: "0.0.0" },
    way === "v2-auto" ? { versionNegotiation: { mode: "auto" } } : {},
  );
  await client.connect(new StdioV2(server()), REQUEST);
  assert.equal(client.getProtocolEra(), way === "v2-auto" ? "modern" : "legacy");
  return {
    call: async (name, args) => (await client.callTool({ name, arguments: args }, REQUEST)) as Record<string, unknown>,
    close: () => client.close(),
  };
}

async function withDoor<T>(way: Way, fn: (c: Caller) => Promise<T>): Promise<T> {
  const caller = await connect(way);
  try {
    return await fn(caller);
  } finally {
    await caller.close();
  }
}

function charges(who: string): Array<Record<string, unknown>> {
  if (!existsSync(log)) return [];
  return readFileSync(log, "utf8")
    .split("\n")
    .filter((line) => line !== "")
    .map((line) => JSON.parse(line) as Record<string, unknown>)
    .filter((e) => e["tool"] === "charge" && e["customer"] === who);
}

function problemType(result: Record<string, unknown>): string {
  assert.equal(result["isError"], true, JSON.stringify(result));
  const meta = result["_meta"] as Record<string, Record<string, unknown>> | undefined;
  return String(meta?.["dev.idemgate/problem"]?.["type"]).split("/").pop() ?? "";
}

describe("the stdio door", () => {
  for (const way of ["v1", "v2", "v2-auto"] as const) {
    test(`${way}: a keyed call charges once, a repeat replays, another call under the key is refused`, async () => {
      const who = `stdio-${randomUUID().slice(0, 8)}`;
      const args = { customer: who, amount: 700, idempotency_key: `k-${randomUUID()}` };
      const [first, again, other] = await withDoor(way, async (c) => [
        await c.call("charge", args),
        await c.call("charge", args),
        await c.call("charge", { ...args, amount: 701 }),
      ]);
      assert.notEqual(first["isError"], true, JSON.stringify(first));
      assert.deepEqual(again["structuredContent"], first["structuredContent"]);
      assert.equal(problemType(other), "key-reused");
      // A new door and a new server, as a host restarts them: the key is kept.
      const later = await withDoor(way, (c) => c.call("charge", args));
      assert.deepEqual(later["structuredContent"], first["structuredContent"]);
      assert.equal(charges(who).length, 1);
    });
  }

  test("callToolOnce through the stdio door charges once per step", async () => {
    const who = `once-${randomUUID().slice(0, 8)}`;
    const step = { tenant: "acme", run: `order-${randomUUID()}`, step: 1 };
    const client = new ClientV1({ name: "idemgate-stdio-once", version: "0.0.0" });
    await client.connect(new StdioV1(server()), REQUEST);
    try {
      const a = await callToolOnce(client, { name: "charge", arguments: { customer: who, amount: 5 } }, step);
      const b = await callToolOnce(client, { name: "charge", arguments: { customer: who, amount: 5 } }, step);
      assert.deepEqual(b["structuredContent"], a["structuredContent"]);
    } finally {
      await client.close();
    }
    assert.equal(charges(who).length, 1);
    assert.ok(derive_key({ ...step, tool: "charge" }));
    const stores = readdirSync(join(dir, "data", "idemgate")).filter((f) => f.startsWith("stdio-") && f.endsWith(".db"));
    assert.equal(stores.length, 1, stores.join(", "));
  });
});
