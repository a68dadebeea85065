/**
 * Typed calls of idemgate's reservation API (`/v1/reservations`), over the
 * platform's `fetch`.
 *
 * ```ts
 * const idem = new Client("http://127.0.0.1:8080", { token });
 * const answer = await idem.reserve(key, { request: { method: "POST", path: "/charges", body } });
 * if (answer.kind === "completed") return answer.response;     // a retry: nothing runs again
 * const result = await charge(body);                           // "reserved": run the effect once
 * await idem.commit(answer.reservationId, { status: 201, body: JSON.stringify(result) });
 * ```
 *
 * A call that gets no answer (refused, reset, timed out) throws
 * `StoreUnavailable` (`answered` false) with the `fetch` error as its
 * `cause`, never the raw `fetch` error.
 */
import { problemFrom, StoreUnavailable } from "./errors.js";

/** How far an earlier holder of the key got (`checkpoint`). */
export interface RecoveryPoint {
  recoveryPoint: string;
  data: unknown;
}

/** 201: this caller holds the key and runs the effect. */
export interface Reserved {
  kind: "reserved";
  reservationId: string;
  /** 1 for a new key; more for a takeover, which must reconcile first. */
  attempt: number;
  leaseExpiresAt: Date;
  expiresAt: Date;
  recovery: RecoveryPoint | null;
}

/** A response as committed. */
export interface StoredResponse {
  status: number;
  headers: [string, string][];
  body: Uint8Array;
  text(): string;
}

/** The key's stored response; `replayed` when an earlier call stored it. */
export interface Completed {
  kind: "completed";
  response: StoredResponse;
  completedAt: Date | null;
  expiresAt: Date;
  replayed: boolean;
}

export interface Extended {
  reservationId: string;
  leaseExpiresAt: Date;
}

/** Why and when the key's holder marked it unknown (`markUnknown`). */
export interface MarkedUnknown {
  reason: string;
  at: Date;
}

/** What a reservation id shows (`get`, `checkpoint`, `markUnknown`). */
export interface ReservationRecord {
  reservationId: string;
  live: boolean;
  /** `unknown`: its holder was cut off under `hold`, and nobody knows whether the effect happened. */
  state: "in_flight" | "completed" | "unknown";
  attempt: number;
  keyHashPrefix: string;
  fingerprint: string | null;
  leaseExpiresAt: Date | null;
  recovery: RecoveryPoint | null;
  response: StoredResponse | null;
  createdAt: Date;
  completedAt: Date | null;
  expiresAt: Date;
  /** Set once the holder marked the key unknown (`markUnknown`). */
  markedUnknown: MarkedUnknown | null;
}

/** The request a reservation fingerprints. */
export interface RequestDescription {
  method?: string;
  path?: string;
  body?: unknown;
}

/**
 * What a lease that ends without a commit, release or extend means:
 * `takeover` (the server's default for the reservation API) gives the key to
 * the next caller, with the recovery point; `hold` makes its outcome unknown,
 * and every reserve of it `OutcomeUnknown` until it is settled.
 */
export type LeaseExpiry = "takeover" | "hold";

export interface ReserveOptions {
  request?: RequestDescription;
  fingerprint?: string;
  leaseSeconds?: number;
  ttlSeconds?: number;
  /** `Prefer: wait=N`: the server holds a duplicate up to N seconds for the first to finish. */
  wait?: number;
  /** What this reservation's lease ending without news means; unset, the server's default (`takeover`). */
  onLeaseExpiry?: LeaseExpiry;
  /**
   * What the key is, told for a person (an order id, a job name; at most 200
   * characters): shown to operators beside the request should the key get
   * stuck, sealed at rest with it, never part of the fingerprint.
   */
  label?: string;
}

export interface CommitOptions {
  status: number;
  headers?: [string, string][];
  /** A string is stored as it is; bytes are sent base64. */
  body?: string | Uint8Array;
}

export interface ClientOptions {
  token?: string;
  /** Milliseconds a call may take (default 30 000). */
  timeoutMs?: number;
  /** Another `fetch` (a test double, an instrumented one). */
  fetch?: typeof fetch;
}

type Json = Record<string, unknown>;

const decoder = new TextDecoder();

function date(value: unknown): Date | null {
  return typeof value === "string" ? new Date(value) : null;
}

function recovery(value: unknown): RecoveryPoint | null {
  if (value === null || typeof value !== "object") return null;
  const v = value as Json;
  return { recoveryPoint: String(v["recovery_point"]), data: v["data"] ?? null };
}

function storedResponse(value: Json): StoredResponse {
  const body =
    typeof value["body_base64"] === "string"
      ? new Uint8Array(Buffer.from(value["body_base64"], "base64"))
      : new TextEncoder().encode(typeof value["body"] === "string" ? value["body"] : "");
  const headers = Array.isArray(value["headers"])
    ? (value["headers"] as unknown[][]).map((h): [string, string] => [String(h[0]), String(h[1])])
    : [];
  return { status: Number(value["status"]), headers, body, text: () => decoder.decode(body) };
}

function completed(value: Json, replayed: boolean): Completed {
  return {
    kind: "completed",
    response: storedResponse(value["response"] as Json),
    completedAt: date(value["completed_at"]),
    expiresAt: date(value["expires_at"]) as Date,
    replayed,
  };
}

function reservationRecord(value: Json): ReservationRecord {
  return {
    reservationId: String(value["reservation_id"]),
    live: Boolean(value["live"]),
    state: value["state"] === "completed" || value["state"] === "unknown" ? value["state"] : "in_flight",
    attempt: Number(value["attempt"]),
    keyHashPrefix: String(value["key_hash_prefix"]),
    fingerprint: typeof value["fingerprint"] === "string" ? value["fingerprint"] : null,
    leaseExpiresAt: date(value["lease_expires_at"]),
    recovery: recovery(value["recovery"]),
    response: value["response"] ? storedResponse(value["response"] as Json) : null,
    createdAt: date(value["created_at"]) as Date,
    completedAt: date(value["completed_at"]),
    expiresAt: date(value["expires_at"]) as Date,
    markedUnknown: markedUnknown(value["marked_unknown"]),
  };
}

function markedUnknown(value: unknown): MarkedUnknown | null {
  if (value === null || typeof value !== "object") return null;
  const v = value as Json;
  return { reason: String(v["reason"]), at: date(v["at"]) as Date };
}

/** The reservation API of one idemgate server. */
export class Client {
  readonly #base: string;
  readonly #auth: Record<string, string>;
  readonly #timeoutMs: number;
  readonly #fetch: typeof fetch;

  constructor(baseUrl: string, options: ClientOptions = {}) {
    this.#base = baseUrl.replace(/\/+$/, "");
    this.#auth = options.token ? { authorization: `Bearer ${options.token}` } : {};
    this.#timeoutMs = options.timeoutMs ?? 30_000;
    this.#fetch = options.fetch ?? fetch;
  }

  async #call(method: string, path: string, body?: Json, headers: Record<string, string> = {}): Promise<Response> {
    const init: RequestInit = {
      method,
      headers: { ...this.#auth, ...headers, ...(body === undefined ? {} : { "content-type": "application/json" }) },
      signal: AbortSignal.timeout(this.#timeoutMs),
    };
    if (body !== undefined) init.body = JSON.stringify(body);
    let response: Response;
    try {
      response = await this.#fetch(`${this.#base}${path}`, init);
    } catch (e) {
      // No answer (refused, reset, timed out): idemgate's error, the fetch one its cause.
      throw StoreUnavailable.unreachable(method, path, e);
    }
    if (!response.ok) throw await problemFrom(response);
    return response;
  }

  /**
   * Reserves `key` (`reserved`) or returns its stored response (`completed`).
   * Throws `RequestInFlight` while another holder runs, `OutcomeUnknown` when
   * a holder was cut off and nobody knows whether its effect happened (never
   * retried: the dead-letter queue's case), `KeyReused` for another payload
   * under the key.
   */
  async reserve(key: string, options: ReserveOptions = {}): Promise<Reserved | Completed> {
    const body: Json = {};
    if (options.request !== undefined) body["request"] = options.request;
    if (options.fingerprint !== undefined) body["fingerprint"] = options.fingerprint;
    if (options.leaseSeconds !== undefined) body["lease_seconds"] = options.leaseSeconds;
    if (options.ttlSeconds !== undefined) body["ttl_seconds"] = options.ttlSeconds;
    if (options.onLeaseExpiry !== undefined) body["on_lease_expiry"] = options.onLeaseExpiry;
    if (options.label !== undefined) body["label"] = options.label;
    const headers: Record<string, string> = { "idempotency-key": key };
    if (options.wait !== undefined && options.wait > 0) headers["prefer"] = `wait=${options.wait}`;
    const response = await this.#call("POST", "/v1/reservations", body, headers);
    const value = (await response.json()) as Json;
    if (response.status === 201) {
      return {
        kind: "reserved",
        reservationId: String(value["reservation_id"]),
        attempt: Number(value["attempt"]),
        leaseExpiresAt: date(value["lease_expires_at"]) as Date,
        expiresAt: date(value["expires_at"]) as Date,
        recovery: recovery(value["recovery"]),
      };
    }
    return completed(value, response.headers.get("idempotent-replayed") === "true");
  }

  /** Stores the effect's response and completes the key. */
  async commit(reservationId: string, options: CommitOptions): Promise<Completed> {
    const body: Json = { status: options.status, headers: options.headers ?? [] };
    if (typeof options.body === "string") body["body"] = options.body;
    else if (options.body !== undefined) body["body_base64"] = Buffer.from(options.body).toString("base64");
    const response = await this.#call("POST", `/v1/reservations/${reservationId}/commit`, body);
    return completed((await response.json()) as Json, false);
  }

  /** Gives the key up: the effect did not happen, a retry may run it. */
  async release(reservationId: string): Promise<void> {
    await this.#call("POST", `/v1/reservations/${reservationId}/release`);
  }

  /**
   * Says that the holder cannot tell whether its effect happened (its call
   * timed out after the request went out): the key turns `unknown` at once,
   * whatever its `onLeaseExpiry`, and every reserve of it throws
   * `OutcomeUnknown` until this holder's late commit or release, or an
   * operator, settles it. `reason` (1 to 1000 characters) is kept for that
   * operator: what failed, never a body or a secret. Marking a key this id
   * marked already resolves to the record again (its first reason stays); a
   * dead id throws `LeaseLost`.
   */
  async markUnknown(reservationId: string, reason: string): Promise<ReservationRecord> {
    const response = await this.#call("POST", `/v1/reservations/${reservationId}/unknown`, { reason });
    return reservationRecord((await response.json()) as Json);
  }

  /** Keeps holding the key while a long effect runs. */
  async extend(reservationId: string, leaseSeconds?: number): Promise<Extended> {
    const body: Json = leaseSeconds === undefined ? {} : { lease_seconds: leaseSeconds };
    const value = (await (await this.#call("POST", `/v1/reservations/${reservationId}/extend`, body)).json()) as Json;
    return { reservationId: String(value["reservation_id"]), leaseExpiresAt: date(value["lease_expires_at"]) as Date };
  }

  /** Records how far a multi-step effect got, for a holder that takes over. */
  async checkpoint(reservationId: string, recoveryPoint: string, data?: unknown): Promise<ReservationRecord> {
    const body: Json = { recovery_point: recoveryPoint };
    if (data !== undefined) body["data"] = data;
    const response = await this.#call("POST", `/v1/reservations/${reservationId}/checkpoint`, body);
    return reservationRecord((await response.json()) as Json);
  }

  /** What the reservation id shows now. */
  async get(reservationId: string): Promise<ReservationRecord> {
    const response = await this.#call("GET", `/v1/reservations/${reservationId}`);
    return reservationRecord((await response.json()) as Json);
  }
}
