// The reservation API through types that openapi-typescript generates from
// openapi/openapi.json, with every call made by openapi-fetch, against a
// running `idemgate serve`.
//
// It is compiled with `tsc --strict` before it runs, so the document is
// checked twice: its types must fit the way a client uses them (the union of
// a reserve's 201 and 200 must narrow on `state`, a header line must be
// `[string, string]`), and the server's answers must match them at run time.
//
// Then a key its holder marks unknown (`POST /v1/reservations/{id}/unknown`):
// the record comes back `unknown` with the reason, a duplicate is `409
// outcome-unknown` at once (no Retry-After), an empty reason is `400`, an
// unknown id `404`, and the holder's late commit settles it into a replay.
//
// Then one stuck key settled through the admin operations: a key reserved
// under `on_lease_expiry: "hold"` with a one-second lease and left alone is
// `409 outcome-unknown`; `GET /v1/admin/keys?state=unknown` (the admin token)
// finds it by the SHA-256 of the key; the resolve completes it with a
// response; and the next reserve replays that response.
//
//     node out/driver.js BASE_URL TOKEN ADMIN_TOKEN TENANT
//
// TENANT is the name the server gives TOKEN's tenant; ADMIN_TOKEN is one of
// its IDEMGATE_ADMIN_TOKENS.

import { createHash } from "node:crypto";
import createClient from "openapi-fetch";
import type { components, paths } from "./idemgate.js";

type Schemas = components["schemas"];

// A header line is exactly [name, value] in the generated types: a compile
// error otherwise. (Checked on the schema types: openapi-fetch widens tuples to
// arrays in the data it returns.)
type Assert<T extends true> = T;
export type HeaderLinesArePairs = Assert<
    Schemas["ResponseView"]["headers"] extends [string, string][]
        ? NonNullable<Schemas["CommitBody"]["headers"]> extends [string, string][]
            ? true
            : false
        : false
>;

const [baseUrl, token, adminToken, tenant] = process.argv.slice(2);
if (baseUrl === undefined || token === undefined || adminToken === undefined || tenant === undefined) {
    console.error("usage: node out/driver.js BASE_URL TOKEN ADMIN_TOKEN TENANT");
    process.exit(2);
}
const client = createClient<paths>({ baseUrl, headers: { Authorization: `Bearer ${token}` } });
const admin = createClient<paths>({ baseUrl, headers: { Authorization: `Bearer ${adminToken}` } });
/** The tenant the server names `token`'s keys with. */
const ownTenant: string = tenant;

/** A reserve, with a body or with none. */
const reserve = (key: string, body?: Schemas["ReserveBody"]) =>
    body === undefined
        ? client.POST("/v1/reservations", { params: { header: { "Idempotency-Key": key } } })
        : client.POST("/v1/reservations", { params: { header: { "Idempotency-Key": key } }, body });
const commit = (id: string, body: Schemas["CommitBody"]) =>
    client.POST("/v1/reservations/{id}/commit", { params: { path: { id } }, body });

type ReserveResult = Awaited<ReturnType<typeof reserve>>;
type CommitResult = Awaited<ReturnType<typeof commit>>;

class CheckFailed extends Error {}

/** The step under way, for the message when something other than a check fails. */
let step = "starting";

function check(ok: unknown, step: string, what: string, response?: Response, body?: unknown): asserts ok {
    if (!ok) {
        const seen = response ? `\n  got ${response.status}: ${JSON.stringify(body)}` : "";
        throw new CheckFailed(`${step}: ${what}${seen}`);
    }
}

/** A reserve's 201, told from its 200 replay by `state` alone. */
function reserved(step: string, { data, error, response }: ReserveResult) {
    check(response.status === 201, step, "expected 201", response, data ?? error);
    check(data, step, "expected a body", response, error);
    if (data.state === "reserved") {
        // Narrowed: only the 201's body has a reservation_id.
        const location = `/v1/reservations/${data.reservation_id}`;
        check(response.headers.get("location") === location, step, `expected Location: ${location}`, response, data);
        check(response.headers.has("idempotency-expires"), step, "expected Idempotency-Expires", response, data);
        return data;
    }
    throw new CheckFailed(`${step}: expected state reserved, got ${data.state}`);
}

/** A reserve's 200 replay, or a commit's 200, told from a 201 by `state`. */
function completed(step: string, { data, error, response }: ReserveResult | CommitResult) {
    check(response.status === 200, step, "expected 200", response, data ?? error);
    check(data, step, "expected a body", response, error);
    if (data.state === "completed") {
        // Narrowed: only the 200's body has a response.
        check(response.headers.has("idempotency-expires"), step, "expected Idempotency-Expires", response, data);
        return data;
    }
    throw new CheckFailed(`${step}: expected state completed, got ${data.state}`);
}

interface Answer {
    data?: unknown;
    error?: Schemas["Problem"];
    response: Response;
}

function problem(step: string, answer: Answer, status: number, slug: string): Schemas["Problem"] {
    const { data, error, response } = answer;
    check(response.status === status, step, `expected ${status}`, response, data ?? error);
    check(
        response.headers.get("content-type") === "application/problem+json",
        step,
        "expected application/problem+json",
        response,
        error,
    );
    check(error, step, "expected a problem", response, data);
    check(error.type.endsWith(`/${slug}`), step, `expected the ${slug} problem`, response, error);
    check(error.status === status, step, `expected status ${status} in the problem`, response, error);
    return error;
}

async function run(): Promise<void> {
    const key = `typescript-${crypto.randomUUID()}`;
    const charge = { fingerprint: "POST /charges amount=500" };
    let steps = 0;

    step = "reserve a new key";
    const first = reserved(step, await reserve(key, charge));
    check(first.attempt === 1, step, "expected attempt 1");
    steps++;

    step = "reserve the same key while it is in flight";
    let answer = await reserve(key, charge);
    const inFlight = problem(step, answer, 409, "request-in-flight");
    const retry = inFlight.retry_after_seconds;
    check(typeof retry === "number" && retry >= 1, step, "expected retry_after_seconds >= 1", answer.response, inFlight);
    check(answer.response.headers.get("retry-after") === String(retry), step, "expected Retry-After to match", answer.response, inFlight);
    steps++;

    step = "commit the response";
    const lines: [string, string][] = [
        ["content-type", "application/json"],
        ["x-charge", "ch_1"],
    ];
    const stored = completed(step, await commit(first.reservation_id, { status: 201, headers: lines, body: '{"id":"ch_1"}' }));
    check(stored.response.status === 201, step, "expected the stored status 201");
    steps++;

    step = "reserve the completed key again";
    answer = await reserve(key, charge);
    check(
        answer.response.headers.get("idempotent-replayed") === "true",
        step,
        "expected Idempotent-Replayed: true",
        answer.response,
        answer.data,
    );
    const replay = completed(step, answer);
    check(replay.response.status === 201, step, "expected the stored status");
    check(JSON.stringify(replay.response.headers) === JSON.stringify(lines), step, "expected the stored header lines");
    check(replay.response.body === '{"id":"ch_1"}', step, "expected the stored body");
    steps++;

    step = "reserve the same key with another payload";
    problem(step, await reserve(key, { fingerprint: "POST /charges amount=501" }), 422, "key-reused");
    steps++;

    // Bodies left out: the reserve and extend bodies are optional.
    const fresh = `typescript-${crypto.randomUUID()}`;
    step = "reserve a new key with no body";
    const held = reserved(step, await reserve(fresh));
    steps++;

    step = "extend with no body";
    const extended = await client.POST("/v1/reservations/{id}/extend", {
        params: { path: { id: held.reservation_id } },
    });
    check(extended.response.status === 200, step, "expected 200", extended.response, extended.error);
    check(extended.data, step, "expected a body", extended.response, extended.error);
    check(extended.data.reservation_id === held.reservation_id, step, "expected the same id", extended.response, extended.data);
    steps++;

    step = "release";
    const released = await client.POST("/v1/reservations/{id}/release", {
        params: { path: { id: held.reservation_id } },
    });
    check(released.response.status === 204, step, "expected 204", released.response, released.error);
    steps++;

    step = "reserve the released key again";
    const again = reserved(step, await reserve(fresh));
    check(again.reservation_id !== held.reservation_id, step, "expected a new reservation id");
    check(again.attempt === 1, step, "expected attempt 1: the key is new again");
    steps++;

    steps += await markUnknownOne();
    steps += await resolveOne(ownTenant);

    console.log(`typescript client (openapi-typescript + openapi-fetch): ${steps} steps passed, an unknown mark and a resolve included`);
}

/** A key its holder marks unknown, then settles with its own late commit; the steps it took. */
async function markUnknownOne(): Promise<number> {
    const key = `typescript-${crypto.randomUUID()}`;
    const charge: Schemas["ReserveBody"] = { fingerprint: "POST /payouts amount=900" };
    const reason = "the provider timed out after the request was sent";
    const mark = (id: string, body: Schemas["UnknownBody"]) =>
        client.POST("/v1/reservations/{id}/unknown", { params: { path: { id } }, body });
    let steps = 0;

    step = "reserve a key (under takeover, the default)";
    const first = reserved(step, await reserve(key, charge));
    steps++;

    step = "mark it unknown";
    const marked = await mark(first.reservation_id, { reason });
    check(marked.response.status === 200, step, "expected 200", marked.response, marked.error);
    check(marked.data, step, "expected a body", marked.response, marked.error);
    const record = marked.data;
    check(record.state === "unknown", step, "expected state unknown", marked.response, record);
    check(record.reservation_id === first.reservation_id, step, "expected the same reservation id", marked.response, record);
    check(record.marked_unknown?.reason === reason, step, "expected marked_unknown with the reason", marked.response, record);
    steps++;

    step = "reserve the marked key again";
    let answer = await reserve(key, charge);
    const unknown = problem(step, answer, 409, "outcome-unknown");
    check(!answer.response.headers.has("retry-after"), step, "expected no Retry-After: waiting will not settle it", answer.response, unknown);
    check(unknown.retry_after_seconds == null, step, "expected no retry_after_seconds", answer.response, unknown);
    steps++;

    step = "mark it with an empty reason";
    problem(step, await mark(first.reservation_id, { reason: "" }), 400, "invalid-request");
    steps++;

    step = "mark an unknown reservation id";
    problem(step, await mark(crypto.randomUUID(), { reason }), 404, "not-found");
    steps++;

    step = "commit the marked key late (its holder still can)";
    completed(step, await commit(first.reservation_id, { status: 201, headers: [], body: '{"id":"po_1"}' }));
    steps++;

    step = "reserve the settled key again";
    answer = await reserve(key, charge);
    check(answer.response.headers.get("idempotent-replayed") === "true", step, "expected Idempotent-Replayed: true", answer.response, answer.data);
    const replay = completed(step, answer);
    check(replay.response.body === '{"id":"po_1"}', step, "expected the late commit's body");
    steps++;
    return steps;
}

/** A key whose outcome is unknown, settled by an operator through the admin operations; the steps it took. */
async function resolveOne(tenant: string): Promise<number> {
    const key = `typescript-${crypto.randomUUID()}`;
    const keyHash = createHash("sha256").update(key).digest("hex");
    const held: Schemas["ReserveBody"] = { fingerprint: "POST /refunds amount=700", on_lease_expiry: "hold", lease_seconds: 1 };
    let steps = 0;

    step = "reserve a key under hold with a one-second lease";
    const first = reserved(step, await reserve(key, held));
    steps++;

    await new Promise((done) => setTimeout(done, 1500));
    step = "reserve it again after its lease ended";
    let answer = await reserve(key, held);
    const unknown = problem(step, answer, 409, "outcome-unknown");
    check(!answer.response.headers.has("retry-after"), step, "expected no Retry-After: waiting will not settle it", answer.response, unknown);
    check(unknown.retry_after_seconds == null, step, "expected no retry_after_seconds", answer.response, unknown);
    steps++;

    step = "list the unknown keys (admin token)";
    const listed = await admin.GET("/v1/admin/keys", { params: { query: { state: "unknown", tenant } } });
    check(listed.response.status === 200, step, "expected 200", listed.response, listed.error);
    check(listed.data, step, "expected a body", listed.response, listed.error);
    const found = listed.data.keys.filter((view) => view.key_hash === keyHash);
    const view = found[0];
    check(found.length === 1 && view, step, `expected the key's hash ${keyHash} among the unknown keys`, listed.response, listed.data);
    check(view.tenant === tenant, step, `expected tenant ${tenant}`, listed.response, view);
    check(view.state === "unknown", step, "expected state unknown", listed.response, view);
    check(view.on_lease_expiry === "hold", step, "expected on_lease_expiry hold", listed.response, view);
    check(view.reservation_id === first.reservation_id, step, "expected the holder's reservation id", listed.response, view);
    steps++;

    step = "resolve it: complete, with the response that happened";
    const lines: [string, string][] = [
        ["content-type", "application/json"],
        ["x-refund", "re_1"],
    ];
    const settled = await admin.POST("/v1/admin/keys/{tenant}/{key_hash}/resolve", {
        params: { path: { tenant: view.tenant, key_hash: view.key_hash } },
        body: {
            action: "complete",
            reason: "the refund went through (checked with the bank)",
            response: { status: 201, headers: lines, body: '{"id":"re_1"}' },
        },
    });
    check(settled.response.status === 200, step, "expected 200", settled.response, settled.error);
    check(settled.data, step, "expected a body", settled.response, settled.error);
    check(settled.data.state === "completed", step, "expected state completed", settled.response, settled.data);
    check(settled.data.status === 201, step, "expected the stored status 201", settled.response, settled.data);
    check(settled.data.resolution?.action === "complete", step, "expected the resolution kept with the key", settled.response, settled.data);
    steps++;

    step = "reserve the resolved key again";
    answer = await reserve(key, held);
    check(
        answer.response.headers.get("idempotent-replayed") === "true",
        step,
        "expected Idempotent-Replayed: true",
        answer.response,
        answer.data,
    );
    const replay = completed(step, answer);
    check(replay.response.status === 201, step, "expected the resolved status");
    check(JSON.stringify(replay.response.headers) === JSON.stringify(lines), step, "expected the resolved header lines");
    check(replay.response.body === '{"id":"re_1"}', step, "expected the resolved body");
    steps++;
    return steps;
}

run().catch((e: unknown) => {
    if (e instanceof CheckFailed) {
        console.error(`typescript client: FAILED at ${e.message}`);
    } else {
        console.error(e);
        console.error(`typescript client: FAILED at ${step}: the error above`);
    }
    process.exit(1);
});
