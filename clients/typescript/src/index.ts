/** The caller's half of idemgate: keys, and (to come) the reservation API. */
export { DERIVE_KEY_TAG, derive_key } from "./keys.js";
export type { Attempt } from "./keys.js";
