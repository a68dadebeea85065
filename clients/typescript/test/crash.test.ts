// A process killed in the middle of its effect, and the takeover after it.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { fileURLToPath } from "node:url";
import { after, before, describe, test } from "node:test";

import { Client, derive_key, guard, type Holding } from "../src/index.js";
import { TOKEN, postgresWanted, startServer, type Server, type Store } from "./server.js";

const stores: Store[] = postgresWanted() ? ["sqlite", "postgres"] : ["sqlite"];
const AGENT = fileURLToPath(new URL("./agent.js", import.meta.url));

for (const store of stores) describe(store, () => {
  let server: Server;
  before(async () => {
    server = await startServer(store);
  });
  after(async () => server.stop());

  test("a killed holder is taken over with its recovery point", async () => {
    const key = derive_key({ tenant: "acme", run: `run-${randomUUID()}`, step: 1, tool: "charge" });
    const agent = spawn(process.execPath, [AGENT, server.baseUrl, TOKEN, key], { stdio: ["ignore", "pipe", "inherit"] });
    await new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error("the agent did not act within 20 s")), 20_000);
      agent.stdout?.on("data", (d: Buffer) => {
        if (d.toString().includes("acted")) {
          clearTimeout(timer);
          resolve();
        }
      });
      agent.once("exit", () => reject(new Error("the agent exited before acting")));
    });
    const exited = new Promise((r) => agent.once("exit", r));
    agent.kill("SIGKILL");
    await exited;
    const killed = Date.now();

    const idem = new Client(server.baseUrl, { token: TOKEN });
    const seen: Holding[] = [];
    const reconcile = async (holding: Holding) => {
      seen.push(holding);
      assert.equal(holding.recovery?.recoveryPoint, "charge-sent");
      const data = holding.recovery?.data as { charge: string };
      return { charge: data.charge, reconciled: true };
    };
    const request = { method: "POST", path: "/charges", body: { amount: 500 } };
    const result = await guard(idem, key, reconcile, { request, waitBudgetMs: 15_000 });
    const again = await guard(idem, key, reconcile, { request });
    assert.deepEqual(result, { charge: "ch_42", reconciled: true });
    assert.deepEqual(again, result);
    assert.equal(seen.length, 1);
    assert.equal(seen[0]?.attempt, 2);
    assert.ok(Date.now() - killed < 8_000);
  });
});
