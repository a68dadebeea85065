/**
 * idemgate's problem+json answers as errors, one class per problem type.
 * Each carries the HTTP status, the problem's `type`, `title` and `detail`,
 * and where the server sent them `retryAfter` (seconds) and `leaseExpiresAt`.
 * `OutcomeUnknown` also says why the step belongs in the caller's
 * dead-letter queue (`deadLetterReason`).
 */

/** Anything this package throws about idemgate's answers. */
export class IdemgateError extends Error {
  override name = "IdemgateError";
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
  ) {
    const type = typeof body["type"] === "string" ? body["type"] : "";
    const detail = typeof body["detail"] === "string" ? body["detail"] : "";
    const title = typeof body["title"] === "string" ? body["title"] : "";
    super(`${status} ${type.split("/").pop() || "problem"}: ${detail || title}`);
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
  readonly deadLetterReason = "outcome_unknown";
}
/** 409: this reservation id no longer holds its key. */
export class LeaseLost extends Problem { static override readonly slug = "lease-lost"; override name = "LeaseLost"; }
export class ReservationGone extends Problem { static override readonly slug = "reservation-gone"; override name = "ReservationGone"; }
export class PayloadTooLarge extends Problem { static override readonly slug = "payload-too-large"; override name = "PayloadTooLarge"; }
/** 422: the key was used with another payload. Never retried. */
export class KeyReused extends Problem { static override readonly slug = "key-reused"; override name = "KeyReused"; }
export class TenantLimit extends Problem { static override readonly slug = "tenant-limit"; override name = "TenantLimit"; }
export class StoreUnavailable extends Problem { static override readonly slug = "store-unavailable"; override name = "StoreUnavailable"; }
export class Internal extends Problem { static override readonly slug = "internal"; override name = "Internal"; }

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
