// A process killed in the middle of its effect, and the takeover after it.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { fileURLToPath } from "node:url";
import { after, before, describe, test } from "node:test";

import { Client, OutcomeUnknown, derive_key, guard, type Holding } from "../src/index.js";
import { TOKEN, postgresWanted, startServer, type Server, type Store } from "./server.js";

const stores: Store[] = postgresWanted() ? ["sqlite", "postgres"] : ["sqlite"];
const AGENT = fileURLToPath(new URL("./agent.js", import.meta.url));
const request = { method: "POST", path: "/charges", body: { amount: 500 } };

/** Runs the agent until its charge went out and kills it: the kill's time. */
async function killAfterActing(baseUrl: string, key: string, mode: "takeover" | "reconcile" | "default"): Promise<number> {
  const agent = spawn(process.execPath, [AGENT, baseUrl, TOKEN, key, mode], { stdio: ["ignore", "pipe", "inherit"] });
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
  return Date.now();
}

for (const store of stores) describe(store, () => {
  let server: Server;
  before(async () => {
    server = await startServer(store);
  });
  after(async () => server.stop());

  test("a killed holder is taken over with its recovery point", async () => {
    const key = derive_key({ tenant: "acme", run: `run-${randomUUID()}`, step: 1, tool: "charge" });
    const killed = await killAfterActing(server.baseUrl, key, "takeover");

    const idem = new Client(server.baseUrl, { token: TOKEN });
    const seen: Holding[] = [];
    const reconcile = async (holding: Holding) => {
      seen.push(holding);
      assert.equal(holding.recovery?.recoveryPoint, "charge-sent");
      const data = holding.recovery?.data as { charge: string };
      return { charge: data.charge, reconciled: true };
    };
    // The effect reconciles by itself: takeover is the caller's own choice.
    const result = await guard(idem, key, reconcile, { request, waitBudgetMs: 15_000, onLeaseExpiry: "takeover" });
    const again = await guard(idem, key, reconcile, { request, onLeaseExpiry: "takeover" });
    assert.deepEqual(result, { charge: "ch_42", reconciled: true });
    assert.deepEqual(again, result);
    assert.equal(seen.length, 1);
    assert.equal(seen[0]?.attempt, 2);
    assert.ok(Date.now() - killed < 8_000);
  });

  test("a killed holder is reconciled from its recovery point", async () => {
    const key = derive_key({ tenant: "acme", run: `run-${randomUUID()}`, step: 1, tool: "charge" });
    await killAfterActing(server.baseUrl, key, "reconcile");
    const idem = new Client(server.baseUrl, { token: TOKEN });
    let runs = 0;
    const charge = async () => {
      runs += 1;
      return { charge: "ch_again" } as Record<string, unknown>;
    };
    const seen: Holding[] = [];
    const reconcile = async (holding: Holding) => {
      seen.push(holding);
      if (holding.recovery?.recoveryPoint !== "charge-sent") return { found: false } as const;
      const data = holding.recovery.data as { charge: string };
      return { found: true, result: { charge: data.charge, reconciled: true } as Record<string, unknown> } as const;
    };
    const result = await guard(idem, key, charge, { request, waitBudgetMs: 15_000, reconcile });
    const again = await guard(idem, key, charge, { request, reconcile });
    assert.deepEqual(result, { charge: "ch_42", reconciled: true });
    assert.deepEqual(again, result);
    assert.equal(runs, 0);
    assert.equal(seen.length, 1);
    assert.equal(seen[0]?.attempt, 2);
  });

  test("a killed holder under the default is never run again", async () => {
    const key = derive_key({ tenant: "acme", run: `run-${randomUUID()}`, step: 1, tool: "charge" });
    await killAfterActing(server.baseUrl, key, "default");
    const idem = new Client(server.baseUrl, { token: TOKEN });
    let runs = 0;
    const charge = async () => {
      runs += 1;
      return { charge: "ch_again" };
    };
    // Within the lease: in flight, waited for; past it: unknown, not run.
    await assert.rejects(guard(idem, key, charge, { request, waitBudgetMs: 15_000 }), OutcomeUnknown);
    await assert.rejects(guard(idem, key, charge, { request, reconcile: () => ({ found: false }) }), OutcomeUnknown);
    assert.equal(runs, 0);
  });
});
