// The MCP server of tests/mcp/server.py (the official Python SDK, unchanged),
// run with the Python tools .ci/clients installs, and `idemgate proxy
// --protocol mcp` in front of it on a SQLite file; the official TypeScript
// client talks to the proxy.
import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, openSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

/** The repository: the first folder above this file with a Cargo.toml. */
function repository(): string {
  let dir = dirname(fileURLToPath(import.meta.url));
  while (!existsSync(join(dir, "Cargo.toml"))) {
    const up = dirname(dir);
    if (up === dir) throw new Error("tests/mcp/ts: no Cargo.toml above this file");
    dir = up;
  }
  return dir;
}

export const ROOT = repository();
const TARGET = resolve(ROOT, process.env["CARGO_TARGET_DIR"] ?? "target");
export const BIN = process.env["IDEMGATE_BIN"] ?? join(TARGET, "debug", "idemgate");
export const PYTHON = process.env["MCP_PYTHON"] ?? join(TARGET, "clients", "python", "bin", "python");
export const SERVER = join(ROOT, "tests", "mcp", "server.py");

/** Each request's own bound: a call that never gets its answer fails in seconds, not the SDK's 60. */
export const REQUEST = { timeout: 15_000 };

async function freePort(): Promise<number> {
  return new Promise((done, fail) => {
    const probe = createServer();
    probe.once("error", fail);
    probe.listen(0, "127.0.0.1", () => {
      const address = probe.address();
      const port = typeof address === "object" && address ? address.port : 0;
      probe.close(() => done(port));
    });
  });
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Until `url` answers at all (any status); fails with the log if the process exits or 30 s pass. */
async function waitFor(child: ChildProcess, url: string, what: string, log: string): Promise<void> {
  const deadline = Date.now() + 30_000;
  for (;;) {
    if (child.exitCode !== null || child.signalCode !== null) {
      throw new Error(`${what} exited (${child.exitCode ?? child.signalCode}): ${tail(log)}`);
    }
    try {
      await fetch(url, { signal: AbortSignal.timeout(1000) });
      return;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) throw new Error(`${what} did not answer at ${url} within 30 s: ${tail(log)}`);
    await sleep(100);
  }
}

function tail(path: string): string {
  return existsSync(path) ? readFileSync(path, "utf8").slice(-2000) : "(no log)";
}

const children = new Set<ChildProcess>();
process.on("exit", () => {
  for (const child of children) child.kill("SIGKILL");
});

async function stopChild(child: ChildProcess): Promise<void> {
  if (child.exitCode === null && child.signalCode === null) {
    const exited = new Promise((r) => child.once("exit", r));
    child.kill("SIGTERM");
    const killed = setTimeout(() => child.kill("SIGKILL"), 10_000);
    await exited;
    clearTimeout(killed);
  }
  children.delete(child);
}

export interface Execution {
  tool: string;
  customer: string;
  charge?: string;
  amount?: number;
  [argument: string]: unknown;
}

/** One MCP server (event stream or JSON answers) and the proxies in front of it. */
export class Rig {
  readonly dir = mkdtempSync(join(tmpdir(), "idemgate-mcp-ts-"));
  private readonly processes: ChildProcess[] = [];
  private serverPort = 0;

  private constructor(readonly jsonResponse: boolean) {}

  /** The server's log of every execution of a tool. */
  get log(): string {
    return join(this.dir, "executions.jsonl");
  }

  static async start(jsonResponse: boolean): Promise<Rig> {
    const rig = new Rig(jsonResponse);
    try {
      rig.serverPort = await freePort();
      const args = [SERVER, String(rig.serverPort), ...(jsonResponse ? ["--json-response"] : [])];
      const log = join(rig.dir, "server.log");
      const out = openSync(log, "a");
      const server = rig.track(spawn(PYTHON, args, {
        env: { ...process.env, CHARGES_LOG: rig.log, PYTHONDONTWRITEBYTECODE: "1" },
        stdio: ["ignore", out, out],
      }));
      await waitFor(server, `http://127.0.0.1:${rig.serverPort}/`, `the MCP server (${PYTHON} ${SERVER})`, log);
    } catch (e) {
      await rig.stop();
      throw e;
    }
    return rig;
  }

  /** A proxy in front of the server, on a SQLite file of its own: its MCP endpoint's URL. */
  async proxy(name: string, ...flags: string[]): Promise<string> {
    return (await this.door(name, ...flags)).url;
  }

  /** A proxy in front of the server, on a SQLite file of its own: its MCP endpoint's and admin listener's URLs. */
  async door(name: string, ...flags: string[]): Promise<{ url: string; admin: string }> {
    const [port, admin] = [await freePort(), await freePort()];
    const log = join(this.dir, `proxy-${name}.log`);
    const out = openSync(log, "a");
    const proxy = this.track(spawn(BIN, [
      "proxy", "--protocol", "mcp",
      "--upstream", `http://127.0.0.1:${this.serverPort}`,
      "--listen", `127.0.0.1:${port}`, "--admin-listen", `127.0.0.1:${admin}`,
      "--database-url", `sqlite://${join(this.dir, `keys-${name}.db`)}`,
      ...flags,
    ], { stdio: ["ignore", out, out] }));
    await waitFor(proxy, `http://127.0.0.1:${admin}/healthz`, `idemgate proxy (${BIN})`, log);
    return { url: `http://127.0.0.1:${port}/mcp`, admin: `http://127.0.0.1:${admin}` };
  }

  private track(child: ChildProcess): ChildProcess {
    children.add(child);
    this.processes.push(child);
    return child;
  }

  /** What the server ran, of one tool, for one customer (each test has its own). */
  executions(tool: string, customer: string): Execution[] {
    if (!existsSync(this.log)) return [];
    return readFileSync(this.log, "utf8")
      .split("\n")
      .filter((line) => line !== "")
      .map((line) => JSON.parse(line) as Execution)
      .filter((e) => e.tool === tool && e.customer === customer);
  }

  async stop(): Promise<void> {
    // The proxies first, then the server they front.
    for (const child of [...this.processes].reverse()) await stopChild(child);
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** An initialized session of the official client with the MCP endpoint at `url`. */
export async function connect(url: string): Promise<Client> {
  const client = new Client({ name: "idemgate-door-test", version: "0.0.0" });
  await client.connect(new StreamableHTTPClientTransport(new URL(url)), REQUEST);
  return client;
}

/** `fn` on a session of its own, closed after. */
export async function withSession<T>(url: string, fn: (client: Client) => Promise<T>): Promise<T> {
  const client = await connect(url);
  try {
    return await fn(client);
  } finally {
    await client.close();
  }
}
