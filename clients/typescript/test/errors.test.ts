// Every error the package exports keeps its class and fields across a
// process or thread boundary, as far as the platform allows: exactly through
// toJSON() (JSON, or a structuredClone of that object) and reviveError; a
// structuredClone of the error itself is a plain Error in V8 (only message,
// stack and cause survive), from which reviveError recovers the class and a
// problem's status, slug and detail.
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import * as idemgate from "../src/index.js";
import { InFlight, Problem, ResultNotCommitted, StoreUnavailable, reviveError } from "../src/index.js";

type AnyClass = new (...args: never[]) => Error;

/** Every Error class the package exports (discovered: a new one is covered by itself). */
const CLASSES: AnyClass[] = (Object.values(idemgate) as unknown[]).filter(
  (value): value is AnyClass => typeof value === "function" && (value as { prototype?: unknown }).prototype instanceof Error,
);

const LEASE = new Date("2026-12-07T10:15:30.000Z");

function problemBody(slug: string): Record<string, unknown> {
  return {
    type: `https://idemgate.dev/problems/${slug}`, title: "A title", detail: `what the server said about ${slug}`,
    status: 409, lease_expires_at: LEASE.toISOString(), retry_after_seconds: 2,
  };
}

function build(cls: AnyClass): Error {
  if (cls === (InFlight as unknown as AnyClass)) return new InFlight("order-42", 30_400, LEASE);
  if (cls === (ResultNotCommitted as unknown as AnyClass)) {
    return ResultNotCommitted.of("0190f3c2-7c1e-7a3b-9d2e-5f6a7b8c9d0e", { charge: "ch_1", amount: 500 },
      '{"charge":"ch_1","amount":500}', 31_200, StoreUnavailable.unreachable("POST", "/v1/reservations/x/commit", new TypeError("fetch failed")));
  }
  if (cls.prototype instanceof Problem || cls === (Problem as unknown as AnyClass)) {
    const problem = cls as unknown as typeof Problem;
    return new problem(409, problemBody(problem.slug || "some-problem"), 2);
  }
  return new (cls as unknown as new (message: string) => Error)("what went wrong");
}

/** Own enumerable fields, and the getters a caller reads, of an error. */
function fields(error: Error): Record<string, unknown> {
  const out: Record<string, unknown> = { ...error, name: error.name, message: error.message };
  for (const getter of ["deadLetterReason", "leaseExpiresAt", "answered"]) {
    if (getter in error) out[getter] = (error as unknown as Record<string, unknown>)[getter];
  }
  return out;
}

describe("errors across a boundary", () => {
  test("the classes are discovered", () => {
    const names = CLASSES.map((cls) => cls.name);
    for (const name of ["IdemgateError", "Problem", "OutcomeUnknown", "StoreUnavailable", "ResultNotCommitted", "InFlight", "NotExecuted"]) {
      assert.ok(names.includes(name), name);
    }
    assert.ok(CLASSES.length >= 20, String(CLASSES.length));
  });

  for (const cls of CLASSES) {
    test(`${cls.name}: toJSON and reviveError keep its class and every field (JSON, structuredClone of it)`, () => {
      const original = build(cls);
      assert.equal(original.name, cls.name);
      for (const carried of [JSON.parse(JSON.stringify(original)) as unknown, structuredClone((original as unknown as { toJSON(): unknown }).toJSON())]) {
        const back = reviveError(carried);
        assert.ok(back instanceof cls, `${cls.name} came back as ${back?.constructor.name}`);
        assert.equal(back.constructor, cls);
        assert.equal(String(back), String(original));
        assert.deepEqual(fields(back), fields(original));
      }
    });

    test(`${cls.name}: a structuredClone of the error itself is a plain Error, revived as far as it goes`, () => {
      const original = build(cls);
      const clone = structuredClone(original);
      // What the platform does (V8): the class and the fields are gone.
      assert.equal(Object.getPrototypeOf(clone), Error.prototype);
      assert.equal(clone.message, original.message);
      const back = reviveError(clone);
      assert.ok(back instanceof cls, `${cls.name} came back as ${back?.constructor.name}`);
      assert.equal(back.message, original.message);
      if (original instanceof Problem) {
        const problem = back as Problem;
        assert.equal(problem.status, original.status);
        assert.equal(problem.detail, original.detail);
        assert.equal(problem.type.split("/").pop(), original.type.split("/").pop());
      }
    });
  }

  test("what matters for a dead letter comes back", () => {
    const unsaved = reviveError(JSON.parse(JSON.stringify(build(ResultNotCommitted as unknown as AnyClass))));
    assert.ok(unsaved instanceof ResultNotCommitted && unsaved instanceof StoreUnavailable);
    assert.deepEqual(unsaved.result, { charge: "ch_1", amount: 500 });
    assert.equal(unsaved.deadLetterReason, "result_not_committed");
    assert.equal(unsaved.answered, false);
    const held = reviveError(JSON.parse(JSON.stringify(build(InFlight as unknown as AnyClass))));
    assert.ok(held instanceof InFlight);
    assert.deepEqual(held.leaseExpiresAt, LEASE);
    assert.equal(held.deadLetterReason, "idempotency_in_flight");
    assert.equal(reviveError({ name: "SomethingElse", message: "x" }), undefined);
  });
});
