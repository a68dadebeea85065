// guard against a real idemgate: at most one execution per key.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import {
  Client, InFlight, KeyReused, NotExecuted, OutcomeUnknown, derive_key, guard, type Holding,
} from "../src/index.js";
import { TOKEN, postgresWanted, settle, startServer, type Server, type Store } from "./server.js";

const CHARGE = { method: "POST", path: "/charges", body: { amount: 500 } };
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

const freshKey = () => derive_key({ tenant: "acme", run: `run-${randomUUID()}`, step: 1, tool: "charge" });

/** A side effect that counts its executions. */
function charges(ms = 0) {
  const state = { runs: 0 };
  const effect = async (holding: Holding) => {
    state.runs += 1;
    const n = state.runs;
    await sleep(ms);
    return { charge: `ch_${n}`, attempt: holding.attempt };
  };
  return { state, effect };
}

const stores: Store[] = postgresWanted() ? ["sqlite", "postgres"] : ["sqlite"];

for (const store of stores) describe(store, () => {
  let server: Server;
  let idem: Client;

  before(async () => {
    server = await startServer(store);
    idem = new Client(server.baseUrl, { token: TOKEN });
  });
  after(async () => server.stop());

  test("a retry resolves to the stored result without running", async () => {
    const { state, effect } = charges();
    const key = freshKey();
    assert.deepEqual(await guard(idem, key, effect, { request: CHARGE }), { charge: "ch_1", attempt: 1 });
    assert.deepEqual(await guard(idem, key, effect, { request: CHARGE }), { charge: "ch_1", attempt: 1 });
    assert.equal(state.runs, 1);
  });

  test("four callers at once run it once and all get its result", async () => {
    const { state, effect } = charges(1000);
    const key = freshKey();
    const results = await Promise.all(
      [1, 2, 3, 4].map(() => guard(new Client(server.baseUrl, { token: TOKEN }), key, effect, { request: CHARGE })),
    );
    assert.equal(state.runs, 1);
    for (const r of results) assert.deepEqual(r, { charge: "ch_1", attempt: 1 });
  });

  test("a key held past the budget is InFlight, not run", async () => {
    const slow = charges(3000);
    const key = freshKey();
    const holder = guard(idem, key, slow.effect, { request: CHARGE });
    await sleep(300);
    const other = charges();
    const started = Date.now();
    await assert.rejects(guard(idem, key, other.effect, { request: CHARGE, waitBudgetMs: 1000 }), (e: unknown) => {
      assert.ok(e instanceof InFlight);
      assert.equal(e.deadLetterReason, "idempotency_in_flight");
      return true;
    });
    assert.ok(Date.now() - started < 2500);
    await holder;
    assert.equal(other.state.runs, 0);
    assert.equal(slow.state.runs, 1);
  });

  test("another payload is KeyReused and never run", async () => {
    const { state, effect } = charges();
    const key = freshKey();
    await guard(idem, key, effect, { request: CHARGE });
    await assert.rejects(guard(idem, key, effect, { request: { ...CHARGE, body: { amount: 900 } } }), KeyReused);
    assert.equal(state.runs, 1);
  });

  test("NotExecuted releases the key; another failure keeps it", async () => {
    const key = freshKey();
    await assert.rejects(
      guard(idem, key, async () => {
        throw new NotExecuted("declined before anything was charged");
      }, { request: CHARGE }),
      NotExecuted,
    );
    const { state, effect } = charges();
    assert.deepEqual(await guard(idem, key, effect, { request: CHARGE }), { charge: "ch_1", attempt: 1 });
    assert.equal(state.runs, 1);

    const kept = freshKey();
    await assert.rejects(
      guard(idem, kept, async () => {
        throw new Error("the payment API hung up after the request was sent");
      }, { request: CHARGE }),
      /hung up/,
    );
    const after = charges();
    await assert.rejects(guard(idem, kept, after.effect, { request: CHARGE, waitBudgetMs: 500 }), InFlight);
    assert.equal(after.state.runs, 0);
  });

  test("an unknown outcome is not run and goes to the dead-letter queue; an operator settles it", async () => {
    // A guard for an effect that cannot reconcile: its lease ending means unknown.
    const held = { request: CHARGE, leaseSeconds: 1, onLeaseExpiry: "hold" } as const;
    const key = freshKey();
    await assert.rejects(
      guard(idem, key, async () => {
        throw new Error("the payment API hung up after the request was sent");
      }, held),
      /hung up/,
    );
    await sleep(1500); // the lease ends: nobody knows whether the charge went out
    const { state, effect } = charges();
    for (const options of [held, { request: CHARGE }]) { // whoever retries, whatever it would choose
      await assert.rejects(guard(idem, key, effect, options), (e: unknown) => {
        assert.ok(e instanceof OutcomeUnknown);
        assert.equal(e.deadLetterReason, "outcome_unknown");
        assert.equal(e.retryAfter, undefined);
        return true;
      });
    }
    assert.equal(state.runs, 0);

    // An operator finds that the charge went through and completes the key
    // with it: every call resolves to that result, and the effect never runs.
    const view = await settle(server.baseUrl, key, {
      action: "complete",
      reason: "the payment API shows the charge",
      response: { status: 200, headers: [], body: JSON.stringify({ charge: "ch_found", attempt: 1 }) },
    });
    assert.equal(view["state"], "completed");
    assert.deepEqual(await guard(idem, key, effect, held), { charge: "ch_found", attempt: 1 });
    assert.deepEqual(await guard(idem, key, effect, { request: CHARGE }), { charge: "ch_found", attempt: 1 });
    assert.equal(state.runs, 0);

    // Another holder cut off under hold; the operator finds nothing happened
    // and releases the key: the next call runs the effect, once.
    const released = freshKey();
    await idem.reserve(released, { request: CHARGE, leaseSeconds: 1, onLeaseExpiry: "hold" });
    await sleep(1500);
    await assert.rejects(guard(idem, released, effect, { request: CHARGE }), OutcomeUnknown);
    await settle(server.baseUrl, released, { action: "release", reason: "the payment API has no such charge" });
    assert.deepEqual(await guard(idem, released, effect, { request: CHARGE }), { charge: "ch_1", attempt: 1 });
    assert.deepEqual(await guard(idem, released, effect, { request: CHARGE }), { charge: "ch_1", attempt: 1 });
    assert.equal(state.runs, 1);
  });

  test("the lease is extended while a long effect runs", async () => {
    const slow = charges(3500);
    const key = freshKey();
    const holder = guard(idem, key, slow.effect, { request: CHARGE, leaseSeconds: 1 });
    await sleep(2000); // two leases of 1 s: without the heartbeat, a takeover
    const other = charges();
    await assert.rejects(guard(idem, key, other.effect, { request: CHARGE, waitBudgetMs: 500, leaseSeconds: 1 }), InFlight);
    await holder;
    assert.equal(other.state.runs, 0);
    assert.equal(slow.state.runs, 1);
  });

  test("a takeover hands the attempt and the recovery point", async () => {
    const key = freshKey();
    const dead = await idem.reserve(key, { request: CHARGE, leaseSeconds: 1 });
    if (dead.kind !== "reserved") throw new Error("not reserved");
    await idem.checkpoint(dead.reservationId, "charge-sent", { charge: "ch_7" });
    await sleep(1300);
    const seen: Holding[] = [];
    const result = await guard(idem, key, async (holding) => {
      seen.push(holding);
      const data = holding.recovery?.data as { charge: string };
      return { charge: data.charge, reconciled: true };
    }, { request: CHARGE });
    assert.deepEqual(result, { charge: "ch_7", reconciled: true });
    assert.equal(seen[0]?.attempt, 2);
    assert.equal(seen[0]?.recovery?.recoveryPoint, "charge-sent");
  });
});
