/**
 * MCP tool calls that run once per step: for the official TypeScript SDK's
 * `Client` (`@modelcontextprotocol/sdk`) or anything with its `callTool`, in
 * front of a server that honours an `idempotency_key` argument — one behind
 * `idemgate proxy --protocol mcp`, or one that dedupes itself. Any transport:
 * a local server the client starts as a command (`StdioClientTransport`)
 * gets idemgate's stdio door by starting `idemgate proxy --protocol mcp
 * --stdio -- COMMAND ARGS…` in its place.
 *
 * ```ts
 * const result = await callToolOnce(client, { name: "charge", arguments: { customer, amount } },
 *   { tenant: "acme", run: runId, step: 3 });
 * ```
 *
 * - the key is `derive_key` of the step's identity (the tool defaults to the
 *   call's name), the same for every retry of the step, and goes into the
 *   call's arguments as `idempotency_key`;
 * - a result refused with `request-in-flight` (the first call with the key
 *   is still running past the door's wait) is waited for: the call is
 *   repeated with the same key after `retry_after_seconds`, within
 *   `waitBudgetMs`, then `InFlight` is thrown (for the dead-letter queue,
 *   never for a retry under a new key);
 * - `key-reused` (the key with other arguments), `outcome-unknown` (whether
 *   the first call took effect is unknown), `key-invalid` and the door's
 *   other refusals are thrown as this package's errors (`KeyReused`,
 *   `OutcomeUnknown`, ...) and never retried;
 * - any other result, an `isError` of the tool's own included, is returned
 *   as the client gave it; what the client throws (a JSON-RPC error, a
 *   timeout, a dropped connection) is thrown as it is: retry the step, and
 *   so the same key, later.
 *
 * The package takes no dependency on the SDK: `ToolCaller` is the shape of
 * the SDK's `Client.callTool`.
 */
import { InFlight } from "./guard.js";
import { problemOf, RequestInFlight, type Problem } from "./errors.js";
import { derive_key, type Attempt } from "./keys.js";

/** The argument that carries the key, as idemgate's MCP door and the agent runtimes name it. */
export const IDEMPOTENCY_KEY_ARGUMENT = "idempotency_key";

/** A `tools/call` request's params, as the SDK's `callTool` takes them. */
export interface ToolCallParams {
  name: string;
  arguments?: Record<string, unknown> | undefined;
  [other: string]: unknown;
}

/**
 * What `callToolOnce` needs of a client: the SDK's `Client` has it, with
 * `O` its `RequestOptions` (`timeout`, `signal`, ...).
 */
export interface ToolCaller<R, O = unknown> {
  callTool(params: ToolCallParams, resultSchema?: undefined, options?: O): Promise<R>;
}

/** The step a tool call belongs to; `tool` defaults to the call's name. */
export type ToolStep = Omit<Attempt, "tool"> & { tool?: string };

export interface CallToolOnceOptions<O = unknown> {
  /**
   * How long to keep repeating a call refused with `request-in-flight`
   * (default 30 000 ms). Checked between calls: each call may itself be held
   * by the door for its wait (`--default-wait`, 10 s) before it is refused.
   */
  waitBudgetMs?: number;
  /** Passed to each `callTool` as its options (the SDK's `RequestOptions`). */
  requestOptions?: O;
}

/** The key of a step's tool call: `derive_key` of its identity, the tool being the call's name unless the step names one. */
export function toolCallKey(step: ToolStep, toolName: string): string {
  return derive_key({ tenant: step.tenant, run: step.run, step: step.step, tool: step.tool ?? toolName });
}

/**
 * The call with `key` as its `idempotency_key` argument (a copy; the params
 * given are not changed). A call that already carries another key is refused
 * (`TypeError`): one step, one key.
 */
export function withIdempotencyKey<P extends ToolCallParams>(params: P, key: string): P {
  const given = params.arguments?.[IDEMPOTENCY_KEY_ARGUMENT];
  if (given !== undefined && given !== key) {
    throw new TypeError(`callToolOnce: the call already carries another ${IDEMPOTENCY_KEY_ARGUMENT} (${String(given)})`);
  }
  return { ...params, arguments: { ...(params.arguments ?? {}), [IDEMPOTENCY_KEY_ARGUMENT]: key } };
}

/** Where the door's refusals carry their problem in a result's `_meta`. */
export const PROBLEM_META = "dev.idemgate/problem";

/**
 * The idemgate refusal a tool result carries, or undefined: an `isError`
 * result whose `_meta["dev.idemgate/problem"]` (or `structuredContent`) is
 * one of idemgate's problems (its `type` ends in a problem's name, e.g.
 * `.../request-in-flight`).
 */
export function toolRefusal(result: unknown): Problem | undefined {
  if (result === null || typeof result !== "object") return undefined;
  const { isError, structuredContent, _meta } = result as {
    isError?: unknown;
    structuredContent?: unknown;
    _meta?: unknown;
  };
  if (isError !== true) return undefined;
  // The door puts the problem in `_meta` always, and in `structuredContent`
  // unless the tool declares an output schema (which the SDK would check it
  // against).
  const meta = _meta !== null && typeof _meta === "object" ? (_meta as Record<string, unknown>)[PROBLEM_META] : undefined;
  const found = meta ?? structuredContent;
  if (found === null || typeof found !== "object") return undefined;
  const body = found as Record<string, unknown>;
  const seconds = body["retry_after_seconds"];
  const retryAfter = typeof seconds === "number" && Number.isFinite(seconds) && seconds >= 0 ? seconds : undefined;
  return problemOf(typeof body["status"] === "number" ? body["status"] : 0, body, retryAfter);
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/**
 * Calls a tool once for a step: with the step's key as its
 * `idempotency_key`, waiting out `request-in-flight`, throwing idemgate's
 * other refusals. Resolves to the client's result: the first execution's,
 * whichever call of the step ran it.
 */
export async function callToolOnce<R, O = unknown>(
  client: ToolCaller<R, O>,
  params: ToolCallParams,
  step: ToolStep,
  options: CallToolOnceOptions<O> = {},
): Promise<R> {
  const key = toolCallKey(step, params.name);
  const call = withIdempotencyKey(params, key);
  const budget = options.waitBudgetMs ?? 30_000;
  const started = Date.now();
  for (;;) {
    const result = options.requestOptions === undefined
      ? await client.callTool(call)
      : await client.callTool(call, undefined, options.requestOptions);
    const refusal = toolRefusal(result);
    if (refusal === undefined) return result;
    if (!(refusal instanceof RequestInFlight)) throw refusal;
    const waited = Date.now() - started;
    if (waited >= budget) throw new InFlight(key, waited, refusal.leaseExpiresAt);
    await sleep(Math.min(budget - waited, (refusal.retryAfter ?? 1) * 1000));
  }
}
