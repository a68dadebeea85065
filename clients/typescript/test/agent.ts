// An agent process for the crash test: runs guard on a key whose effect
// records its progress, says so on stdout, and then hangs until it is killed.
import { Client, guard } from "../src/index.js";

// mode: "takeover" (the caller's own choice: the effect reconciles by
// itself), "reconcile" (a reconcile option, so takeover) or "default" (hold).
const [url, token, key, mode] = process.argv.slice(2) as [string, string, string, string];
await guard(new Client(url, { token }), key, async (holding) => {
  await holding.checkpoint("charge-sent", { charge: "ch_42" });
  process.stdout.write(`acted ${holding.attempt}\n`);
  await new Promise((r) => setTimeout(r, 60_000));
  return { charge: "never" };
}, {
  request: { method: "POST", path: "/charges", body: { amount: 500 } },
  leaseSeconds: 2,
  ...(mode === "takeover" ? { onLeaseExpiry: "takeover" as const } : {}),
  ...(mode === "reconcile" ? { reconcile: () => ({ found: false as const }) } : {}),
});
