// derive_key against the vectors every idemgate client shares.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { derive_key, type Attempt } from "../src/index.js";

interface Vector extends Attempt {
  key: string;
}

const vectors: Vector[] = JSON.parse(
  readFileSync(new URL("../../../vectors/derive_key.json", import.meta.url), "utf8"),
).vectors;

test("the shared vectors", () => {
  assert.ok(vectors.length > 0);
  for (const v of vectors) {
    assert.equal(derive_key(v), v.key, `${v.tenant}/${v.run}/${v.step}/${v.tool}`);
  }
});

test("the worked example of the README", () => {
  assert.equal(derive_key({ tenant: "a", run: "bc", step: "d", tool: "e" }), "c8543208-20f7-8152-9c60-7cdc8de31ca4");
});

test("a key is a UUIDv8", () => {
  for (const v of vectors) {
    assert.match(derive_key(v), /^[0-9a-f]{8}-[0-9a-f]{4}-8[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
  }
});

test("an integer step is its decimal form", () => {
  assert.equal(derive_key({ tenant: "t", run: "r", step: 7, tool: "x" }), derive_key({ tenant: "t", run: "r", step: "7", tool: "x" }));
});

test("an empty field is refused", () => {
  for (const field of ["tenant", "run", "step", "tool"] as const) {
    const attempt: Attempt = { tenant: "t", run: "r", step: "s", tool: "x", [field]: "" };
    assert.throws(() => derive_key(attempt), new RegExp(field));
  }
});

test("a step that is not an integer is refused", () => {
  assert.throws(() => derive_key({ tenant: "t", run: "r", step: 1.5, tool: "x" }), TypeError);
});
