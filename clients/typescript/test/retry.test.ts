// The retry table, as a classifier and as a fetch in front of a real idemgate proxy.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, test } from "node:test";

import { classify, derive_key, retryingFetch, type Decision } from "../src/index.js";
import { startOrigin, startProxy, type Origin, type Server } from "./server.js";

const problem = (status: number, slug?: string, retryAfter?: string): Response => {
  const headers: Record<string, string> = retryAfter ? { "retry-after": retryAfter } : {};
  if (slug === undefined) return new Response(null, { status, headers });
  return new Response(JSON.stringify({ type: `https://idemgate.dev/problems/${slug}`, status }), {
    status,
    headers: { ...headers, "content-type": "application/problem+json" },
  });
};

const rows: [string, () => Response | unknown, Decision, number | undefined][] = [
  ["a network failure", () => new TypeError("fetch failed"), "retry", undefined],
  ["a timeout", () => new DOMException("timed out", "TimeoutError"), "retry", undefined],
  ["502", () => problem(502), "retry", undefined],
  ["504", () => problem(504, "upstream-timeout"), "retry", undefined],
  ["503 with Retry-After", () => problem(503, "store-unavailable", "2"), "retry", 2],
  ["429", () => problem(429, "tenant-limit", "3"), "retry", 3],
  ["408", () => problem(408), "retry", undefined],
  ["425", () => problem(425), "retry", undefined],
  ["409 request-in-flight", () => problem(409, "request-in-flight", "4"), "wait", 4],
  ["409 outcome-unknown", () => problem(409, "outcome-unknown"), "dead-letter", undefined],
  ["409 lease-lost", () => problem(409, "lease-lost"), "answer", undefined],
  // A 409 whose body names no problem of ours is waited for, as ever.
  ["409 without a body", () => problem(409), "wait", undefined],
  ["409 with another JSON body", () => new Response('{"error":"conflict"}', { status: 409, headers: { "content-type": "application/json" } }), "wait", undefined],
  ["409 with a text body", () => new Response("outcome-unknown", { status: 409 }), "wait", undefined],
  ["422", () => problem(422, "key-reused"), "stop", undefined],
  ["500", () => problem(500), "answer", undefined],
  ["402", () => problem(402), "answer", undefined],
  ["400 key-invalid", () => problem(400, "key-invalid"), "answer", undefined],
  ["201", () => problem(201), "answer", undefined],
  ["an abort by the caller", () => new DOMException("aborted", "AbortError"), "answer", undefined],
  ["another error", () => new RangeError("not a network error"), "answer", undefined],
];

for (const [name, outcome, decision, afterSeconds] of rows) {
  test(`the table: ${name}`, async () => {
    const verdict = await classify(outcome());
    assert.equal(verdict.decision, decision);
    assert.equal(verdict.afterSeconds, afterSeconds);
  });
}

let origin: Origin;
let proxy: Server;
before(async () => {
  origin = await startOrigin();
  proxy = await startProxy(origin.url);
});
after(async () => {
  await proxy.stop();
  await origin.close();
});

const key = () => derive_key({ tenant: "acme", run: `run-${randomUUID()}`, step: 1, tool: "charge" });
const post = (k?: string, body = '{"amount":500}'): RequestInit => ({
  method: "POST",
  body,
  headers: { "content-type": "application/json", ...(k ? { "idempotency-key": k } : {}) },
});

test("a timeout retries the same key and gets the one charge", async () => {
  const k = key();
  const call = retryingFetch({ budgetMs: 10_000, attemptTimeoutMs: 500, backoffMs: 100 });
  const answer = await call(`${proxy.baseUrl}/slow/1500`, post(k));
  assert.equal(answer.status, 201);
  assert.equal(origin.charges.get(k), 1);
});

test("a released 503 is retried and charges once", async () => {
  const k = key();
  const answer = await retryingFetch({ backoffMs: 100 })(`${proxy.baseUrl}/flaky`, post(k));
  assert.equal(answer.status, 201);
  assert.equal(origin.calls.get(k), 2);
  assert.equal(origin.charges.get(k), 1);
});

test("422 is not retried", async () => {
  const k = key();
  const call = retryingFetch({ backoffMs: 100 });
  assert.equal((await call(`${proxy.baseUrl}/charge`, post(k))).status, 201);
  assert.equal((await call(`${proxy.baseUrl}/charge`, post(k, '{"amount":900}'))).status, 422);
  assert.equal(origin.calls.get(k), 1);
});

test("in flight past the budget returns the 409", async () => {
  const k = key();
  const first = fetch(`${proxy.baseUrl}/slow/3000`, post(k));
  await new Promise((r) => setTimeout(r, 300));
  // The proxy would hold the duplicate until the first answers (its default
  // wait, 10 s) and replay it; this caller asks for the 409 at once, as a
  // client of a server without that default gets it.
  const duplicate = { ...post(k), headers: { "content-type": "application/json", "idempotency-key": k, prefer: "wait=0" } };
  const answer = await retryingFetch({ budgetMs: 1000, backoffMs: 100 })(`${proxy.baseUrl}/slow/3000`, duplicate);
  assert.equal(answer.status, 409);
  assert.equal((await first).status, 201);
  assert.equal(origin.charges.get(k), 1);
});

test("an unknown outcome is retried once, then never again", async () => {
  const k = key();
  const attempts: [string | null, number][] = [];
  const recording: typeof fetch = async (input, init) => {
    const answer = await fetch(input, init);
    attempts.push([new Headers(init?.headers).get("idempotency-key"), answer.status]);
    return answer;
  };
  // The origin charges, then hangs up: the proxy answers 502 and, under its
  // default hold, marks the key's outcome unknown.
  const answer = await retryingFetch({ fetch: recording, budgetMs: 10_000, backoffMs: 100 })(`${proxy.baseUrl}/hangup`, post(k));
  assert.equal(answer.status, 409);
  assert.equal(answer.headers.get("retry-after"), null);
  assert.equal((await classify(answer)).decision, "dead-letter");
  const body = (await answer.json()) as { type: string };
  assert.ok(body.type.endsWith("/outcome-unknown"));
  // The 502 was retried under the same key; the 409 was not.
  assert.deepEqual(attempts, [[k, 502], [k, 409]]);
  assert.equal(origin.calls.get(k), 1);
  assert.equal(origin.charges.get(k), 1);
});

test("a request without a key is sent once", async () => {
  const before = origin.calls.get("") ?? 0;
  const answer = await retryingFetch({ backoffMs: 100 })(`${proxy.baseUrl}/flaky`, post());
  assert.ok(answer.status === 503 || answer.status === 201);
  assert.equal(origin.calls.get(""), before + 1);
});
