/**
 * One call around an effect: reserve, run it at most once, commit.
 *
 * ```ts
 * const result = await guard(idem, key, async (holding) => charge(args), { request });
 * ```
 *
 * - a key already completed resolves to the stored result; the effect does not run;
 * - a key another caller holds is waited for (`Prefer: wait`, then retries of
 *   the same key) within `waitBudgetMs`, then `InFlight` is thrown: the step
 *   belongs in the caller's dead-letter queue, never in a second execution;
 * - a key whose outcome is unknown throws `OutcomeUnknown` at once and the
 *   effect does not run: the step belongs in the dead-letter queue, never
 *   retried and never under a new key, until an operator settles the key
 *   (completed: the next call resolves to that result; released: it runs);
 * - a key reused with another payload throws `KeyReused`, never retried;
 * - the lease is extended while the effect runs;
 * - an effect that throws is judged by `classifyFailure` (default
 *   `classifyFailure`): an error that proves the effect never acted
 *   (`NotExecuted`, always; a fetch whose connection was refused, whose host
 *   did not resolve or whose connect timed out) releases the key, so a retry
 *   runs it; any other (a timeout after the request went out, a socket
 *   closed mid-answer, anything unknown) marks the key unknown at once
 *   (`markUnknown`, the reason naming the error's type, never its message),
 *   so its duplicates get `OutcomeUnknown` at once instead of waiting out the
 *   lease, and an operator settles it. Either way the call rejects with the
 *   effect's own error. A process that dies leaves the key in flight until
 *   its lease ends.
 *
 * ```ts
 * await guard(idem, key, charge, {
 *   request,
 *   classifyFailure: (e) => (e instanceof CardDeclined ? "release" : classifyFailure(e)),
 * });
 * ```
 *
 * What the lease's end means is `onLeaseExpiry`:
 *
 * - by default `"hold"`: a crashed effect is never run again by itself. Its
 *   key's outcome becomes unknown when the lease ends (at once, for an
 *   effect that threw something other than a proof that it never acted),
 *   the next call throws
 *   `OutcomeUnknown` without running the effect, and an operator settles it;
 * - with a `reconcile` option, `"takeover"`: the next call after the lease
 *   takes the key over (`holding.attempt > 1`, with `holding.recovery`, what
 *   the earlier holder recorded with `holding.checkpoint`) and calls
 *   `reconcile(holding)` before anything else. It looks for what the earlier
 *   attempt did and resolves to `{ found: true, result }` if the effect
 *   happened (that result is committed as the key's and returned; the effect
 *   does not run) or `{ found: false }` if it did not (the effect runs, with
 *   `holding.attempt > 1`). An effect that threw is then not marked unknown
 *   (unless it proved it never acted: released), since the next call's
 *   `reconcile` finds out what it did:
 *
 * ```ts
 * await guard(idem, key, charge, {
 *   request,
 *   reconcile: async () => {
 *     const found = await payments.find({ idempotencyKey: key });
 *     return found ? { found: true, result: found } : { found: false };
 *   },
 * });
 * ```
 *
 * - `onLeaseExpiry: "takeover"` without a `reconcile`: the effect itself is
 *   taken over, with `holding.attempt > 1`. That is the caller's promise that
 *   the effect reconciles by itself (it is idempotent on the key, as a call
 *   to an API that dedupes on it is); the guard cannot check. Here too an
 *   effect that threw is left in flight for that takeover.
 *
 * A call that would not take over (`"hold"`, no `reconcile`) and still gets
 * a key taken over from an earlier holder that chose `"takeover"` does not
 * run the effect either: it throws `OutcomeUnknown` and leaves the key to end
 * its lease under `hold`, unknown, for an operator.
 *
 * The commit after the effect is retried while idemgate is away (no answer,
 * or a 502/503/504), with exponential backoff and jitter, for
 * `commitBudgetMs` (default: the lease, `leaseSeconds` or the server's
 * default 30 s; a holder's late commit is accepted while its reservation is
 * current, and committing the same response twice is fine), so a server
 * back within the budget gets the result and the call resolves to it. Past
 * the budget the call rejects with `ResultNotCommitted` (a
 * `StoreUnavailable`) carrying the effect's `result`: the effect acted, so
 * it is never run again; the step is dead-lettered with the result, and the
 * key (in flight, then unknown under `hold`) is completed by an operator or
 * a late commit. Every other call that gets no answer (the reserve, a
 * release, an unknown mark) throws `StoreUnavailable` with the `fetch` error
 * as its `cause`, never a raw `fetch` error.
 *
 * The three dead-letter errors, `InFlight`, `OutcomeUnknown` and
 * `ResultNotCommitted`, carry `deadLetterReason` (`idempotency_in_flight`,
 * `outcome_unknown`, `result_not_committed`):
 *
 * ```ts
 * try {
 *   await guard(idem, key, charge, { request });
 * } catch (e) {
 *   if (e instanceof InFlight || e instanceof OutcomeUnknown) deadLetter(step, e.deadLetterReason);
 *   else if (e instanceof ResultNotCommitted) deadLetter(step, e.deadLetterReason, e.result);
 *   else throw e;
 * }
 * ```
 */
import type { Client, LeaseExpiry, RecoveryPoint, RequestDescription, Reserved, Completed } from "./api.js";
import { errorToJSON, IdemgateError, OutcomeUnknown, Problem, registerError, RequestInFlight, ResultNotCommitted, StoreUnavailable } from "./errors.js";

/** The longest single `Prefer: wait` asked for; the server caps it too. */
export const MAX_WAIT_SECONDS = 10;

/** The key stayed held by another caller for the whole wait budget. */
export class InFlight extends IdemgateError {
  override name = "InFlight";
  /** The reason the step is put in the dead-letter queue with. */
  get deadLetterReason(): "idempotency_in_flight" {
    return "idempotency_in_flight";
  }
  constructor(
    readonly key: string,
    readonly waitedMs: number,
    readonly leaseExpiresAt: Date | undefined,
  ) {
    super(
      `the key is still in flight after ${(waitedMs / 1000).toFixed(1)} s` +
        (leaseExpiresAt ? ` (its holder's lease ends at ${leaseExpiresAt.toISOString()})` : ""),
    );
  }
}

/** Thrown by an effect that failed before it acted: the key is released. */
export class NotExecuted extends Error {
  override name = "NotExecuted";

  /** Its class (`name`) and message, for `JSON.stringify` or a `structuredClone` (see `reviveError`). */
  toJSON(): Record<string, unknown> {
    return errorToJSON(this);
  }
}

registerError(InFlight, "InFlight", ["leaseExpiresAt"]);
registerError(NotExecuted);

/**
 * What an error thrown by a guarded effect says about the effect:
 * `"release"`, it proves the effect never acted (the key is released, a
 * retry runs it); `"unknown"`, it does not (the key is marked unknown at once
 * under `hold`, for an operator).
 */
export type Failure = "release" | "unknown";

/** Error codes of a connection that was never made: nothing reached the other side. */
const NEVER_SENT: ReadonlySet<string> = new Set(["ECONNREFUSED", "ENOTFOUND", "EAI_AGAIN", "UND_ERR_CONNECT_TIMEOUT"]);

function codeOf(error: unknown): string | undefined {
  if (error === null || typeof error !== "object") return undefined;
  const code = (error as { code?: unknown }).code;
  return typeof code === "string" ? code : undefined;
}

/** Whether `error` is a connect that failed (an AggregateError: every address tried failed so). */
function neverSent(error: unknown): boolean {
  if (error instanceof AggregateError && error.errors.length > 0) return error.errors.every(neverSent);
  const code = codeOf(error);
  return code !== undefined && NEVER_SENT.has(code);
}

/**
 * The guard's default judgement of an error thrown by an effect.
 *
 * `"release"` only for what proves the effect never acted: `NotExecuted`
 * (the effect says so), and a connection that was never made — a `fetch`
 * that failed (`TypeError`) with a `cause` whose `code` is `ECONNREFUSED`,
 * `ENOTFOUND`, `EAI_AGAIN` or `UND_ERR_CONNECT_TIMEOUT`, or an error with
 * such a `code` itself (`node:http`, `node:net`). `"unknown"` for everything
 * else: a timeout after the request went out (`AbortSignal.timeout`,
 * `UND_ERR_HEADERS_TIMEOUT`), a socket reset or closed mid-answer
 * (`ECONNRESET`, `UND_ERR_SOCKET`), anything it does not know.
 *
 * It looks at the error alone: an effect that makes another call after the
 * one that acts (a receipt, a webhook) must not let that call's connection
 * error escape, or pass a `classifyFailure` of its own.
 */
export function classifyFailure(error: unknown): Failure {
  if (error instanceof NotExecuted) return "release";
  if (neverSent(error)) return "release";
  if (error instanceof TypeError && neverSent(error.cause)) return "release";
  return "unknown";
}

/** A type's name as a reason may give it: a constructor's name, never a message. */
function typeName(value: unknown): string {
  if (value === null || typeof value !== "object") return `a thrown ${value === null ? "null" : typeof value}`;
  const name: unknown = (value as { constructor?: { name?: unknown } }).constructor?.name;
  return typeof name === "string" && /^[A-Za-z_$][\w$]{0,99}$/.test(name) ? name : "an object";
}

/**
 * The reason a key is marked unknown with: the error's type (and, for a
 * `fetch` error, its cause's type and code); its message or a body could
 * carry a secret, and never leaves.
 */
function unknownReason(error: unknown): string {
  let what = typeName(error);
  if (error instanceof Error && error.cause !== undefined) {
    const code = codeOf(error.cause);
    const shown = code !== undefined && /^[A-Z][A-Z0-9_]{1,63}$/.test(code) ? ` ${code}` : "";
    what += ` (cause ${typeName(error.cause)}${shown})`;
  }
  return `the guarded effect threw ${what}: it may have acted`.slice(0, 1000);
}

/**
 * Releases the key or marks it unknown, as `classify` judges `error`
 * (`NotExecuted` always releases; a classifier that throws, or answers
 * anything but `"release"`, means unknown). Whatever happens here, the call
 * rejects with `error`: if the release or the mark fails (the store is away,
 * the lease was lost meanwhile) the key is not released instead; left in
 * flight, its lease ending makes it unknown anyway under `hold` (a takeover
 * under `takeover`).
 */
async function settleFailure(
  client: Client, reservationId: string, expiry: LeaseExpiry, error: unknown, classify: (error: unknown) => Failure,
): Promise<void> {
  let verdict: Failure = "unknown";
  if (error instanceof NotExecuted) verdict = "release";
  else {
    try {
      verdict = classify(error) === "release" ? "release" : "unknown";
    } catch {
      verdict = "unknown";
    }
  }
  try {
    if (verdict === "release") await client.release(reservationId);
    else if (expiry === "hold") await client.markUnknown(reservationId, unknownReason(error));
    // Under takeover the key stays in flight: the next call after the lease
    // takes it over and reconciles.
  } catch {
    // See above: the effect's error is what the caller gets.
  }
}

/** What the effect gets: its reservation, and how to record progress. */
export interface Holding {
  reservationId: string;
  /** 1 for a new key; more for a takeover, which must reconcile first. */
  attempt: number;
  /** What an earlier holder of the key recorded with `checkpoint`. */
  recovery: RecoveryPoint | null;
  /** Records how far the effect got, for a holder that takes over. */
  checkpoint(recoveryPoint: string, data?: unknown): Promise<void>;
}

/**
 * What `reconcile` resolves to: `{ found: true, result }` when the earlier
 * attempt's effect happened (its result is committed and returned, the
 * effect does not run), `{ found: false }` when it did not (the effect runs).
 */
export type Reconciliation<T> = { found: true; result: T } | { found: false };

export interface GuardOptions<T> {
  request?: RequestDescription;
  fingerprint?: string;
  /**
   * What the key is, for the operator who may have to settle it (an order
   * id, a job name; at most 200 characters): kept with the key, never part
   * of the fingerprint.
   */
  label?: string;
  /** How long to wait for another holder (default 30 000 ms). */
  waitBudgetMs?: number;
  leaseSeconds?: number;
  /**
   * What the lease ending without a commit means (the process died, or the
   * effect threw after it may have acted). Unset: `hold` (the key's outcome
   * becomes unknown and waits for an operator; the effect never runs again
   * by itself), or `takeover` when `reconcile` is given. `takeover` without
   * a `reconcile` hands the key to the effect itself: the caller's promise
   * that the effect reconciles by itself.
   */
  onLeaseExpiry?: LeaseExpiry;
  /**
   * Called first on a takeover (`holding.attempt > 1`), to find out whether
   * the earlier attempt's effect happened: `{ found: true, result }` commits
   * and returns that result without running the effect; `{ found: false }`
   * runs the effect. Given, the key is reserved under `takeover`.
   */
  reconcile?: (holding: Holding) => Promise<Reconciliation<T>> | Reconciliation<T>;
  /**
   * Judges an error the effect throws (default `classifyFailure`):
   * `"release"` releases the key, `"unknown"` marks it unknown at once under
   * `hold` (under `takeover` it is left in flight for the next call to
   * reconcile). The call rejects with the effect's error either way.
   * `NotExecuted` releases without asking it.
   */
  classifyFailure?: (error: unknown) => Failure;
  /**
   * How long the commit is retried while idemgate is away (default: the
   * lease, `leaseSeconds` or the server's default 30 s). Past it, the call
   * rejects with `ResultNotCommitted`, which carries the effect's result.
   */
  commitBudgetMs?: number;
  /** How a result is stored and read back (default JSON). */
  encode?: (result: T) => string;
  decode?: (stored: string) => T;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** The server's default lease (SPEC §5): the default commit budget without `leaseSeconds`. */
const DEFAULT_LEASE_SECONDS = 30;
/** The commit's first and longest pause between tries (before jitter). */
const COMMIT_FIRST_PAUSE_MS = 200;
const COMMIT_LONGEST_PAUSE_MS = 2000;

/** A commit that may succeed later: no answer, or the store (or a proxy before it) away. */
function commitRetryable(error: unknown): error is Problem {
  return error instanceof StoreUnavailable || (error instanceof Problem && [502, 503, 504].includes(error.status));
}

/**
 * Commits `result`, retried while idemgate is away with exponential backoff
 * and full jitter (half to all of the step) within `budgetMs`; past it,
 * `ResultNotCommitted` with the result.
 */
async function commitResult(client: Client, reservationId: string, result: unknown, body: string, budgetMs: number): Promise<void> {
  const started = Date.now();
  let step = COMMIT_FIRST_PAUSE_MS;
  for (;;) {
    try {
      await client.commit(reservationId, { status: 200, body });
      return;
    } catch (e) {
      if (!commitRetryable(e)) throw e;
      const left = budgetMs - (Date.now() - started);
      if (left <= 0) throw ResultNotCommitted.of(reservationId, result, body, Date.now() - started, e);
      let pause = step / 2 + Math.random() * (step / 2);
      if (e.retryAfter) pause = Math.max(pause, Math.min(e.retryAfter * 1000, COMMIT_LONGEST_PAUSE_MS));
      step = Math.min(step * 2, COMMIT_LONGEST_PAUSE_MS);
      await sleep(Math.min(pause, left));
    }
  }
}

/** The `on_lease_expiry` a call reserves with: its own, or `takeover` with a `reconcile` and `hold` without. */
function leaseExpiry<T>(options: GuardOptions<T>): LeaseExpiry {
  return options.onLeaseExpiry ?? (options.reconcile === undefined ? "hold" : "takeover");
}

/**
 * A takeover this call cannot reconcile (no `reconcile`, and it did not
 * choose `takeover` itself): whether the earlier attempt acted is unknown,
 * so the effect does not run; the key, held under `hold`, turns unknown when
 * this call's lease ends.
 */
function unreconciled(attempt: number): OutcomeUnknown {
  // Thrown by the guard itself (the server answered 201): its slug, no base URI.
  return new OutcomeUnknown(409, {
    type: "outcome-unknown",
    title: "Outcome unknown",
    detail: `the key was taken over from an earlier attempt (this is attempt ${attempt}) that may have acted, ` +
      "and this guard has no reconcile function: the effect is not run; " +
      "the key becomes unknown when this lease ends, for an operator to settle",
    attempt,
  }, undefined);
}

async function reserve<T>(client: Client, key: string, options: GuardOptions<T>): Promise<Reserved | Completed> {
  const budget = options.waitBudgetMs ?? 30_000;
  const started = Date.now();
  for (;;) {
    const left = budget - (Date.now() - started);
    const wait = Math.floor(Math.min(MAX_WAIT_SECONDS, Math.max(0, left / 1000)));
    try {
      return await client.reserve(key, {
        ...(options.request === undefined ? {} : { request: options.request }),
        ...(options.fingerprint === undefined ? {} : { fingerprint: options.fingerprint }),
        ...(options.label === undefined ? {} : { label: options.label }),
        ...(options.leaseSeconds === undefined ? {} : { leaseSeconds: options.leaseSeconds }),
        onLeaseExpiry: leaseExpiry(options),
        ...(wait > 0 ? { wait } : {}),
      });
    } catch (e) {
      if (!(e instanceof RequestInFlight)) throw e;
      const waited = Date.now() - started;
      if (budget - waited <= 0) throw new InFlight(key, waited, e.leaseExpiresAt);
      await sleep(Math.min(budget - waited, (e.retryAfter ?? 1) * 1000, 1000));
    }
  }
}

/**
 * The effect's result for `key`: run now, stored by an earlier run, or
 * found by `reconcile` on a takeover. Throws `InFlight` (held past the wait
 * budget) or `OutcomeUnknown` without running the effect: both for the
 * dead-letter queue, never for a retry under a new key.
 */
export async function guard<T>(
  client: Client,
  key: string,
  effect: (holding: Holding) => Promise<T>,
  options: GuardOptions<T> = {},
): Promise<T> {
  const encode = options.encode ?? ((r: T) => JSON.stringify(r));
  const decode = options.decode ?? ((s: string) => JSON.parse(s) as T);
  const answer = await reserve(client, key, options);
  if (answer.kind === "completed") return decode(answer.response.text());
  const reconcile = options.reconcile;
  if (answer.attempt > 1 && reconcile === undefined && leaseExpiry(options) === "hold") {
    throw unreconciled(answer.attempt);
  }
  const holding: Holding = {
    reservationId: answer.reservationId,
    attempt: answer.attempt,
    recovery: answer.recovery,
    checkpoint: async (point, data) => {
      await client.checkpoint(answer.reservationId, point, data);
    },
  };
  const leftMs = answer.leaseExpiresAt.getTime() - Date.now();
  const everyMs = Math.max(200, Math.min(leftMs, (options.leaseSeconds ?? Infinity) * 1000) / 3);
  const heartbeat = setInterval(() => {
    // Lost or unreachable: the commit will say so; keep trying meanwhile.
    client.extend(answer.reservationId, options.leaseSeconds).catch(() => undefined);
  }, everyMs);
  let result: T;
  try {
    const found = reconcile !== undefined && answer.attempt > 1 ? await reconcile(holding) : { found: false as const };
    if (found.found === true) result = found.result;
    else if (found.found === false) result = await effect(holding);
    else throw new TypeError("reconcile must resolve to { found: true, result } or { found: false }; the key is not committed");
  } catch (e) {
    clearInterval(heartbeat);
    await settleFailure(client, answer.reservationId, leaseExpiry(options), e, options.classifyFailure ?? classifyFailure);
    throw e;
  } finally {
    clearInterval(heartbeat);
  }
  const budgetMs = options.commitBudgetMs ?? (options.leaseSeconds ?? DEFAULT_LEASE_SECONDS) * 1000;
  await commitResult(client, answer.reservationId, result, encode(result), budgetMs);
  return result;
}
