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
 * - a key whose outcome is unknown (an earlier holder was cut off under
 *   `onLeaseExpiry: "hold"`) throws `OutcomeUnknown` at once and the effect
 *   does not run: the step belongs in the dead-letter queue, never retried
 *   and never under a new key, until an operator settles the key
 *   (completed: the next call resolves to that result; released: it runs);
 * - a key reused with another payload throws `KeyReused`, never retried;
 * - a takeover hands the effect `holding.attempt > 1` and the recovery point
 *   the earlier holder recorded: the effect must reconcile before acting again;
 * - the lease is extended while the effect runs;
 * - an effect that throws `NotExecuted` (it failed before acting) releases
 *   the key; any other error leaves it in flight until its lease ends,
 *   because the effect may have acted. What follows is `onLeaseExpiry`:
 *   `takeover` (the server's default) hands the key to the next call, with
 *   the recovery point to reconcile from; `hold` makes its outcome unknown,
 *   for an effect that cannot reconcile, and leaves it to an operator.
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
import { IdemgateError, RequestInFlight } from "./errors.js";

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

export interface GuardOptions<T> {
  request?: RequestDescription;
  fingerprint?: string;
  /** How long to wait for another holder (default 30 000 ms). */
  waitBudgetMs?: number;
  leaseSeconds?: number;
  /**
   * What the guard's lease ending without a commit means (the process died,
   * or the effect threw after it may have acted): unset, the server's default
   * `takeover`; `hold` for an effect that cannot reconcile, whose key then
   * waits for an operator.
   */
  onLeaseExpiry?: LeaseExpiry;
  /** How a result is stored and read back (default JSON). */
  encode?: (result: T) => string;
  decode?: (stored: string) => T;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

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
        ...(options.onLeaseExpiry === undefined ? {} : { onLeaseExpiry: options.onLeaseExpiry }),
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
 * The effect's result for `key`: run now, or stored by an earlier run.
 * Throws `InFlight` (held past the wait budget) or `OutcomeUnknown` without
 * running the effect: both for the dead-letter queue, never for a retry
 * under a new key.
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
    result = await effect(holding);
  } catch (e) {
    if (e instanceof NotExecuted) await client.release(answer.reservationId);
    throw e;
  } finally {
    clearInterval(heartbeat);
  }
  await client.commit(answer.reservationId, { status: 200, body: encode(result) });
  return result;
}
