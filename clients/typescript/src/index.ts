/** The caller's half of idemgate: keys derived from an attempt's identity, and typed calls of the reservation API. */
export { DERIVE_KEY_TAG, derive_key } from "./keys.js";
export type { Attempt } from "./keys.js";
export { Client } from "./api.js";
export { classifyFailure, guard, InFlight, MAX_WAIT_SECONDS, NotExecuted } from "./guard.js";
export type { Failure, GuardOptions, Holding, Reconciliation } from "./guard.js";
export { callToolOnce, IDEMPOTENCY_KEY_ARGUMENT, toolCallKey, toolRefusal, withIdempotencyKey } from "./mcp.js";
export type { CallToolOnceOptions, ToolCaller, ToolCallParams, ToolStep } from "./mcp.js";
export { classify, isNetworkError, RELEASED, retryingFetch, UNKNOWN } from "./retry.js";
export type { Decision, RetryOptions, Verdict } from "./retry.js";
export type {
  ClientOptions, CommitOptions, Completed, Extended, LeaseExpiry, MarkedUnknown, RecoveryPoint, RequestDescription,
  ReservationRecord, Reserved, ReserveOptions, StoredResponse,
} from "./api.js";
export {
  IdemgateError, Internal, InvalidRequest, KeyInvalid, KeyMissing, KeyReused, LeaseLost, MisdirectedRequest,
  NotFound, OutcomeUnknown, PayloadTooLarge, Problem, RequestInFlight, ReservationGone, ResultNotCommitted,
  StoreUnavailable, TenantLimit, Unauthorized, errorToJSON, registerError, reviveError,
} from "./errors.js";
