// `idemgate proxy --protocol mcp` (docs/mcp.md) driven by the official
// TypeScript client's v2 package (@modelcontextprotocol/client: Client +
// StreamableHTTPClientTransport), in front of tests/mcp/server.py, in both of
// the server's answer forms, and in both of the client's ways to connect: its
// default (no versionNegotiation: the 2025 `initialize` handshake) and
// `versionNegotiation: { mode: 'auto' }` (a `server/discover` probe, then
// protocol 2026-07-28). Every answer the door writes itself — a refusal, or
// the replay of what an operator entered — must reach the client as a tool
// result, and under 2026-07-28 carry `resultType: "complete"` on the wire
// (seen through the transport's fetch).
//
//   npm ci && IDEMGATE_BIN=... MCP_PYTHON=... npm test     (.ci/mcp runs it)
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";

import { REQUEST, Rig } from "./rig.js";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const key = () => `step-${randomUUID()}`;
const customer = () => `v2-${randomUUID().slice(0, 8)}`;
const KEY_META = "dev.idemgate/idempotency-key";
const MODERN = "2026-07-28";

type ToolResult = Awaited<ReturnType<Client["callTool"]>>;
type Mode = "default" | "auto";

/** One JSON-RPC message the server side sent, with the request it answered. */
interface Seen {
  method: string;
  headers: Record<string, string>;
  message: Record<string, unknown>;
}

/** A connected v2 client, and every answer its transport read (raw). */
interface Session {
  client: Client;
  seen: Seen[];
  close: () => Promise<void>;
}

function messagesOf(contentType: string, text: string): Record<string, unknown>[] {
  if (contentType.startsWith("text/event-stream")) {
    return text.replace(/\r\n/g, "\n").split("\n\n").flatMap((event) => {
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      return data ? [JSON.parse(data) as Record<string, unknown>] : [];
    });
  }
  if (contentType.startsWith("application/json") && text.trim() !== "") {
    const parsed = JSON.parse(text) as unknown;
    return (Array.isArray(parsed) ? parsed : [parsed]) as Record<string, unknown>[];
  }
  return [];
}

async function connect(url: string, mode: Mode): Promise<Session> {
  const seen: Seen[] = [];
  const pending: Promise<void>[] = [];
  const recording = async (input: string | URL | Request, init?: RequestInit): Promise<Response> => {
    const response = await fetch(input, init);
    const body = typeof init?.body === "string" ? (JSON.parse(init.body) as { method?: string }) : {};
    const headers = Object.fromEntries(new Headers(init?.headers).entries());
    if (body.method !== undefined && init?.method === "POST") {
      const contentType = response.headers.get("content-type") ?? "";
      pending.push(response.clone().text().then((text) => {
        for (const message of messagesOf(contentType, text)) seen.push({ method: body.method ?? "", headers, message });
      }, () => undefined));
    }
    return response;
  };
  const client = new Client(
    { name: "idemgate-door-test-v2", version: "0.0.0" },
    mode === "auto" ? { versionNegotiation: { mode: "auto" } } : {},
  );
  await client.connect(new StreamableHTTPClientTransport(new URL(url), { fetch: recording }), REQUEST);
  const expected = mode === "auto" ? "modern" : "legacy";
  assert.equal(client.getProtocolEra(), expected, `mode ${mode} negotiated ${client.getNegotiatedProtocolVersion()}`);
  return {
    client,
    seen,
    close: async () => {
      await client.close();
      await Promise.all(pending);
    },
  };
}

async function withSession<T>(url: string, mode: Mode, fn: (s: Session) => Promise<T>): Promise<T> {
  const s = await connect(url, mode);
  try {
    return await fn(s);
  } finally {
    await s.close();
  }
}

function call(s: Session, args: Record<string, unknown>, name = "charge", meta?: Record<string, unknown>) {
  return s.client.callTool({ name, arguments: args, ...(meta ? { _meta: meta } : {}) }, REQUEST);
}

function structured(result: ToolResult): Record<string, unknown> {
  const content = result["structuredContent"];
  assert.ok(content !== null && typeof content === "object", `no structuredContent in ${JSON.stringify(result)}`);
  return content as Record<string, unknown>;
}

/** The problem's name of a refusal: from `_meta["dev.idemgate/problem"]`, named in its text too. */
function problemType(result: ToolResult): string {
  assert.equal(result["isError"], true, JSON.stringify(result));
  const meta = result["_meta"] as Record<string, unknown> | undefined;
  const problem = meta?.["dev.idemgate/problem"] as Record<string, unknown> | undefined;
  assert.ok(problem, `no problem in _meta: ${JSON.stringify(result)}`);
  const name = String(problem["type"]).split("/").pop() ?? "";
  const content = result["content"] as { text?: string }[];
  assert.ok(content.some((c) => (c.text ?? "").includes(name)), JSON.stringify(result));
  return name;
}

/** Every tools/call answer the session read is a result valid under its protocol:
 * under 2026-07-28, `resultType: "complete"` (and the request said 2026-07-28). */
function checkWire(s: Session, mode: Mode): void {
  const calls = s.seen.filter((x) => x.method === "tools/call" && "result" in x.message);
  assert.ok(calls.length > 0, "the transport saw no tools/call answer");
  for (const x of calls) {
    const result = x.message["result"] as Record<string, unknown>;
    if (mode === "auto") {
      assert.equal(x.headers["mcp-protocol-version"], MODERN, JSON.stringify(x.headers));
      assert.equal(result["resultType"], "complete", `no resultType under ${MODERN}: ${JSON.stringify(x.message)}`);
    }
  }
}

/** An operator settles the one unknown key with what the server's records show. */
async function settle(admin: string, response: Record<string, unknown>): Promise<void> {
  const list = await fetch(`${admin}/v1/admin/keys?state=unknown`);
  const { keys } = (await list.json()) as { keys: { tenant: string; key_hash: string }[] };
  assert.equal(keys.length, 1, JSON.stringify(keys));
  const stuck = keys[0]!;
  const answer = await fetch(`${admin}/v1/admin/keys/${stuck.tenant}/${stuck.key_hash}/resolve`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({
      action: "complete",
      reason: "the ledger shows it",
      response: { status: 200, headers: [["content-type", "application/json"]], body: JSON.stringify(response) },
    }),
  });
  assert.equal(answer.status, 200, await answer.text());
}

for (const form of ["event-stream", "json"] as const) describe(`v2 client, ${form}`, () => {
  let rig: Rig;
  let url: string;

  before(async () => {
    rig = await Rig.start(form === "json");
    url = await rig.proxy("v2");
  });
  after(async () => {
    await rig?.stop();
  });

  for (const mode of ["default", "auto"] as const) describe(`connect: ${mode}`, () => {
    test("a repeated call runs once; the key in _meta works too", async () => {
      const who = customer();
      const k = key();
      const results = await withSession(url, mode, async (s) => {
        await s.client.listTools(undefined, REQUEST);
        const byArgument = [
          await call(s, { customer: who, amount: 1, idempotency_key: k }),
          await call(s, { customer: who, amount: 1, idempotency_key: k }),
        ];
        const byMeta = [
          await call(s, { customer: who, amount: 2 }, "charge", { [KEY_META]: k + "-meta" }),
          await call(s, { customer: who, amount: 2, idempotency_key: "the-model-s-own" }, "charge", { [KEY_META]: k + "-meta" }),
        ];
        checkWire(s, mode);
        return [...byArgument, ...byMeta];
      });
      assert.ok(results.every((r) => !r["isError"]), JSON.stringify(results));
      assert.deepEqual(structured(results[1]!), structured(results[0]!));
      assert.deepEqual(structured(results[3]!), structured(results[2]!));
      const executed = rig.executions("charge", who);
      assert.equal(executed.length, 2, JSON.stringify(executed));
      assert.ok(executed.every((e) => !("idempotency_key" in e)));
    });

    test("key-invalid and key-reused are tool results (a typed tool's too)", async () => {
      const who = customer();
      const k = key();
      await withSession(url, mode, async (s) => {
        await s.client.listTools(undefined, REQUEST);
        assert.equal(problemType(await call(s, { customer: who, amount: 1, idempotency_key: 42 })), "key-invalid");
        assert.ok(!(await call(s, { customer: who, amount: 1, idempotency_key: k }))["isError"]);
        assert.equal(problemType(await call(s, { customer: who, amount: 2, idempotency_key: k })), "key-reused");
        const typed = key();
        const first = await call(s, { customer: who, amount: 3, idempotency_key: typed }, "typed_charge");
        assert.ok(!first["isError"], JSON.stringify(first));
        assert.equal(problemType(await call(s, { customer: who, amount: 4, idempotency_key: typed }, "typed_charge")), "key-reused");
        checkWire(s, mode);
      });
      assert.equal(rig.executions("charge", who).length, 1);
      assert.equal(rig.executions("typed_charge", who).length, 1);
    });

    test("request-in-flight, outcome-unknown and an operator's replay are tool results", async () => {
      // No wait for a held repeat, and a call still running after 1 s is abandoned (its outcome unknown).
      const door = await rig.door(`v2-${mode}-${randomUUID().slice(0, 8)}`, "--default-wait", "0", "--upstream-abandon-after", "1");
      const who = customer();
      const args = { customer: who, amount: 77, seconds: 2.5, idempotency_key: key() };
      const [one, two] = [await connect(door.url, mode), await connect(door.url, mode)];
      try {
        const running = call(one, args, "slow_charge").then(
          (r) => ({ ok: true as const, r }),
          (e: unknown) => ({ ok: false as const, e }),
        );
        await sleep(300);
        assert.equal(problemType(await call(two, args, "slow_charge")), "request-in-flight");
        const cut = await running;
        assert.ok(!cut.ok, `a call abandoned after 1 s got a result: ${JSON.stringify(cut)}`);
        assert.equal(problemType(await call(two, args, "slow_charge")), "outcome-unknown");
        checkWire(two, mode);
      } finally {
        await Promise.all([one.close(), two.close()]);
      }
      // The operator's answer is the tool's result alone, as a handshake-era server wrote it (no resultType).
      await settle(door.admin, {
        content: [{ type: "text", text: "ch_ops77" }],
        structuredContent: { charge: "ch_ops77", amount: 77 },
        isError: false,
      });
      const replayed = await withSession(door.url, mode, async (s) => {
        const r = await call(s, args, "slow_charge");
        checkWire(s, mode);
        return r;
      });
      assert.ok(!replayed["isError"], JSON.stringify(replayed));
      assert.deepEqual(structured(replayed), { charge: "ch_ops77", amount: 77 });
      assert.ok(rig.executions("slow_charge", who).length <= 1);
    });
  });
});
