/**
 * Retrying calls to an API behind `idemgate proxy` (or any server of the
 * Idempotency-Key draft) without executing anything twice.
 *
 * | what came back                                | what to do                                   |
 * |-----------------------------------------------|----------------------------------------------|
 * | a timeout, a closed socket, 502, 504          | retry: the same key, the same body           |
 * | 408, 425, 429, 503 (the proxy released it)    | retry the same key after `Retry-After`       |
 * | 409 `request-in-flight`                       | wait, retry the same key; past the budget, the dead-letter queue |
 * | 409 `outcome-unknown`                         | stop: never retried, never a new key; the dead-letter queue (`outcome_unknown`) |
 * | 422 `key-reused`                              | stop; never retried                          |
 * | anything else (2xx, a 4xx, a 500)             | the answer                                   |
 *
 * `idemgate proxy` holds a duplicate until the first answer by default (up
 * to 10 s) and replays it, so a 409 `request-in-flight` is the rarer case: a
 * first request that runs longer than that, or a caller that asked for the
 * immediate answer (`Prefer: wait=0`).
 *
 * ```ts
 * const call = retryingFetch({ budgetMs: 30_000, attemptTimeoutMs: 10_000 });
 * await call(`${api}/charges`, { method: "POST", body, headers: { "idempotency-key": key } });
 * ```
 */

/**
 * `stop`: the key was used with another payload; `dead-letter`: whether it
 * took effect is unknown, so never again, not even under a new key.
 */
export type Decision = "retry" | "wait" | "stop" | "dead-letter" | "answer";

export interface Verdict {
  decision: Decision;
  /** Seconds to wait first, when the server said (`Retry-After`). */
  afterSeconds?: number;
}

/** Statuses the proxy returns without storing them, releasing the key. */
export const RELEASED: ReadonlySet<number> = new Set([408, 425, 429, 503]);
/** Gateway statuses that say nothing of whether the origin acted. */
export const UNKNOWN: ReadonlySet<number> = new Set([502, 504]);

function retryAfter(response: Response): number | undefined {
  const value = response.headers.get("retry-after")?.trim();
  return value !== undefined && /^\d+$/.test(value) ? Number(value) : undefined;
}

function withAfter(decision: Decision, after: number | undefined): Verdict {
  return after === undefined ? { decision } : { decision, afterSeconds: after };
}

/** Whether `error` is one a retry of the same request may cure: a network failure or a timeout. */
export function isNetworkError(error: unknown): boolean {
  if (error instanceof DOMException) return error.name === "TimeoutError";
  return error instanceof TypeError; // fetch's "fetch failed", "other side closed", …
}

/**
 * What to do about one attempt's outcome (see the table). Only a 409's body
 * is read (a clone of it), to tell `request-in-flight` from
 * `outcome-unknown` and `lease-lost`; a 409 whose body names neither is
 * waited for.
 */
export async function classify(outcome: Response | unknown): Promise<Verdict> {
  if (!(outcome instanceof Response)) {
    return { decision: isNetworkError(outcome) ? "retry" : "answer" };
  }
  const status = outcome.status;
  if (status === 409) {
    let slug = "";
    try {
      const body: unknown = await outcome.clone().json();
      if (body !== null && typeof body === "object" && typeof (body as Record<string, unknown>)["type"] === "string") {
        slug = ((body as Record<string, string>)["type"] ?? "").split("/").pop() ?? "";
      }
    } catch {
      // not JSON: an in-flight answer all the same
    }
    if (slug === "outcome-unknown") return { decision: "dead-letter" };
    if (slug === "lease-lost") return { decision: "answer" };
    return withAfter("wait", retryAfter(outcome));
  }
  if (status === 422) return { decision: "stop" };
  if (RELEASED.has(status) || UNKNOWN.has(status)) return withAfter("retry", retryAfter(outcome));
  return { decision: "answer" };
}

export interface RetryOptions {
  fetch?: typeof fetch;
  /** How long, in all, to keep retrying one request (default 30 000 ms). */
  budgetMs?: number;
  /** How long one attempt may take before it counts as a timeout (default: no limit of our own). */
  attemptTimeoutMs?: number;
  keyHeader?: string;
  backoffMs?: number;
  maxBackoffMs?: number;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/**
 * A `fetch` that retries a keyed request per {@link classify}. The request
 * goes again as it was (same key, same body). A 409 `outcome-unknown` comes
 * back at once, never sent again (the dead-letter queue's case); when the
 * budget runs out the last response comes back (a 409 `request-in-flight`:
 * the dead-letter queue's case too) or the last error is thrown. A request
 * without the key, or with a streamed body, is sent once.
 */
export function retryingFetch(options: RetryOptions = {}): typeof fetch {
  const send = options.fetch ?? fetch;
  const budget = options.budgetMs ?? 30_000;
  const keyHeader = options.keyHeader ?? "idempotency-key";
  const backoff = options.backoffMs ?? 200;
  const maxBackoff = options.maxBackoffMs ?? 5_000;
  return async (input: RequestInfo | URL, init: RequestInit = {}): Promise<Response> => {
    const headers = new Headers(init.headers);
    const replayable = init.body === undefined || init.body === null || typeof init.body === "string" ||
      init.body instanceof Uint8Array || init.body instanceof ArrayBuffer || init.body instanceof URLSearchParams;
    if (!headers.has(keyHeader) || !replayable || input instanceof Request) {
      return send(input, init);
    }
    const started = Date.now();
    let pause = backoff;
    for (;;) {
      if (init.signal?.aborted) throw init.signal.reason;
      const signals = [init.signal, options.attemptTimeoutMs ? AbortSignal.timeout(options.attemptTimeoutMs) : null]
        .filter((s): s is AbortSignal => s instanceof AbortSignal);
      const attempt: RequestInit = { ...init, headers };
      if (signals.length > 0) attempt.signal = AbortSignal.any(signals);
      let outcome: Response | unknown;
      try {
        outcome = await send(input, attempt);
      } catch (e) {
        if (init.signal?.aborted) throw e; // the caller gave up: no retry
        outcome = e;
      }
      const verdict = await classify(outcome);
      const left = budget - (Date.now() - started);
      const final = verdict.decision === "answer" || verdict.decision === "stop" || verdict.decision === "dead-letter";
      if (final || left <= 0) {
        if (outcome instanceof Response) return outcome;
        throw outcome;
      }
      if (outcome instanceof Response) await outcome.body?.cancel();
      const wait = verdict.afterSeconds !== undefined ? verdict.afterSeconds * 1000 : pause;
      await sleep(Math.max(0, Math.min(wait, left)));
      pause = Math.min(pause * 2, maxBackoff);
    }
  };
}
