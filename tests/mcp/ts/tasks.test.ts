// Task-augmented tool calls (MCP 2025-11-25 Tasks) through `idemgate proxy
// --protocol mcp` (docs/mcp.md, "Tasks"): a server made with the official
// TypeScript SDK's experimental tasks (@modelcontextprotocol/sdk's McpServer,
// registerToolTask, InMemoryTaskStore), on a socket of its own, and its
// official client's callToolStream, which asks for a task, polls tasks/get and
// fetches tasks/result. The door runs as the real binary. A repeat with the
// same key gets the task the server created, never a second one.
//
//   npm ci && IDEMGATE_BIN=... npm test     (.ci/mcp runs it)
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { randomUUID } from "node:crypto";
import { mkdtempSync, openSync, readFileSync, rmSync } from "node:fs";
import { createServer, type IncomingMessage, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { after, before, describe, test } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { InMemoryTaskMessageQueue, InMemoryTaskStore } from "@modelcontextprotocol/sdk/experimental/tasks/stores/in-memory.js";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import { CallToolResultSchema, isInitializeRequest, type Task } from "@modelcontextprotocol/sdk/types.js";
import { z } from "zod";

import { REQUEST, ROOT } from "./rig.js";

const BIN = process.env["IDEMGATE_BIN"] ?? join(resolve(ROOT, process.env["CARGO_TARGET_DIR"] ?? "target"), "debug", "idemgate");
const KEY_META = "dev.idemgate/idempotency-key";
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** A streamable-HTTP MCP server whose `charge` runs as a task only; every
 * task it creates is one execution. Sessions share one task store, which binds
 * each task to the session that created it. */
class TaskServer {
  readonly executions: { customer: string; amount: number; taskId: string }[] = [];
  private readonly taskStore = new InMemoryTaskStore();
  private readonly sessions = new Map<string, StreamableHTTPServerTransport>();
  private http?: Server;
  url = "";

  constructor(private readonly jsonResponse: boolean) {}

  private mcpServer(): McpServer {
    const server = new McpServer(
      { name: "task-payments", version: "0.0.0" },
      {
        capabilities: { tasks: { requests: { tools: { call: {} } }, list: {}, cancel: {} } },
        taskStore: this.taskStore,
        taskMessageQueue: new InMemoryTaskMessageQueue(),
      },
    );
    server.experimental.tasks.registerToolTask("charge", {
      description: "Charge a customer an amount in cents, as a task.",
      inputSchema: { customer: z.string(), amount: z.number().int() },
      execution: { taskSupport: "required" },
    }, {
      createTask: async ({ customer, amount }, { taskStore, taskRequestedTtl }) => {
        const task = await taskStore.createTask({ ttl: taskRequestedTtl ?? null, pollInterval: 50 });
        const charge = `ch_${randomUUID().slice(0, 12)}`;
        this.executions.push({ customer, amount, taskId: task.taskId });
        setTimeout(() => {
          void taskStore.storeTaskResult(task.taskId, "completed", {
            content: [{ type: "text", text: `charged ${customer} ${amount} as ${charge}` }],
          });
        }, 100);
        return { task };
      },
      getTask: async (_args, { taskId, taskStore }) => {
        const task = await taskStore.getTask(taskId);
        if (!task) throw new Error(`no task ${taskId}`);
        return task;
      },
      getTaskResult: async (_args, { taskId, taskStore }) => {
        return (await taskStore.getTaskResult(taskId)) as never;
      },
    });
    return server;
  }

  async start(): Promise<void> {
    this.http = createServer((req, res) => {
      void this.handle(req, res).catch((e: unknown) => {
        res.statusCode = 500;
        res.end(String(e));
      });
    });
    await new Promise<void>((done) => this.http?.listen(0, "127.0.0.1", done));
    const { port } = this.http.address() as AddressInfo;
    this.url = `http://127.0.0.1:${port}/mcp`;
  }

  private async handle(req: IncomingMessage, res: import("node:http").ServerResponse): Promise<void> {
    let body: unknown;
    if (req.method === "POST") {
      const chunks: Buffer[] = [];
      for await (const chunk of req) chunks.push(chunk as Buffer);
      body = JSON.parse(Buffer.concat(chunks).toString("utf8"));
    }
    const sessionId = req.headers["mcp-session-id"];
    const known = typeof sessionId === "string" ? this.sessions.get(sessionId) : undefined;
    if (known) return known.handleRequest(req, res, body);
    if (sessionId === undefined && req.method === "POST" && isInitializeRequest(body)) {
      const transport: StreamableHTTPServerTransport = new StreamableHTTPServerTransport({
        sessionIdGenerator: () => randomUUID(),
        enableJsonResponse: this.jsonResponse,
        onsessioninitialized: (id) => {
          this.sessions.set(id, transport);
        },
      });
      transport.onclose = () => {
        if (transport.sessionId) this.sessions.delete(transport.sessionId);
      };
      await this.mcpServer().connect(transport);
      return transport.handleRequest(req, res, body);
    }
    res.writeHead(sessionId === undefined ? 400 : 404, { "content-type": "application/json" });
    res.end(JSON.stringify({ jsonrpc: "2.0", error: { code: -32000, message: "no session" }, id: null }));
  }

  async stop(): Promise<void> {
    for (const transport of this.sessions.values()) await transport.close();
    this.taskStore.cleanup();
    await new Promise((done) => this.http?.close(done));
  }
}

/** The door in front of `upstream`, on a SQLite file in `dir`: its MCP endpoint. */
async function startDoor(upstream: string, dir: string, children: ChildProcess[]): Promise<string> {
  const port = await freePort();
  const admin = await freePort();
  const log = join(dir, "proxy.log");
  const door = spawn(BIN, [
    "proxy", "--protocol", "mcp", "--upstream", upstream,
    "--listen", `127.0.0.1:${port}`, "--admin-listen", `127.0.0.1:${admin}`,
    "--database-url", `sqlite://${join(dir, "keys.db")}`,
  ], { stdio: ["ignore", openSync(log, "a"), openSync(log, "a")] });
  children.push(door);
  const deadline = Date.now() + 30_000;
  for (;;) {
    if (door.exitCode !== null) throw new Error(`idemgate proxy exited: ${readFileSync(log, "utf8").slice(-2000)}`);
    try {
      await fetch(`http://127.0.0.1:${admin}/healthz`, { signal: AbortSignal.timeout(1000) });
      return `http://127.0.0.1:${port}/mcp`;
    } catch {
      if (Date.now() > deadline) throw new Error(`idemgate proxy did not start: ${readFileSync(log, "utf8").slice(-2000)}`);
      await sleep(100);
    }
  }
}

async function freePort(): Promise<number> {
  const probe = createServer();
  await new Promise<void>((done) => probe.listen(0, "127.0.0.1", done));
  const { port } = probe.address() as AddressInfo;
  await new Promise((done) => probe.close(done));
  return port;
}

async function connect(url: string): Promise<Client> {
  const client = new Client({ name: "idemgate-task-test", version: "0.0.0" });
  await client.connect(new StreamableHTTPClientTransport(new URL(url)), REQUEST);
  await client.listTools(undefined, REQUEST); // learns that charge runs as a task
  return client;
}

interface Run {
  created: Task;
  text: string;
}

/** A task-augmented `charge` under key `key`, followed to its result. */
async function chargeAsTask(client: Client, key: string, customer: string, ttl: number): Promise<Run> {
  let created: Task | undefined;
  let text: string | undefined;
  const stream = client.experimental.tasks.callToolStream(
    { name: "charge", arguments: { customer, amount: 700 }, _meta: { [KEY_META]: key } },
    CallToolResultSchema,
    { ...REQUEST, task: { ttl } },
  );
  for await (const message of stream) {
    if (message.type === "taskCreated") created = message.task;
    if (message.type === "error") throw message.error;
    if (message.type === "result") {
      const content = message.result.content as { type: string; text?: string }[];
      text = content.map((c) => c.text ?? "").join("");
    }
  }
  assert.ok(created, "no task was created");
  assert.ok(text !== undefined, "no result");
  return { created, text };
}

for (const form of ["event-stream", "json"] as const) describe(`tasks (${form})`, () => {
  const dir = mkdtempSync(join(tmpdir(), "idemgate-mcp-tasks-"));
  const children: ChildProcess[] = [];
  let server: TaskServer;
  let url: string;

  before(async () => {
    server = new TaskServer(form === "json");
    await server.start();
    url = await startDoor(server.url, dir, children);
  });
  after(async () => {
    for (const child of children) child.kill("SIGKILL");
    await server?.stop();
    rmSync(dir, { recursive: true, force: true });
  });

  test("a repeat gets the task the server created, never a second one", async () => {
    const customer = `c-${randomUUID().slice(0, 8)}`;
    const key = `step-${randomUUID()}`;
    const client = await connect(url);
    try {
      const first = await chargeAsTask(client, key, customer, 60_000);
      // Another ttl is the same call: the same task.
      const repeat = await chargeAsTask(client, key, customer, 5_000);
      assert.equal(repeat.created.taskId, first.created.taskId);
      assert.equal(repeat.text, first.text);
      assert.match(first.text, new RegExp(`^charged ${customer} 700 as ch_`));
      // tasks/get and tasks/result pass through the door to the server.
      const task = await client.experimental.tasks.getTask(first.created.taskId, REQUEST);
      assert.equal(task.status, "completed");
      const result = await client.experimental.tasks.getTaskResult(first.created.taskId, CallToolResultSchema, REQUEST);
      assert.equal((result.content[0] as { text: string }).text, first.text);
    } finally {
      await client.close();
    }
    assert.deepEqual(server.executions.filter((e) => e.customer === customer).length, 1);
  });

  test("another call under the key is refused with an error the client reads", async () => {
    const customer = `c-${randomUUID().slice(0, 8)}`;
    const key = `step-${randomUUID()}`;
    const client = await connect(url);
    try {
      await chargeAsTask(client, key, customer, 60_000);
      // Another amount: a task-augmented call's refusal is a JSON-RPC error
      // (a tool result is no task, and the client would fail to read it).
      const stream = client.experimental.tasks.callToolStream(
        { name: "charge", arguments: { customer, amount: 900 }, _meta: { [KEY_META]: key } },
        CallToolResultSchema,
        { ...REQUEST, task: { ttl: 60_000 } },
      );
      const messages = [];
      for await (const message of stream) messages.push(message);
      assert.equal(messages.length, 1, JSON.stringify(messages));
      const [only] = messages;
      assert.equal(only?.type, "error");
      assert.match(only.type === "error" ? only.error.message : "", /idemgate refused this call \(key-reused\)/);
    } finally {
      await client.close();
    }
    assert.equal(server.executions.filter((e) => e.customer === customer).length, 1);
  });

  test("a repeat on a new session gets the same task's id", async () => {
    const customer = `c-${randomUUID().slice(0, 8)}`;
    const key = `step-${randomUUID()}`;
    const first = await connect(url);
    let created: Task;
    try {
      created = (await chargeAsTask(first, key, customer, 60_000)).created;
    } finally {
      await first.close();
    }
    const second = await connect(url);
    try {
      // The replay of the task's creation: the same id, without running the
      // tool. The SDK's task store binds a task to the session that created
      // it, so this session's client cannot follow it there: it is told so.
      const stream = second.experimental.tasks.callToolStream(
        { name: "charge", arguments: { customer, amount: 700 }, _meta: { [KEY_META]: key } },
        CallToolResultSchema,
        { ...REQUEST, task: { ttl: 60_000 } },
      );
      let replayed: Task | undefined;
      for await (const message of stream) {
        if (message.type === "taskCreated") replayed = message.task;
        if (message.type === "result" || message.type === "error") break;
      }
      assert.equal(replayed?.taskId, created.taskId);
      await assert.rejects(second.experimental.tasks.getTask(created.taskId, REQUEST));
    } finally {
      await second.close();
    }
    assert.equal(server.executions.filter((e) => e.customer === customer).length, 1);
  });
});
