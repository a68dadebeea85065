// guard against a real idemgate: at most one execution per key.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import {
  Client, InFlight, KeyReused, NotExecuted, OutcomeUnknown, derive_key, guard, type Holding, type Reconciliation,
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

/**
 * A payments API and an effect that charges through it, counting: the
 * effect's runs, the charges it made (per key), and a crash either before or
 * after the charge on the effect's first run.
 */
class Payments {
  runs = 0;
  readonly charges = new Map<string, string>();
  constructor(readonly crash: "before" | "after") {}

  async charge(key: string, holding: Holding) {
    this.runs += 1;
    await holding.checkpoint("validated", { amount: 500 });
    if (this.crash === "before" && this.runs === 1) throw new Error("the worker crashed before the charge went out");
    const charge = `ch_${this.charges.size + 1}`;
    this.charges.set(key, charge);
    await holding.checkpoint("charge-sent", { charge });
    if (this.crash === "after" && this.runs === 1) throw new Error("the payment API hung up after charging");
    return { charge, attempt: holding.attempt } as Record<string, unknown>;
  }

  /** What a reconcile asks the payments API: the key's charge, if any. */
  find(key: string): Reconciliation<Record<string, unknown>> {
    const charge = this.charges.get(key);
    return charge === undefined ? { found: false } : { found: true, result: { charge, found: true } };
  }
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
    // Whoever retries, whatever it would choose.
    for (const options of [held, { request: CHARGE }, { request: CHARGE, onLeaseExpiry: "takeover" } as const]) {
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
    await sleep(2000); // two leases of 1 s: without the heartbeat, the lease would have ended
    const other = charges();
    await assert.rejects(guard(idem, key, other.effect, { request: CHARGE, waitBudgetMs: 500, leaseSeconds: 1 }), InFlight);
    await holder;
    assert.equal(other.state.runs, 0);
    assert.equal(slow.state.runs, 1);
  });

  test("a takeover hands the attempt and the recovery point", async () => {
    const key = freshKey();
    // A holder that recorded its progress, then died: its lease ends (under
    // the reservation API's default, takeover).
    const dead = await idem.reserve(key, { request: CHARGE, leaseSeconds: 1 });
    if (dead.kind !== "reserved") throw new Error("not reserved");
    await idem.checkpoint(dead.reservationId, "charge-sent", { charge: "ch_7" });
    await sleep(1300);
    const seen: Holding[] = [];
    // A guard that takes over without a reconcile: its effect reconciles by
    // itself (the caller's promise).
    const result = await guard(idem, key, async (holding) => {
      seen.push(holding);
      const data = holding.recovery?.data as { charge: string };
      return { charge: data.charge, reconciled: true };
    }, { request: CHARGE, onLeaseExpiry: "takeover" });
    assert.deepEqual(result, { charge: "ch_7", reconciled: true });
    assert.equal(seen[0]?.attempt, 2);
    assert.equal(seen[0]?.recovery?.recoveryPoint, "charge-sent");
  });

  test("by default an effect that threw after acting is never run again", async () => {
    const payments = new Payments("after");
    const key = freshKey();
    const charge = (h: Holding) => payments.charge(key, h);
    await assert.rejects(guard(idem, key, charge, { request: CHARGE, leaseSeconds: 1 }), /hung up after charging/);
    await sleep(1500); // the lease ends: under hold, the outcome is unknown
    for (const _ of [1, 2]) {
      await assert.rejects(guard(idem, key, charge, { request: CHARGE, leaseSeconds: 1 }), (e: unknown) => {
        assert.ok(e instanceof OutcomeUnknown);
        assert.equal(e.deadLetterReason, "outcome_unknown");
        return true;
      });
    }
    assert.equal(payments.runs, 1);
    assert.equal(payments.charges.size, 1);
  });

  test("a default guard does not run a takeover it cannot reconcile", async () => {
    const key = freshKey();
    // An earlier holder that chose takeover (the reservation API's default) dies.
    await idem.reserve(key, { request: CHARGE, leaseSeconds: 1 });
    await sleep(1300);
    const { state, effect } = charges();
    await assert.rejects(guard(idem, key, effect, { request: CHARGE, leaseSeconds: 1 }), OutcomeUnknown);
    await sleep(1300); // the refusing guard's own lease (under hold) ends: unknown
    await assert.rejects(
      guard(idem, key, effect, { request: CHARGE, reconcile: () => ({ found: false }) }),
      (e: unknown) => e instanceof OutcomeUnknown && e.retryAfter === undefined,
    );
    assert.equal(state.runs, 0);
  });

  test("a reconcile that finds the effect resolves to its result without running it", async () => {
    const payments = new Payments("after");
    const key = freshKey();
    const charge = (h: Holding) => payments.charge(key, h);
    const seen: Holding[] = [];
    const reconcile = async (holding: Holding) => {
      seen.push(holding);
      return payments.find(key);
    };
    const options = { request: CHARGE, leaseSeconds: 1, reconcile };
    await assert.rejects(guard(idem, key, charge, options), /hung up after charging/);
    await sleep(1500); // the lease ends: under takeover, the next call reconciles
    const found = { charge: "ch_1", found: true };
    assert.deepEqual(await guard(idem, key, charge, options), found);
    // The key is completed with the reconciled result: every call replays it.
    assert.deepEqual(await guard(idem, key, charge, options), found);
    assert.deepEqual(await guard(idem, key, charge, { request: CHARGE }), found);
    assert.equal(payments.runs, 1);
    assert.deepEqual([...payments.charges], [[key, "ch_1"]]);
    assert.equal(seen.length, 1);
    assert.equal(seen[0]?.attempt, 2);
    assert.equal(seen[0]?.recovery?.recoveryPoint, "charge-sent");
  });

  test("a reconcile that finds nothing runs the effect on the takeover", async () => {
    const payments = new Payments("before");
    const key = freshKey();
    const charge = (h: Holding) => payments.charge(key, h);
    const seen: Holding[] = [];
    const reconcile = (holding: Holding) => {
      seen.push(holding);
      return payments.find(key);
    };
    const options = { request: CHARGE, leaseSeconds: 1, reconcile };
    // A crash, not NotExecuted: the key stays held.
    await assert.rejects(guard(idem, key, charge, options), /crashed before the charge/);
    await sleep(1500);
    const ran = { charge: "ch_1", attempt: 2 };
    assert.deepEqual(await guard(idem, key, charge, options), ran);
    assert.deepEqual(await guard(idem, key, charge, options), ran);
    // Two runs of the effect, because the first never charged: one charge.
    assert.equal(payments.runs, 2);
    assert.deepEqual([...payments.charges], [[key, "ch_1"]]);
    assert.equal(seen.length, 1);
    assert.equal(seen[0]?.attempt, 2);
    assert.equal(seen[0]?.recovery?.recoveryPoint, "validated");
    assert.deepEqual(seen[0]?.recovery?.data, { amount: 500 });
  });
});
