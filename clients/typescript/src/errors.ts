/**
 * idemgate's problem+json answers as errors, one class per problem type.
 * Each carries the HTTP status, the problem's `type`, `title` and `detail`,
 * and where the server sent them `retryAfter` (seconds) and `leaseExpiresAt`.
 * `OutcomeUnknown` also says why the step belongs in the caller's
 * dead-letter queue (`deadLetterReason`).
 *
 * A call that gets no answer (refused, reset, timed out) throws
 * `StoreUnavailable` too, with `answered` false and the `fetch` error as its
 * `cause`; `ResultNotCommitted`, a `StoreUnavailable`, is a guard's commit
 * that found no server for its whole budget, and carries the effect's
 * `result`.
 *
 * Across a process or thread boundary: every error's fields are own
 * enumerable properties, with its class in `name`, and `toJSON()` gives
 * them as a plain object; `reviveError(json)` turns that object (after
 * `JSON.stringify`/`JSON.parse`, or a `structuredClone` or `postMessage` of
 * it) back into an instance of the right class with every field. A
 * `structuredClone` of the error itself cannot keep them: V8 clones any
 * Error subclass as a plain `Error` with only `message`, `stack` and `cause`
 * (and `name` only for the built-in error types). `reviveError` of such a
 * clone gets the class back from its `stack`, and a problem's `status`,
 * slug and `detail` from its message; the rest is lost on that path, so send
 * `error.toJSON()`.
 */

type ErrorClass = abstract new (...args: never[]) => Error;

/** The classes `reviveError` knows, by `name`. */
const REVIVABLE = new Map<string, ErrorClass>();

/**
 * Registers a class for `reviveError` (the package's own are registered),
 * with the fields its constructor may leave undefined.
 */
export function registerError(cls: ErrorClass, name: string = cls.name, optional: string[] = []): void {
  REVIVABLE.set(name, cls);
  if (optional.length > 0) OPTIONAL_BY_CLASS.push([cls, optional]);
}

/** Which classes' constructors set which optional fields (registered with `registerError`). */
const OPTIONAL_BY_CLASS: Array<[ErrorClass, string[]]> = [];

/** The fields a class's constructor (or a parent's) may leave undefined, which JSON drops. */
function optionalFields(cls: ErrorClass): string[] {
  return OPTIONAL_BY_CLASS.filter(([parent]) => cls === parent || cls.prototype instanceof parent).flatMap(([, fields]) => fields);
}

/** The fields that are Dates, sent as ISO strings by `toJSON`. */
const DATE_FIELDS = new Set(["leaseExpiresAt"]);

/** An error's own enumerable fields, its `name` and `message`, as a plain object. */
export function errorToJSON(error: Error): Record<string, unknown> {
  const fields: Record<string, unknown> = {};
  for (const [field, value] of Object.entries(error)) {
    if (field === "cause" || typeof value === "function") continue;
    fields[field] = value instanceof Date ? value.toISOString() : value;
  }
  return { ...fields, name: error.name, message: error.message };
}

/**
 * The error a `toJSON()` object (or a `structuredClone` of an error, as far
 * as it goes: see the module's doc) stands for, as an instance of its class;
 * `undefined` when `value` names none of the registered classes.
 */
export function reviveError(value: unknown): Error | undefined {
  if (value === null || typeof value !== "object") return undefined;
  const seen = value as Record<string, unknown>;
  const message = typeof seen["message"] === "string" ? seen["message"] : "";
  let name = typeof seen["name"] === "string" ? seen["name"] : "";
  let fields: Record<string, unknown> = {};
  if (value instanceof Error) {
    // A structuredClone: its own properties are gone; its stack still says its class.
    const stack = typeof value.stack === "string" ? value.stack : "";
    const first = /^([A-Za-z_$][\w$]*)(?::|$)/.exec(stack);
    name = REVIVABLE.has(name) && name !== "Error" ? name : (first?.[1] ?? name);
    const problem = /^(\d{3}) ([a-z-]+): ([\s\S]*)$/.exec(message);
    if (problem !== null) fields = { status: Number(problem[1]), type: problem[2], detail: problem[3], body: { type: problem[2], detail: problem[3] } };
    fields["name"] = name;
  } else {
    fields = { ...seen };
  }
  const cls = REVIVABLE.get(name);
  if (cls === undefined) return undefined;
  const error = Object.create(cls.prototype) as Error;
  Object.defineProperty(error, "message", { value: message, writable: true, configurable: true, enumerable: false });
  for (const [field, got] of Object.entries(fields)) {
    if (field === "message" || field === "stack" || isAccessor(cls.prototype, field)) continue;
    (error as unknown as Record<string, unknown>)[field] = DATE_FIELDS.has(field) && typeof got === "string" ? new Date(got) : got;
  }
  for (const field of optionalFields(cls)) {
    // JSON drops an undefined field: it comes back as the constructor left it.
    if (!(field in fields)) {
      (error as unknown as Record<string, unknown>)[field] = undefined;
    }
  }
  const stack = seen["stack"];
  Object.defineProperty(error, "stack", {
    value: typeof stack === "string" ? stack : `${name}: ${message}`, writable: true, configurable: true, enumerable: false,
  });
  return error;
}

/** Whether `field` is a getter somewhere on `proto`'s chain (computed, never assigned). */
function isAccessor(proto: object | null, field: string): boolean {
  for (let at = proto; at !== null; at = Object.getPrototypeOf(at) as object | null) {
    const found = Object.getOwnPropertyDescriptor(at, field);
    if (found !== undefined) return found.get !== undefined;
  }
  return false;
}

/** Anything this package throws about idemgate's answers. */
export class IdemgateError extends Error {
  override name = "IdemgateError";

  /** The error's class (`name`), message and fields, for `JSON.stringify` or a `structuredClone`. */
  toJSON(): Record<string, unknown> {
    return errorToJSON(this);
  }

  /** The error a `toJSON()` object stands for (see `reviveError`). */
  static revive(value: unknown): Error | undefined {
    return reviveError(value);
  }
}

/** A problem+json answer (RFC 9457); subclasses name the problem types. */
export class Problem extends IdemgateError {
  override name = "Problem";
  static readonly slug: string = "";
  readonly type: string;
  readonly title: string;
  readonly detail: string;

  constructor(
    readonly status: number,
    readonly body: Record<string, unknown>,
    readonly retryAfter: number | undefined,
    options?: { cause?: unknown },
  ) {
    const type = typeof body["type"] === "string" ? body["type"] : "";
    const detail = typeof body["detail"] === "string" ? body["detail"] : "";
    const title = typeof body["title"] === "string" ? body["title"] : "";
    super(`${status} ${type.split("/").pop() || "problem"}: ${detail || title}`, options);
    this.type = type;
    this.title = title;
    this.detail = detail;
  }

  /** When the key's current holder's lease ends (409 answers). */
  get leaseExpiresAt(): Date | undefined {
    const at = this.body["lease_expires_at"];
    return typeof at === "string" ? new Date(at) : undefined;
  }
}

export class InvalidRequest extends Problem { static override readonly slug = "invalid-request"; override name = "InvalidRequest"; }
export class KeyMissing extends Problem { static override readonly slug = "key-missing"; override name = "KeyMissing"; }
export class KeyInvalid extends Problem { static override readonly slug = "key-invalid"; override name = "KeyInvalid"; }
export class Unauthorized extends Problem { static override readonly slug = "unauthorized"; override name = "Unauthorized"; }
export class NotFound extends Problem { static override readonly slug = "not-found"; override name = "NotFound"; }
/** 421: the server answers only requests for its own address or a name of its `IDEMGATE_ALLOWED_HOSTS`. */
export class MisdirectedRequest extends Problem { static override readonly slug = "misdirected-request"; override name = "MisdirectedRequest"; }
/** 409: the key's first request is still running; wait and retry the same key. */
export class RequestInFlight extends Problem { static override readonly slug = "request-in-flight"; override name = "RequestInFlight"; }
/**
 * 409: whether the key's first request took effect is unknown (its holder
 * was cut off), so nothing runs it again. Never retried, under this key or a
 * new one: the step goes to the dead-letter queue, and an operator settles
 * the key (`idemgate keys`): released, the next request executes; completed,
 * every retry replays the response that really happened.
 */
export class OutcomeUnknown extends Problem {
  static override readonly slug = "outcome-unknown";
  override name = "OutcomeUnknown";
  /** The reason the step is put in the dead-letter queue with. */
  get deadLetterReason(): "outcome_unknown" {
    return "outcome_unknown";
  }
}
/** 409: this reservation id no longer holds its key. */
export class LeaseLost extends Problem { static override readonly slug = "lease-lost"; override name = "LeaseLost"; }
export class ReservationGone extends Problem { static override readonly slug = "reservation-gone"; override name = "ReservationGone"; }
export class PayloadTooLarge extends Problem { static override readonly slug = "payload-too-large"; override name = "PayloadTooLarge"; }
/** 422: the key was used with another payload. Never retried. */
export class KeyReused extends Problem { static override readonly slug = "key-reused"; override name = "KeyReused"; }
export class TenantLimit extends Problem { static override readonly slug = "tenant-limit"; override name = "TenantLimit"; }
/**
 * 503: idemgate's database is away (the server said so), or idemgate did not
 * answer at all (`answered` false: refused, reset, timed out; the `fetch`
 * error is the `cause`). Retry later, the same key.
 */
export class StoreUnavailable extends Problem {
  static override readonly slug = "store-unavailable";
  override name = "StoreUnavailable";

  /** False when no answer came (a transport failure), not a 503. */
  get answered(): boolean {
    return this.body["answered"] !== false;
  }

  /** The error for a call that got no answer; `error` is its `cause`. */
  static unreachable(method: string, path: string, error: unknown): StoreUnavailable {
    // The error's type only: its message could carry a URL's secrets.
    const kind = error instanceof Error ? error.name : typeof error;
    return new StoreUnavailable(503, {
      type: "store-unavailable",
      title: "idemgate did not answer",
      detail: `no answer from idemgate to ${method} ${path} (${kind})`,
      answered: false,
    }, undefined, { cause: error });
  }
}

/**
 * A guard's effect acted and returned `result`, but its commit found no
 * idemgate for the guard's whole `commitBudgetMs`. The key is still in flight
 * under `reservationId`: under `hold` it turns unknown when its lease ends,
 * and an operator completes it with this result (`encodedResult`, the body
 * the guard tried to commit); a late commit by this holder is accepted as
 * well. Not retried: the effect acted.
 */
export class ResultNotCommitted extends StoreUnavailable {
  override name = "ResultNotCommitted";
  /** The reason the step is put in the dead-letter queue with. */
  get deadLetterReason(): "result_not_committed" {
    return "result_not_committed";
  }
  reservationId = "";
  result: unknown = undefined;
  encodedResult = "";
  waitedMs = 0;

  static of(reservationId: string, result: unknown, encodedResult: string, waitedMs: number, last: Problem): ResultNotCommitted {
    const error = new ResultNotCommitted(last.status, {
      type: "store-unavailable",
      title: "The result was not committed",
      detail: `the effect acted, but its result could not be committed for ${(waitedMs / 1000).toFixed(1)} s ` +
        `(${last.detail || last.title}); it is kept in this error`,
      answered: last instanceof StoreUnavailable ? last.answered : true,
    }, last.retryAfter, { cause: last });
    error.reservationId = reservationId;
    error.result = result;
    error.encodedResult = encodedResult;
    error.waitedMs = waitedMs;
    return error;
  }
}
export class Internal extends Problem { static override readonly slug = "internal"; override name = "Internal"; }

for (const cls of [
  IdemgateError, Problem, InvalidRequest, KeyMissing, KeyInvalid, Unauthorized, NotFound, MisdirectedRequest, RequestInFlight,
  OutcomeUnknown, LeaseLost, ReservationGone, PayloadTooLarge, KeyReused, TenantLimit, StoreUnavailable, ResultNotCommitted,
  Internal,
]) registerError(cls, cls.name, cls === Problem ? ["retryAfter"] : []);

const BY_SLUG = new Map<string, typeof Problem>(
  [
    InvalidRequest, KeyMissing, KeyInvalid, Unauthorized, NotFound, MisdirectedRequest, RequestInFlight, OutcomeUnknown, LeaseLost,
    ReservationGone, PayloadTooLarge, KeyReused, TenantLimit, StoreUnavailable, Internal,
  ].map((cls) => [cls.slug, cls]),
);

/**
 * The error for a problem carried in another form than an HTTP answer (an
 * MCP tool result's `structuredContent`), or undefined when `body.type` names
 * none of idemgate's problems (it must be the problem's name or end in
 * `/` and it).
 */
export function problemOf(status: number, body: Record<string, unknown>, retryAfter: number | undefined): Problem | undefined {
  const type = body["type"];
  if (typeof type !== "string") return undefined;
  const slug = type.split("/").pop() ?? "";
  const cls = BY_SLUG.get(slug);
  return cls === undefined ? undefined : new cls(status, body, retryAfter);
}

/** The error for an answer that is not a success. */
export async function problemFrom(response: Response): Promise<Problem> {
  let body: Record<string, unknown> = {};
  const text = await response.text();
  try {
    const parsed: unknown = JSON.parse(text);
    if (parsed !== null && typeof parsed === "object" && !Array.isArray(parsed)) {
      body = parsed as Record<string, unknown>;
    }
  } catch {
    body = { title: response.statusText, detail: text.slice(0, 200) };
  }
  const slug = typeof body["type"] === "string" ? (body["type"].split("/").pop() ?? "") : "";
  const header = response.headers.get("retry-after")?.trim();
  const retryAfter = header !== undefined && /^\d+$/.test(header) ? Number(header) : undefined;
  const cls = BY_SLUG.get(slug) ?? Problem;
  return new cls(response.status, body, retryAfter);
}
