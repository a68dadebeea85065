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
 * - an effect that throws `NotExecuted` (it failed before acting) releases
 *   the key; any other error (or a process that dies) leaves it in flight
 *   until its lease ends, because the effect may have acted.
 *
 * What the lease's end means is `onLeaseExpiry`:
 *
 * - by default `"hold"`: a crashed effect is never run again by itself. Its
 *   key's outcome becomes unknown when the lease ends, the next call throws
 *   `OutcomeUnknown` without running the effect, and an operator settles it;
 * - with a `reconcile` option, `"takeover"`: the next call after the lease
 *   takes the key over (`holding.attempt > 1`, with `holding.recovery`, what
 *   the earlier holder recorded with `holding.checkpoint`) and calls
 *   `reconcile(holding)` before anything else. It looks for what the earlier
 *   attempt did and resolves to `{ found: true, result }` if the effect
 *   happened (that result is committed as the key's and returned; the effect
 *   does not run) or `{ found: false }` if it did not (the effect runs, with
 *   `holding.attempt > 1`):
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
 *   to an API that dedupes on it is); the guard cannot check.
 *
 * A call that would not take over (`"hold"`, no `reconcile`) and still gets
 * a key taken over from an earlier holder that chose `"takeover"` does not
 * run the effect either: it throws `OutcomeUnknown` and leaves the key to end
 * its lease under `hold`, unknown, for an operator.
 *
 * Both dead-letter errors, `InFlight` and `OutcomeUnknown`, carry
 * `deadLetterReason` (`idempotency_in_flight`, `outcome_unknown`):
 *
 * ```ts
 * try {
 *   await guard(idem, key, charge, { request });
 * } catch (e) {
 *   if (e instanceof InFlight || e instanceof OutcomeUnknown) deadLetter(step, e.deadLetterReason);
 *   else throw e;
 * }
 * ```
 */
import type { Client, LeaseExpiry, RecoveryPoint, RequestDescription, Reserved, Completed } from "./api.js";
import { IdemgateError, OutcomeUnknown, RequestInFlight } from "./errors.js";

/** The longest single `Prefer: wait` asked for; the server caps it too. */
export const MAX_WAIT_SECONDS = 10;

/** The key stayed held by another caller for the whole wait budget. */
export class InFlight extends IdemgateError {
  override name = "InFlight";
  /** The reason the step is put in the dead-letter queue with. */
  readonly deadLetterReason = "idempotency_in_flight";
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
  /** How a result is stored and read back (default JSON). */
  encode?: (result: T) => string;
  decode?: (stored: string) => T;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

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
    else throw new TypeError("reconcile must resolve to { found: true, result } or { found: false }; the key is left in flight");
  } catch (e) {
    if (e instanceof NotExecuted) await client.release(answer.reservationId);
    throw e;
  } finally {
    clearInterval(heartbeat);
  }
  await client.commit(answer.reservationId, { status: 200, body: encode(result) });
  return result;
}
