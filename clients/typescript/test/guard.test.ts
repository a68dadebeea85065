// guard against a real idemgate: at most one execution per key.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import {
  Client, InFlight, KeyReused, NotExecuted, OutcomeUnknown, classifyFailure, derive_key, guard,
  type Failure, type Holding, type Reconciliation,
} from "../src/index.js";
import {
  TOKEN, adminView, closedPort, postgresWanted, settle, startOrigin, startServer, type Origin, type Server, type Store,
} from "./server.js";

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

  test("the guard's label is kept with the key for the operator, and is no part of the fingerprint", async () => {
    const { state, effect } = charges();
    const key = freshKey();
    await guard(idem, key, effect, { request: CHARGE, label: "order 1042" });
    const view = await adminView(server.baseUrl, key);
    assert.equal(view["label"], "order 1042");
    assert.deepEqual(view["request"], { method: CHARGE.method, path: CHARGE.path });
    // Another label on a retry is the same call: replayed, not KeyReused.
    assert.deepEqual(await guard(idem, key, effect, { request: CHARGE, label: "order 1042 (retry)" }), { charge: "ch_1", attempt: 1 });
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

  test("NotExecuted releases the key; another failure makes it unknown at once", async () => {
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
      }, { request: CHARGE, leaseSeconds: 30 }),
      /hung up/,
    );
    const after = charges();
    const started = Date.now();
    // Not in flight for 30 s: unknown, for an operator.
    await assert.rejects(guard(idem, kept, after.effect, { request: CHARGE, waitBudgetMs: 10_000 }), OutcomeUnknown);
    assert.ok(Date.now() - started < 2000);
    assert.equal(after.state.runs, 0);
  });

  describe("an effect's failure, over real HTTP", () => {
    let origin: Origin;
    before(async () => {
      origin = await startOrigin();
    });
    after(async () => origin.close());

    /** One charge at a payments API, over real HTTP. */
    const pay = async (url: string, key: string, path = "/charges", timeoutMs = 5000) => {
      const answer = await fetch(`${url}${path}`, {
        method: "POST",
        headers: { "content-type": "application/json", "idempotency-key": key },
        body: JSON.stringify({ amount: 500 }),
        signal: AbortSignal.timeout(timeoutMs),
      });
      if (!answer.ok) throw new Error(`the payments API answered ${answer.status}`);
      return (await answer.json()) as Record<string, unknown>;
    };

    test("a timeout after the origin acted makes the key unknown at once", async () => {
      const key = freshKey();
      const options = { request: CHARGE, leaseSeconds: 30, waitBudgetMs: 30_000 };
      // The origin charges at once and answers 3 s later; the effect gives up after 0.5 s.
      await assert.rejects(guard(idem, key, () => pay(origin.url, key, "/stall/3000", 500), options), (e: unknown) => {
        assert.ok(e instanceof DOMException); // the effect's own error
        assert.equal(e.name, "TimeoutError");
        return true;
      });
      const other = charges();
      const started = Date.now();
      await assert.rejects(guard(idem, key, other.effect, options), (e: unknown) => {
        assert.ok(e instanceof OutcomeUnknown); // not InFlight after a 30 s wait
        assert.equal(e.retryAfter, undefined);
        assert.equal(e.deadLetterReason, "outcome_unknown");
        return true;
      });
      assert.ok(Date.now() - started < 2000);
      await assert.rejects(idem.reserve(key, { request: CHARGE, wait: 5 }), (e: unknown) => e instanceof OutcomeUnknown && e.retryAfter === undefined);
      const view = await adminView(server.baseUrl, key);
      assert.equal(view["state"], "unknown");
      // The reason names the error's type, never its message.
      assert.equal((view["marked_unknown"] as { reason: string }).reason, "the guarded effect threw DOMException: it may have acted");
      assert.equal(origin.charges.get(key), 1);
      assert.equal(other.state.runs, 0);
    });

    test("a refused connection releases the key and the retry runs", async () => {
      const key = freshKey();
      const nobody = `http://127.0.0.1:${await closedPort()}`;
      await assert.rejects(guard(idem, key, () => pay(nobody, key), { request: CHARGE }), (e: unknown) => {
        assert.ok(e instanceof TypeError); // fetch failed, its cause ECONNREFUSED: never sent
        assert.equal((e.cause as { code?: string }).code, "ECONNREFUSED");
        return true;
      });
      const first = await guard(idem, key, () => pay(origin.url, key), { request: CHARGE });
      assert.deepEqual(await guard(idem, key, () => pay(origin.url, key), { request: CHARGE }), first);
      assert.equal(origin.charges.get(key), 1);
    });

    test("a custom classifier is honoured", async () => {
      class CardDeclined extends Error {}
      const lenient = (e: unknown): Failure => (e instanceof CardDeclined ? "release" : classifyFailure(e));
      const key = freshKey();
      await assert.rejects(guard(idem, key, async () => {
        throw new CardDeclined("card_declined");
      }, { request: CHARGE, classifyFailure: lenient }), CardDeclined);
      await guard(idem, key, () => pay(origin.url, key), { request: CHARGE, classifyFailure: lenient });
      assert.equal(origin.charges.get(key), 1);

      // Stricter than the default: even a refused connection is unknown;
      // NotExecuted, the effect's own word, still releases.
      const strict = { request: CHARGE, classifyFailure: (): Failure => "unknown" };
      const refused = freshKey();
      const nobody = `http://127.0.0.1:${await closedPort()}`;
      await assert.rejects(guard(idem, refused, () => pay(nobody, refused), strict), TypeError);
      await assert.rejects(guard(idem, refused, () => pay(origin.url, refused), strict), OutcomeUnknown);
      const said = freshKey();
      await assert.rejects(guard(idem, said, async () => {
        throw new NotExecuted("validation failed");
      }, strict), NotExecuted);
      const { state, effect } = charges();
      assert.deepEqual(await guard(idem, said, effect, strict), { charge: "ch_1", attempt: 1 });

      // A classifier that throws is taken as unknown; the caller still gets the effect's error.
      const odd = freshKey();
      const declined = new CardDeclined("card_declined");
      await assert.rejects(guard(idem, odd, async () => {
        throw declined;
      }, { request: CHARGE, classifyFailure: () => { throw new Error("a bug in the classifier"); } }), (e: unknown) => e === declined);
      await assert.rejects(guard(idem, odd, effect, { request: CHARGE }), OutcomeUnknown);
      assert.equal(state.runs, 1);
      assert.equal(origin.charges.get(refused), undefined);
    });
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
    await assert.rejects(guard(idem, key, charge, { request: CHARGE, leaseSeconds: 30 }), /hung up after charging/);
    // Under hold the key is marked unknown at once: no waiting out the lease.
    for (const _ of [1, 2]) {
      await assert.rejects(guard(idem, key, charge, { request: CHARGE, leaseSeconds: 30 }), (e: unknown) => {
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

test("when the mark fails, the caller gets the effect's error", async () => {
  const own = await startServer("sqlite");
  const lost = new Error("the provider did not answer");
  let stopped = false;
  try {
    const client = new Client(own.baseUrl, { token: TOKEN, timeoutMs: 5000 });
    await assert.rejects(guard(client, freshKey(), async () => {
      await own.stop(); // the store goes away while the effect runs
      stopped = true;
      throw lost;
    }, { request: CHARGE, leaseSeconds: 30 }), (e: unknown) => e === lost);
  } finally {
    if (!stopped) await own.stop();
  }
});

test("the default classifier releases only what proves nothing was sent", () => {
  const fetchFailed = (cause: unknown) => new TypeError("fetch failed", { cause });
  const coded = (code: string) => Object.assign(new Error(`connect ${code}`), { code });
  const released = [
    new NotExecuted("declined"),
    fetchFailed(coded("ECONNREFUSED")),
    fetchFailed(coded("ENOTFOUND")),
    fetchFailed(coded("EAI_AGAIN")),
    fetchFailed(coded("UND_ERR_CONNECT_TIMEOUT")),
    fetchFailed(new AggregateError([coded("ECONNREFUSED"), coded("ECONNREFUSED")])), // every address refused
    coded("ECONNREFUSED"), // node:http, node:net
  ];
  const unknown = [
    fetchFailed(coded("ECONNRESET")),
    fetchFailed(coded("UND_ERR_SOCKET")),
    fetchFailed(coded("UND_ERR_HEADERS_TIMEOUT")),
    fetchFailed(new AggregateError([coded("ECONNREFUSED"), coded("ECONNRESET")])),
    fetchFailed(undefined),
    new DOMException("The operation was aborted due to timeout", "TimeoutError"),
    new Error("the answer could not be parsed", { cause: coded("ECONNREFUSED") }), // not a fetch error
    "a thrown string",
    undefined,
  ];
  assert.deepEqual(released.map(classifyFailure), released.map(() => "release"));
  assert.deepEqual(unknown.map(classifyFailure), unknown.map(() => "unknown"));
});
