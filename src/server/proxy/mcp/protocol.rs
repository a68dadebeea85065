//! The MCP protocol version a call names, and the results the door writes
//! itself (refusals, replays) as that version reads them.
//!
//! Since 2026-07-28 every result carries `resultType` (`"complete"` for a
//! final one): a client of that version refuses a `CallToolResult` without
//! it. Earlier versions have no such member and read its absence as
//! `"complete"`. The version is the `MCP-Protocol-Version` header, which
//! clients send on every request after the handshake (on every request at
//! all since 2026-07-28), or the request's
//! `_meta["io.modelcontextprotocol/protocolVersion"]`.

use http::HeaderMap;
use serde_json::Value;

/// The first version whose results carry `resultType`.
const TYPED_RESULTS_SINCE: &str = "2026-07-28";

/// The header that names a request's protocol version.
const VERSION_HEADER: &str = "mcp-protocol-version";

/// Where a 2026-07-28 request's `_meta` names its version.
const VERSION_META: &str = "/params/_meta/io.modelcontextprotocol~1protocolVersion";

/// What the protocol version of a call asks of a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Protocol {
    /// Results carry `resultType`.
    typed_results: bool,
}

impl Protocol {
    /// The protocol of a request with these headers and this message.
    pub(super) fn of(headers: &HeaderMap, message: &Value) -> Protocol {
        let version = headers
            .get(VERSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .or_else(|| message.pointer(VERSION_META).and_then(Value::as_str));
        Protocol {
            typed_results: version.is_some_and(typed_results),
        }
    }

    /// Whether a refusal's problem may go in `structuredContent` even for a
    /// tool with an output schema: clients of this version check only a
    /// successful result's `structuredContent` against it.
    pub(super) fn structures_every_error(self) -> bool {
        self.typed_results
    }

    /// `result`, a final result, as this version reads it: with
    /// `"resultType": "complete"` where results carry it, without where
    /// they do not (absent means complete there).
    pub(super) fn complete(self, result: &mut Value) {
        let Some(result) = result.as_object_mut() else {
            return;
        };
        if self.typed_results {
            result
                .entry("resultType")
                .or_insert_with(|| Value::from("complete"));
        } else if result.get("resultType").and_then(Value::as_str) == Some("complete") {
            result.remove("resultType");
        }
    }
}

/// Whether `version` (a date, `YYYY-MM-DD`) is 2026-07-28 or later.
fn typed_results(version: &str) -> bool {
    let dated = version.len() == 10
        && version.bytes().enumerate().all(|(i, b)| {
            if i == 4 || i == 7 {
                b == b'-'
            } else {
                b.is_ascii_digit()
            }
        });
    dated && version >= TYPED_RESULTS_SINCE
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;
    use serde_json::json;

    use super::*;

    fn with_header(version: &'static str) -> Protocol {
        let mut headers = HeaderMap::new();
        headers.insert(VERSION_HEADER, HeaderValue::from_static(version));
        Protocol::of(&headers, &json!({}))
    }

    #[test]
    fn results_are_typed_from_2026_07_28_by_header_or_meta() {
        assert!(with_header("2026-07-28").typed_results);
        assert!(with_header("2027-01-01").typed_results);
        assert!(!with_header("2025-11-25").typed_results);
        assert!(!with_header("2025-06-18").typed_results);
        assert!(!with_header("draft").typed_results);
        let meta = json!({ "params": { "_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28" } } });
        assert!(Protocol::of(&HeaderMap::new(), &meta).typed_results);
        assert!(!Protocol::of(&HeaderMap::new(), &json!({})).typed_results);
    }

    #[test]
    fn a_result_gains_or_loses_its_result_type_by_version() {
        let mut result = json!({ "content": [], "isError": true });
        with_header("2026-07-28").complete(&mut result);
        assert_eq!(result["resultType"], "complete");
        with_header("2025-11-25").complete(&mut result);
        assert!(result.get("resultType").is_none());
        let mut pending = json!({ "resultType": "input_required" });
        with_header("2025-11-25").complete(&mut pending);
        with_header("2026-07-28").complete(&mut pending);
        assert_eq!(pending["resultType"], "input_required");
    }
}
