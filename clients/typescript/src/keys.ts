/**
 * Idempotency keys minted from the identity of an attempt.
 *
 * A retry must send the key its first attempt sent, so the key is derived,
 * not drawn at random: from who asks (the tenant), which run of the agent or
 * job, which step of that run, and which tool the step calls. Never from the
 * model's `tool_call_id`, a timestamp or a retry counter, and never from
 * personal data.
 *
 * The encoding is the same in every idemgate client (clients/README.md):
 * SHA-256 over `idemgate.derive_key.v1` followed by each field's name and
 * value, each as a 4-byte big-endian length and its UTF-8 bytes, in the order
 * tenant, run, step, tool; the first 16 bytes of the digest, with the version
 * and variant bits of a UUIDv8 (RFC 9562), in the hyphenated form.
 */
import { createHash } from "node:crypto";

/** What the digest starts with: the encoding's name and version. */
export const DERIVE_KEY_TAG = "idemgate.derive_key.v1";

/** The identity of one attempt. */
export interface Attempt {
  tenant: string;
  run: string;
  /** A number is taken in its decimal form. */
  step: string | number;
  tool: string;
}

const FIELDS = ["tenant", "run", "step", "tool"] as const;

function part(data: Buffer): Buffer {
  const length = Buffer.alloc(4);
  length.writeUInt32BE(data.length);
  return Buffer.concat([length, data]);
}

/** The idempotency key of one attempt: the same for every retry of it. */
export function derive_key(attempt: Attempt): string {
  const hash = createHash("sha256").update(DERIVE_KEY_TAG, "utf8");
  for (const name of FIELDS) {
    const given: unknown = attempt[name];
    let value: string;
    if (typeof given === "string") {
      value = given;
    } else if (name === "step" && typeof given === "number" && Number.isSafeInteger(given)) {
      value = String(given);
    } else {
      throw new TypeError(`derive_key: ${name} must be a string${name === "step" ? " or an integer" : ""}`);
    }
    if (value === "") {
      throw new RangeError(`derive_key: ${name} is empty`);
    }
    hash.update(part(Buffer.from(name, "utf8")));
    hash.update(part(Buffer.from(value, "utf8")));
  }
  const raw = hash.digest().subarray(0, 16);
  raw[6] = (raw[6]! & 0x0f) | 0x80; // version 8: a custom, name-based UUID
  raw[8] = (raw[8]! & 0x3f) | 0x80; // the RFC 9562 variant
  const hex = raw.toString("hex");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}
