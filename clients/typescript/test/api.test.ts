// The typed reservation calls against a real idemgate.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import {
  Client, InvalidRequest, KeyReused, LeaseLost, NotFound, OutcomeUnknown, RequestInFlight, Unauthorized, derive_key,
} from "../src/index.js";
import { OTHER_TOKEN, TOKEN, postgresWanted, startServer, type Server, type Store } from "./server.js";

const CHARGE = { method: "POST", path: "/charges", body: { amount: 500, currency: "EUR" } };

const freshKey = () => derive_key({ tenant: "acme", run: `run-${randomUUID()}`, step: 1, tool: "charge" });

const stores: Store[] = postgresWanted() ? ["sqlite", "postgres"] : ["sqlite"];

for (const store of stores) describe(store, () => {
  let server: Server;
  let idem: Client;

  before(async () => {
    server = await startServer(store);
    idem = new Client(server.baseUrl, { token: TOKEN });
  });
  after(async () => server.stop());

  test("reserve, a duplicate's 409, commit, the replay", async () => {
    const key = freshKey();
    const first = await idem.reserve(key, { request: CHARGE });
    assert.equal(first.kind, "reserved");
    if (first.kind !== "reserved") return;
    assert.equal(first.attempt, 1);
    await assert.rejects(idem.reserve(key, { request: CHARGE }), (e: unknown) => {
      assert.ok(e instanceof RequestInFlight);
      assert.equal(e.status, 409);
      assert.ok((e.retryAfter ?? 0) >= 1);
      assert.ok(e.leaseExpiresAt instanceof Date);
      return true;
    });
    const done = await idem.commit(first.reservationId, { status: 201, headers: [["content-type", "application/json"]], body: '{"charge":"ch_1"}' });
    assert.equal(done.response.status, 201);
    const again = await idem.reserve(key, { request: { ...CHARGE, body: { currency: "EUR", amount: 500 } } });
    assert.equal(again.kind, "completed");
    if (again.kind !== "completed") return;
    assert.ok(again.replayed);
    assert.deepEqual(JSON.parse(again.response.text()), { charge: "ch_1" });
  });

  test("another payload is KeyReused", async () => {
    const key = freshKey();
    const held = await idem.reserve(key, { request: CHARGE });
    assert.equal(held.kind, "reserved");
    if (held.kind !== "reserved") return;
    await idem.commit(held.reservationId, { status: 201, body: "ok" });
    await assert.rejects(idem.reserve(key, { request: { ...CHARGE, body: { amount: 900 } } }), KeyReused);
  });

  test("release, checkpoint, extend, get", async () => {
    const key = freshKey();
    const first = await idem.reserve(key, { request: CHARGE });
    if (first.kind !== "reserved") throw new Error("not reserved");
    await idem.release(first.reservationId);
    const second = await idem.reserve(key, { request: CHARGE, leaseSeconds: 5 });
    if (second.kind !== "reserved") throw new Error("not reserved after release");
    assert.notEqual(second.reservationId, first.reservationId);
    const record = await idem.checkpoint(second.reservationId, "charged", { charge: "ch_9" });
    assert.deepEqual(record.recovery, { recoveryPoint: "charged", data: { charge: "ch_9" } });
    const extended = await idem.extend(second.reservationId, 60);
    assert.ok(extended.leaseExpiresAt > second.leaseExpiresAt);
    const seen = await idem.get(second.reservationId);
    assert.equal(seen.live, true);
    assert.equal(seen.state, "in_flight");
  });

  test("bytes round trip; Prefer: wait gets the replay", async () => {
    const key = freshKey();
    const held = await idem.reserve(key, { request: CHARGE });
    if (held.kind !== "reserved") throw new Error("not reserved");
    const payload = Uint8Array.from({ length: 256 }, (_, i) => i);
    setTimeout(() => void idem.commit(held.reservationId, { status: 200, body: payload }), 500);
    const answer = await idem.reserve(key, { request: CHARGE, wait: 5 });
    assert.equal(answer.kind, "completed");
    if (answer.kind !== "completed") return;
    assert.deepEqual(answer.response.body, payload);
  });

  test("a held key past its lease is OutcomeUnknown, without Retry-After", async () => {
    const key = freshKey();
    const held = await idem.reserve(key, { request: CHARGE, leaseSeconds: 1, onLeaseExpiry: "hold" });
    if (held.kind !== "reserved") throw new Error("not reserved");
    await new Promise((r) => setTimeout(r, 1500)); // its holder was cut off: the lease ends without news
    for (const wait of [undefined, 5]) { // waiting does not help: nothing will settle it by itself
      const started = Date.now();
      await assert.rejects(idem.reserve(key, { request: CHARGE, ...(wait === undefined ? {} : { wait }) }), (e: unknown) => {
        assert.ok(e instanceof OutcomeUnknown);
        assert.equal(e.status, 409);
        assert.ok(e.type.endsWith("/outcome-unknown"));
        assert.equal(e.retryAfter, undefined);
        assert.equal(e.body["retry_after_seconds"], undefined);
        assert.equal(e.deadLetterReason, "outcome_unknown");
        return true;
      });
      assert.ok(Date.now() - started < 2000);
    }
    assert.equal((await idem.get(held.reservationId)).state, "unknown");
    // The holder's own late commit settles it: every request then replays it.
    await idem.commit(held.reservationId, { status: 201, body: "late" });
    const replay = await idem.reserve(key, { request: CHARGE });
    assert.equal(replay.kind, "completed");
    if (replay.kind !== "completed") return;
    assert.equal(replay.response.text(), "late");
  });

  test("markUnknown holds the key for an operator at once; the late commit settles it", async () => {
    const key = freshKey();
    // Under takeover, the reservation API's default: marked, it is unknown all the same.
    const held = await idem.reserve(key, { request: CHARGE, leaseSeconds: 60 });
    if (held.kind !== "reserved") throw new Error("not reserved");
    const reason = "the provider timed out after the request was sent";
    const record = await idem.markUnknown(held.reservationId, reason);
    assert.equal(record.state, "unknown");
    assert.equal(record.reservationId, held.reservationId);
    assert.equal(record.markedUnknown?.reason, reason);
    assert.ok(record.markedUnknown?.at instanceof Date);
    for (const wait of [undefined, 5]) { // at once, 59 s before the lease ends; waiting does not help
      const started = Date.now();
      await assert.rejects(idem.reserve(key, { request: CHARGE, ...(wait === undefined ? {} : { wait }) }), (e: unknown) => {
        assert.ok(e instanceof OutcomeUnknown);
        assert.equal(e.status, 409);
        assert.ok(e.type.endsWith("/outcome-unknown"));
        assert.equal(e.retryAfter, undefined);
        assert.equal(e.body["retry_after_seconds"], undefined);
        return true;
      });
      assert.ok(Date.now() - started < 2000);
    }
    // Marked again: the record again, the first reason kept.
    assert.equal((await idem.markUnknown(held.reservationId, "another reason")).markedUnknown?.reason, reason);
    await idem.commit(held.reservationId, { status: 201, body: "late but real" });
    const replay = await idem.reserve(key, { request: CHARGE });
    assert.equal(replay.kind, "completed");
    if (replay.kind !== "completed") return;
    assert.equal(replay.response.text(), "late but real");
  });

  test("markUnknown wants a reason and a live reservation", async () => {
    const held = await idem.reserve(freshKey(), { request: CHARGE });
    if (held.kind !== "reserved") throw new Error("not reserved");
    await assert.rejects(idem.markUnknown(held.reservationId, ""), (e: unknown) => e instanceof InvalidRequest && e.status === 400);
    await assert.rejects(idem.markUnknown(held.reservationId, "x".repeat(1001)), InvalidRequest);
    assert.equal((await idem.get(held.reservationId)).state, "in_flight"); // a refused mark marks nothing
    await assert.rejects(idem.markUnknown(randomUUID(), "the provider timed out"), (e: unknown) => e instanceof NotFound && e.status === 404);
    await idem.release(held.reservationId);
    await assert.rejects(idem.markUnknown(held.reservationId, "the provider timed out"), (e: unknown) => e instanceof LeaseLost && e.status === 409);
  });

  test("a key under takeover is taken over, not unknown", async () => {
    const key = freshKey();
    await idem.reserve(key, { request: CHARGE, leaseSeconds: 1, onLeaseExpiry: "takeover" });
    await new Promise((r) => setTimeout(r, 1500));
    const taken = await idem.reserve(key, { request: CHARGE });
    assert.equal(taken.kind === "reserved" && taken.attempt, 2);
  });

  test("tenants apart; a wrong token is Unauthorized", async () => {
    const key = freshKey();
    await idem.reserve(key, { request: CHARGE });
    const globex = new Client(server.baseUrl, { token: OTHER_TOKEN });
    assert.equal((await globex.reserve(key, { request: CHARGE })).kind, "reserved");
    const stranger = new Client(server.baseUrl, { token: "not-a-token" });
    await assert.rejects(stranger.reserve(freshKey(), { request: CHARGE }), Unauthorized);
  });
});
