// The guard's commit outlives a server that goes away right after the effect
// acted: a real `idemgate serve`, killed (SIGKILL) inside the effect and
// started again on the same store and port 3 s later. The guard resolves to
// the effect's result, the key is completed (nothing in flight or unknown),
// and the next call replays without running the effect. A server that never
// comes back within commitBudgetMs yields ResultNotCommitted (a
// StoreUnavailable) with the result, never a raw fetch error.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { describe, test } from "node:test";

import { Client, ResultNotCommitted, StoreUnavailable, derive_key, guard } from "../src/index.js";
import { ADMIN_TOKEN, TOKEN, adminView, closedPort, postgresWanted, startKillableServer, type KillableServer, type Store } from "./server.js";

const CHARGE = { method: "POST", path: "/charges", body: { amount: 500 } };
const RESULT = { charge: "ch_1", amount: 500 };
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const freshKey = () => derive_key({ tenant: "acme", run: `run-${randomUUID()}`, step: 1, tool: "charge" });
const stores: Store[] = postgresWanted() ? ["sqlite", "postgres"] : ["sqlite"];

/** The keys the operators' list shows in flight or unknown. */
async function stuckKeys(baseUrl: string): Promise<unknown[]> {
  const found: unknown[] = [];
  for (const state of ["in_flight", "unknown"]) {
    const answer = await fetch(`${baseUrl}/v1/admin/keys?state=${state}`, { headers: { authorization: `Bearer ${ADMIN_TOKEN}` } });
    assert.equal(answer.status, 200);
    found.push(...((await answer.json()) as { keys: unknown[] }).keys);
  }
  return found;
}

async function assertCompletedAndReplayed(server: KillableServer, idem: Client, key: string, runs: { n: number }): Promise<void> {
  assert.equal((await adminView(server.baseUrl, key))["state"], "completed");
  assert.deepEqual(await stuckKeys(server.baseUrl), []);
  const before = runs.n;
  const replayed = await guard(idem, key, async () => {
    runs.n += 1;
    return { charge: "ch_2", amount: 500 };
  }, { request: CHARGE });
  assert.deepEqual(replayed, RESULT);
  assert.equal(runs.n, before);
}

for (const store of stores) {
  describe(`the guard's commit while idemgate is away (${store})`, () => {
    test("a server killed right after the effect and back 3 s later gets the result", async () => {
      const server = await startKillableServer(store);
      try {
        const idem = new Client(server.baseUrl, { token: TOKEN, timeoutMs: 5000 });
        const key = freshKey(), runs = { n: 0 };
        let killedAt = 0;
        let back: Promise<void> | undefined;
        const result = await guard(idem, key, async () => {
          runs.n += 1;
          await server.kill(); // the charge went out; the server dies before the commit
          killedAt = Date.now();
          back = sleep(3000).then(() => server.startAgain());
          return RESULT;
        }, { request: CHARGE, leaseSeconds: 30 });
        assert.deepEqual(result, RESULT);
        assert.ok(Date.now() - killedAt >= 3000);
        await back;
        assert.equal(runs.n, 1);
        await assertCompletedAndReplayed(server, idem, key, runs);
      } finally {
        await server.stop();
      }
    });

    test("a server that stays away past the budget yields ResultNotCommitted with the result", async () => {
      const server = await startKillableServer(store);
      try {
        const idem = new Client(server.baseUrl, { token: TOKEN, timeoutMs: 5000 });
        const key = freshKey(), runs = { n: 0 };
        const started = Date.now();
        const error = await guard(idem, key, async () => {
          runs.n += 1;
          await server.kill();
          return RESULT;
        }, { request: CHARGE, leaseSeconds: 30, commitBudgetMs: 2000 }).then(
          () => assert.fail("the commit cannot have succeeded"),
          (e: unknown) => e,
        );
        assert.ok(error instanceof ResultNotCommitted && error instanceof StoreUnavailable, String(error));
        assert.ok(Date.now() - started >= 2000 && error.waitedMs >= 2000);
        assert.deepEqual(error.result, RESULT);
        assert.equal(error.answered, false);
        assert.equal(error.deadLetterReason, "result_not_committed");
        assert.ok(error.cause instanceof StoreUnavailable);
        assert.ok(error.cause.cause instanceof Error); // fetch's own error, kept underneath
        // Back after the budget, within the lease: the holder's late commit of the result it kept.
        await server.startAgain();
        assert.notDeepEqual(await stuckKeys(server.baseUrl), []);
        await idem.commit(error.reservationId, { status: 200, body: error.encodedResult });
        await assertCompletedAndReplayed(server, idem, key, runs);
      } finally {
        await server.stop();
      }
    });
  });
}

test("every call that gets no answer rejects with StoreUnavailable, the fetch error its cause", async () => {
  const idem = new Client(`http://127.0.0.1:${await closedPort()}`, { token: TOKEN, timeoutMs: 2000 });
  const id = randomUUID();
  const calls: Array<() => Promise<unknown>> = [
    () => idem.reserve(freshKey(), { request: CHARGE }),
    () => idem.commit(id, { status: 200, body: "{}" }),
    () => idem.release(id),
    () => idem.extend(id),
    () => idem.markUnknown(id, "timed out"),
    () => idem.checkpoint(id, "sent"),
    () => idem.get(id),
    () => guard(idem, freshKey(), async () => RESULT, { request: CHARGE }),
  ];
  for (const call of calls) {
    await assert.rejects(call(), (e: unknown) => {
      assert.ok(e instanceof StoreUnavailable, String(e));
      assert.equal(e.answered, false);
      assert.ok(e.cause instanceof TypeError); // fetch failed
      return true;
    });
  }
});
