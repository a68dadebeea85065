// A real `idemgate serve` for the tests: the binary named by IDEMGATE_BIN
// (.ci/clients builds it and sets it), on a SQLite file of its own.
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { createHash, randomUUID } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

export const TOKEN = "client-tests-token-acme";
export const OTHER_TOKEN = "client-tests-token-globex";
export const ADMIN_TOKEN = "client-tests-token-operator";
/** The tenant TOKEN names: the one the operators' endpoints file its keys under. */
export const TENANT = "acme";

export interface Server {
  baseUrl: string;
  stop(): Promise<void>;
}

async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const probe = createServer();
    probe.once("error", reject);
    probe.listen(0, "127.0.0.1", () => {
      const address = probe.address();
      const port = typeof address === "object" && address ? address.port : 0;
      probe.close(() => resolve(port));
    });
  });
}

const ADMIN = process.env["IDEMGATE_CLIENT_TEST_PG"] ?? "postgres://postgres@127.0.0.1:5432/postgres";

/** A fresh PostgreSQL database made with psql on IDEMGATE_CLIENT_TEST_PG, or undefined when there is none. */
function createDatabase(): string | undefined {
  const name = `idemgate_clients_ts_${randomUUID().replaceAll("-", "").slice(0, 12)}`;
  const made = spawnSync("psql", [ADMIN, "-q", "-c", `CREATE DATABASE "${name}"`], { encoding: "utf8", timeout: 30_000 });
  if (made.status !== 0) return undefined;
  return `${ADMIN.slice(0, ADMIN.lastIndexOf("/"))}/${name}`;
}

function dropDatabase(url: string): void {
  const name = url.slice(url.lastIndexOf("/") + 1);
  spawnSync("psql", [ADMIN, "-q", "-c", `DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`], { timeout: 30_000 });
}

export type Store = "sqlite" | "postgres";

/** Whether PostgreSQL tests run: psql works, or CI requires them (they then fail loudly). */
export function postgresWanted(): boolean {
  if (process.env["IDEMGATE_CLIENT_TEST_REQUIRE_PG"]) return true;
  return spawnSync("psql", [ADMIN, "-q", "-c", "SELECT 1"], { timeout: 10_000 }).status === 0;
}

/** Until `url` answers 200; fails with the log if the process exits or 30 s pass. */
async function waitHealthy(child: ChildProcess, url: string, log: () => string, what: string): Promise<void> {
  const deadline = Date.now() + 30_000;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`${what} exited: ${log()}`);
    try {
      if ((await fetch(url)).ok) return;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      child.kill("SIGKILL");
      throw new Error(`${what} did not answer within 30 s: ${log()}`);
    }
    await new Promise((r) => setTimeout(r, 50));
  }
}

function binaryPath(): string {
  const binary = process.env["IDEMGATE_BIN"];
  if (!binary) {
    throw new Error("set IDEMGATE_BIN to an idemgate binary (cargo build; IDEMGATE_BIN=target/debug/idemgate)");
  }
  return binary;
}

/** `idemgate serve` on `databaseUrl` and `port`, once it answers. */
async function serve(databaseUrl: string, port: number): Promise<ChildProcess> {
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    DATABASE_URL: databaseUrl,
    IDEMGATE_LISTEN: `127.0.0.1:${port}`,
    IDEMGATE_TOKENS: `acme:${TOKEN},globex:${OTHER_TOKEN}`,
    IDEMGATE_ADMIN_TOKENS: `ops:${ADMIN_TOKEN}`,
    IDEMGATE_PRUNE_INTERVAL: "0",
    RUST_LOG: "warn",
  };
  delete env["IDEMGATE_CONFIG"];
  let log = "";
  const child: ChildProcess = spawn(binaryPath(), ["serve"], { env, stdio: ["ignore", "pipe", "pipe"] });
  child.stdout?.on("data", (d: Buffer) => (log += d.toString()));
  child.stderr?.on("data", (d: Buffer) => (log += d.toString()));
  await waitHealthy(child, `http://127.0.0.1:${port}/healthz`, () => log, "idemgate serve");
  return child;
}

/** A store of a test's own: a SQLite file in `dir`, or a fresh PostgreSQL database. */
function makeStore(store: Store, dir: string): string {
  if (store === "postgres") {
    const made = createDatabase();
    if (made === undefined) throw new Error(`no PostgreSQL to test on (psql on ${ADMIN})`);
    return made;
  }
  return `sqlite://${join(dir, "keys.db")}`;
}

export async function startServer(store: Store = "sqlite"): Promise<Server> {
  binaryPath();
  const dir = mkdtempSync(join(tmpdir(), "idemgate-ts-"));
  const port = await freePort();
  const databaseUrl = makeStore(store, dir);
  const child = await serve(databaseUrl, port);
  const baseUrl = `http://127.0.0.1:${port}`;
  return {
    baseUrl,
    stop: async () => {
      const exited = new Promise((r) => child.once("exit", r));
      child.kill("SIGTERM");
      await exited;
      rmSync(dir, { recursive: true, force: true });
      if (store === "postgres") dropDatabase(databaseUrl);
    },
  };
}

/**
 * A server that a test kills (SIGKILL) and starts again on the same store
 * and port, as an outage and the server's return.
 */
export interface KillableServer extends Server {
  kill(): Promise<void>;
  startAgain(): Promise<void>;
}

export async function startKillableServer(store: Store = "sqlite"): Promise<KillableServer> {
  binaryPath();
  const dir = mkdtempSync(join(tmpdir(), "idemgate-ts-"));
  const port = await freePort();
  const databaseUrl = makeStore(store, dir);
  let child: ChildProcess | undefined = await serve(databaseUrl, port);
  const end = async (signal: NodeJS.Signals) => {
    const running = child;
    child = undefined;
    if (running === undefined || running.exitCode !== null || running.signalCode !== null) return;
    const exited = new Promise((r) => running.once("exit", r));
    running.kill(signal);
    await exited;
  };
  return {
    baseUrl: `http://127.0.0.1:${port}`,
    kill: () => end("SIGKILL"),
    startAgain: async () => {
      child = await serve(databaseUrl, port);
    },
    stop: async () => {
      await end("SIGTERM");
      rmSync(dir, { recursive: true, force: true });
      if (store === "postgres") dropDatabase(databaseUrl);
    },
  };
}

/** A loopback port nothing listens on: a connect to it is refused. */
export const closedPort = freePort;

/** The operators' view of a key (`GET /v1/admin/keys/{tenant}/{key_hash}`). */
export async function adminView(baseUrl: string, key: string, tenant = TENANT): Promise<Record<string, unknown>> {
  const keyHash = createHash("sha256").update(key, "utf8").digest("hex");
  const answer = await fetch(`${baseUrl}/v1/admin/keys/${tenant}/${keyHash}`, {
    headers: { authorization: `Bearer ${ADMIN_TOKEN}` },
  });
  const text = await answer.text();
  if (answer.status !== 200) throw new Error(`the admin view answered ${answer.status}: ${text}`);
  return JSON.parse(text) as Record<string, unknown>;
}

/**
 * An operator settles a stuck key through `POST /v1/admin/keys/{tenant}/{key_hash}/resolve`
 * (with a token of IDEMGATE_ADMIN_TOKENS: a tenant's token is never an
 * operator's): the key goes by its SHA-256, never in the clear.
 */
export async function settle(baseUrl: string, key: string, body: Record<string, unknown>, tenant = TENANT): Promise<Record<string, unknown>> {
  const keyHash = createHash("sha256").update(key, "utf8").digest("hex");
  const answer = await fetch(`${baseUrl}/v1/admin/keys/${tenant}/${keyHash}/resolve`, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${ADMIN_TOKEN}` },
    body: JSON.stringify(body),
  });
  const text = await answer.text();
  if (answer.status !== 200) throw new Error(`resolve answered ${answer.status}: ${text}`);
  return JSON.parse(text) as Record<string, unknown>;
}

/**
 * A payments API that counts its charges, per idempotency key: `/slow/MS`
 * takes that long, `/flaky` answers 503 to a key's first call, `/hangup`
 * charges and then closes the connection without answering, `/stall/MS`
 * charges at once and answers that much later.
 */
export interface Origin {
  url: string;
  charges: Map<string, number>;
  calls: Map<string, number>;
  close(): Promise<void>;
}

export async function startOrigin(): Promise<Origin> {
  const { createServer: createHttpServer } = await import("node:http");
  const charges = new Map<string, number>();
  const calls = new Map<string, number>();
  let total = 0;
  const server = createHttpServer((req, res) => {
    req.resume();
    req.on("end", () => {
      const key = String(req.headers["idempotency-key"] ?? "");
      const call = (calls.get(key) ?? 0) + 1;
      calls.set(key, call);
      const path = req.url ?? "/";
      if (path.startsWith("/hangup")) {
        // The charge is made, then the connection drops before any answer:
        // whether it happened, the caller cannot tell.
        charges.set(key, (charges.get(key) ?? 0) + 1);
        req.socket.destroy();
        return;
      }
      if (path.startsWith("/stall/")) {
        // The charge is made at once; the answer comes late (past the
        // caller's timeout): it acted, and the caller cannot tell.
        charges.set(key, (charges.get(key) ?? 0) + 1);
        total += 1;
        const body = JSON.stringify({ charge: `ch_${total}` });
        setTimeout(() => {
          if (res.destroyed) return;
          res.writeHead(201, { "content-type": "application/json" });
          res.end(body);
        }, Number(path.split("/").pop()));
        return;
      }
      if (path.startsWith("/flaky") && call === 1) {
        res.writeHead(503, { "content-type": "application/json", "retry-after": "1" });
        res.end('{"error":"busy"}');
        return;
      }
      const delay = path.startsWith("/slow/") ? Number(path.split("/").pop()) : 0;
      setTimeout(() => {
        charges.set(key, (charges.get(key) ?? 0) + 1);
        total += 1;
        res.writeHead(201, { "content-type": "application/json" });
        res.end(JSON.stringify({ charge: `ch_${total}` }));
      }, delay);
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const address = server.address();
  const port = typeof address === "object" && address ? address.port : 0;
  return {
    url: `http://127.0.0.1:${port}`,
    charges,
    calls,
    close: () => new Promise((r) => server.close(() => r())),
  };
}

/** `idemgate proxy` in front of `upstream`, on a SQLite file of its own. */
export async function startProxy(upstream: string): Promise<Server> {
  const binary = process.env["IDEMGATE_BIN"];
  if (!binary) throw new Error("set IDEMGATE_BIN to an idemgate binary (cargo build)");
  const dir = mkdtempSync(join(tmpdir(), "idemgate-ts-proxy-"));
  const [port, admin] = [await freePort(), await freePort()];
  const env: NodeJS.ProcessEnv = { ...process.env, DATABASE_URL: `sqlite://${join(dir, "proxy.db")}`, IDEMGATE_PRUNE_INTERVAL: "0", RUST_LOG: "warn" };
  delete env["IDEMGATE_CONFIG"];
  let log = "";
  const child = spawn(binary, ["proxy", "--upstream", upstream, "--listen", `127.0.0.1:${port}`, "--admin-listen", `127.0.0.1:${admin}`], { env, stdio: ["ignore", "pipe", "pipe"] });
  child.stdout?.on("data", (d: Buffer) => (log += d.toString()));
  child.stderr?.on("data", (d: Buffer) => (log += d.toString()));
  await waitHealthy(child, `http://127.0.0.1:${admin}/healthz`, () => log, "idemgate proxy");
  return {
    baseUrl: `http://127.0.0.1:${port}`,
    stop: async () => {
      const exited = new Promise((r) => child.once("exit", r));
      child.kill("SIGTERM");
      await exited;
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
