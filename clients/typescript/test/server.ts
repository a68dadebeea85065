// A real `idemgate serve` for the tests: the binary named by IDEMGATE_BIN
// (.ci/clients builds it and sets it), on a SQLite file of its own.
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

export const TOKEN = "client-tests-token-acme";
export const OTHER_TOKEN = "client-tests-token-globex";

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

export async function startServer(): Promise<Server> {
  const binary = process.env["IDEMGATE_BIN"];
  if (!binary) {
    throw new Error("set IDEMGATE_BIN to an idemgate binary (cargo build; IDEMGATE_BIN=target/debug/idemgate)");
  }
  const dir = mkdtempSync(join(tmpdir(), "idemgate-ts-"));
  const port = await freePort();
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    DATABASE_URL: `sqlite://${join(dir, "keys.db")}`,
    IDEMGATE_LISTEN: `127.0.0.1:${port}`,
    IDEMGATE_TOKENS: `acme:${TOKEN},globex:${OTHER_TOKEN}`,
    IDEMGATE_PRUNE_INTERVAL: "0",
    RUST_LOG: "warn",
  };
  delete env["IDEMGATE_CONFIG"];
  let log = "";
  const child: ChildProcess = spawn(binary, ["serve"], { env, stdio: ["ignore", "pipe", "pipe"] });
  child.stdout?.on("data", (d: Buffer) => (log += d.toString()));
  child.stderr?.on("data", (d: Buffer) => (log += d.toString()));
  const baseUrl = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 30_000;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`idemgate serve exited: ${log}`);
    try {
      if ((await fetch(`${baseUrl}/healthz`)).ok) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      child.kill("SIGKILL");
      throw new Error(`idemgate serve did not answer within 30 s: ${log}`);
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  return {
    baseUrl,
    stop: async () => {
      const exited = new Promise((r) => child.once("exit", r));
      child.kill("SIGTERM");
      await exited;
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
