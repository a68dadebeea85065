//! Which tools are guarded, learnt from the server's `tools/list` answers,
//! and those answers as clients get them: each guarded tool's input schema
//! with an optional `idempotency_key` (the first `argument:` place of
//! `IDEMGATE_MCP_KEY_FROM`).

use std::collections::HashMap;
use std::sync::RwLock;

use serde_json::{Value, json};

/// What the key argument is described as in a guarded tool's schema.
const KEY_DESCRIPTION: &str = "Idempotency key: the same string for every repeat of this call \
    (a retry, a resumed step), a new one for a new call. A repeat with the same key and the same \
    arguments gets the first call's result and does not run the tool again.";

/// What the door knows of a tool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Tool {
    /// Annotated `readOnlyHint: true`.
    pub read_only: bool,
    /// The key arguments (`argument:` places) its input schema declares
    /// itself: those are the tool's, and are forwarded.
    pub declared_keys: Vec<String>,
    /// It declares an `outputSchema` that a problem document would not
    /// satisfy: clients check a result's `structuredContent` against it (the
    /// TypeScript SDK, error results included), so a refusal must not carry
    /// its problem there.
    pub typed_output: bool,
}

/// The tools of the upstream, as its last `tools/list` answers said, and
/// the operator's choice of guarded tools.
#[derive(Debug, Default)]
pub(super) struct Catalogue {
    /// `IDEMGATE_MCP_TOOLS`: `None` guards what is not read-only.
    named: Option<Vec<String>>,
    /// `IDEMGATE_MCP_ADVERTISE_KEY`: add the key argument to guarded tools'
    /// input schemas.
    advertise: bool,
    /// The arguments that are key places (`IDEMGATE_MCP_KEY_FROM`), in
    /// order: the first is the one advertised.
    key_arguments: Vec<String>,
    tools: RwLock<HashMap<String, Tool>>,
}

impl Tool {
    /// Whether the tool declares the key argument `name` itself.
    pub(super) fn declares(&self, name: &str) -> bool {
        self.declared_keys.iter().any(|n| n == name)
    }
}

impl Catalogue {
    pub(super) fn new(
        named: Option<Vec<String>>,
        advertise: bool,
        key_arguments: Vec<String>,
    ) -> Catalogue {
        let named = named.map(|names| {
            names
                .into_iter()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect()
        });
        Catalogue {
            named,
            advertise,
            key_arguments,
            tools: RwLock::default(),
        }
    }

    /// What is known of tool `name` (nothing: a tool never listed).
    pub(super) fn tool(&self, name: &str) -> Tool {
        let tools = self.tools.read().unwrap_or_else(|e| e.into_inner());
        tools.get(name).cloned().unwrap_or_default()
    }

    /// Whether calls of tool `name` are guarded: named by the operator, or,
    /// without names, not annotated read-only (a tool never listed is
    /// guarded: a write tool unprotected is the costlier mistake).
    pub(super) fn guarded(&self, name: &str) -> bool {
        match &self.named {
            Some(names) => names.iter().any(|n| n == "*" || n == name),
            None => !self.tool(name).read_only,
        }
    }

    /// Learns the tools of a `tools/list` result and adds the key argument
    /// to each guarded one's input schema (unless told not to advertise it,
    /// or no key place is an argument, or the tool declares a key argument
    /// itself).
    pub(super) fn list(&self, result: &mut Value) {
        let Some(tools) = result.get_mut("tools").and_then(Value::as_array_mut) else {
            return;
        };
        let mut learnt = Vec::with_capacity(tools.len());
        for tool in tools.iter() {
            let Some(name) = tool.get("name").and_then(Value::as_str) else {
                continue;
            };
            let read_only = tool
                .pointer("/annotations/readOnlyHint")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let declared_keys = tool
                .pointer("/inputSchema/properties")
                .and_then(Value::as_object)
                .map(|p| {
                    self.key_arguments
                        .iter()
                        .filter(|k| p.contains_key(k.as_str()))
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            let typed_output = tool
                .get("outputSchema")
                .is_some_and(|schema| !takes_a_problem(schema));
            learnt.push((
                name.to_owned(),
                Tool {
                    read_only,
                    declared_keys,
                    typed_output,
                },
            ));
        }
        {
            let mut known = self.tools.write().unwrap_or_else(|e| e.into_inner());
            known.extend(learnt.iter().cloned());
        }
        let Some(advertised) = self.key_arguments.first().filter(|_| self.advertise) else {
            return;
        };
        for (tool, (name, known)) in tools
            .iter_mut()
            .filter(|t| t.get("name").and_then(Value::as_str).is_some())
            .zip(learnt)
        {
            if !known.declared_keys.is_empty() || !self.guarded(&name) {
                continue;
            }
            let Some(schema) = tool.get_mut("inputSchema").and_then(Value::as_object_mut) else {
                continue;
            };
            let properties = schema.entry("properties").or_insert_with(|| json!({}));
            if let Some(properties) = properties.as_object_mut() {
                properties.insert(
                    advertised.clone(),
                    json!({ "type": "string", "description": KEY_DESCRIPTION }),
                );
            }
        }
    }
}

/// Whether a problem document (`type`, `title`, `status`, `detail`, and
/// perhaps `retry_after_seconds`, `lease_expires_at`) satisfies an output
/// schema, as far as a conservative reading tells: an object schema that
/// requires none of what a problem may lack, allows members it does not
/// list, and types the ones it lists as a problem does.
fn takes_a_problem(schema: &Value) -> bool {
    const ALWAYS: [&str; 4] = ["type", "title", "status", "detail"];
    let Some(schema) = schema.as_object() else {
        return false;
    };
    if schema.get("type").is_some_and(|t| t != "object") {
        return false;
    }
    let required_ok = schema
        .get("required")
        .and_then(Value::as_array)
        .is_none_or(|required| {
            required
                .iter()
                .all(|r| r.as_str().is_some_and(|r| ALWAYS.contains(&r)))
        });
    let open = schema.get("additionalProperties") != Some(&Value::Bool(false));
    let typed_alike = schema
        .get("properties")
        .and_then(Value::as_object)
        .is_none_or(|properties| {
            properties.iter().all(|(name, p)| {
                let want = match name.as_str() {
                    "type" | "title" | "detail" | "lease_expires_at" => "string",
                    "status" | "retry_after_seconds" => "integer",
                    _ => return true,
                };
                p.get("type")
                    .is_none_or(|t| t == want || (want == "integer" && t == "number"))
            })
        });
    required_ok && open && typed_alike
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY_ARGUMENT: &str = "idempotency_key";

    /// The default list's key arguments.
    fn keys() -> Vec<String> {
        vec!["idempotency_key".into(), "idempotencyKey".into()]
    }

    fn listed() -> Value {
        json!({ "tools": [
            { "name": "charge", "inputSchema": { "type": "object",
                "properties": { "amount": { "type": "integer" } }, "required": ["amount"] } },
            { "name": "balance", "annotations": { "readOnlyHint": true },
              "inputSchema": { "type": "object", "properties": {} } },
            { "name": "own_key", "inputSchema": { "type": "object",
                "properties": { "idempotency_key": { "type": "string" } } },
              "outputSchema": { "type": "object", "required": ["charge"] } },
        ]})
    }

    #[test]
    fn guarded_tools_gain_the_key_argument_and_read_only_ones_do_not() {
        let catalogue = Catalogue::new(None, true, keys());
        assert!(catalogue.guarded("never_listed"));
        let mut result = listed();
        catalogue.list(&mut result);
        let props = |i: usize| result["tools"][i]["inputSchema"]["properties"].clone();
        assert_eq!(props(0)[KEY_ARGUMENT]["type"], "string");
        assert_eq!(
            result["tools"][0]["inputSchema"]["required"],
            json!(["amount"])
        );
        assert!(props(1).get(KEY_ARGUMENT).is_none());
        assert_eq!(props(2)[KEY_ARGUMENT], json!({ "type": "string" }));
        assert!(catalogue.guarded("charge"));
        assert!(!catalogue.guarded("balance"));
        assert!(catalogue.tool("own_key").declares(KEY_ARGUMENT));
        assert!(!catalogue.tool("charge").declares(KEY_ARGUMENT));
        assert!(catalogue.tool("own_key").typed_output);
        assert!(!catalogue.tool("charge").typed_output);
    }

    #[test]
    fn without_advertising_the_answer_stays_as_the_server_wrote_it() {
        let catalogue = Catalogue::new(None, false, keys());
        let mut result = listed();
        catalogue.list(&mut result);
        assert_eq!(result, listed());
        assert!(catalogue.guarded("charge"));
        assert!(!catalogue.guarded("balance"));
    }

    #[test]
    fn an_open_object_schema_takes_a_problem_and_a_typed_one_does_not() {
        assert!(takes_a_problem(
            &json!({ "type": "object", "additionalProperties": true })
        ));
        assert!(takes_a_problem(&json!({ "type": "object",
            "properties": { "status": { "type": "integer" } } })));
        assert!(!takes_a_problem(
            &json!({ "type": "object", "required": ["charge"] })
        ));
        assert!(!takes_a_problem(
            &json!({ "type": "object", "additionalProperties": false })
        ));
        assert!(!takes_a_problem(&json!({ "type": "object",
            "properties": { "status": { "type": "string" } } })));
        assert!(!takes_a_problem(&json!({ "type": "array" })));
    }

    #[test]
    fn named_tools_are_the_only_guarded_ones() {
        let catalogue = Catalogue::new(Some(vec!["balance".into()]), true, keys());
        let mut result = listed();
        catalogue.list(&mut result);
        assert!(catalogue.guarded("balance"));
        assert!(!catalogue.guarded("charge"));
        assert!(
            result["tools"][0]["inputSchema"]["properties"]
                .get(KEY_ARGUMENT)
                .is_none()
        );
        assert!(Catalogue::new(Some(vec!["*".into()]), true, keys()).guarded("anything"));
    }

    #[test]
    fn the_first_key_argument_is_advertised_and_a_tool_with_its_own_keeps_it() {
        let catalogue = Catalogue::new(None, true, vec!["idempotencyKey".into(), "key".into()]);
        let mut result = json!({ "tools": [
            { "name": "charge", "inputSchema": { "type": "object", "properties": {} } },
            { "name": "own", "inputSchema": { "type": "object",
                "properties": { "key": { "type": "string" } } } },
        ]});
        catalogue.list(&mut result);
        let props = |i: usize| result["tools"][i]["inputSchema"]["properties"].clone();
        assert_eq!(props(0)["idempotencyKey"]["type"], "string");
        assert!(props(0).get(KEY_ARGUMENT).is_none());
        assert_eq!(props(1), json!({ "key": { "type": "string" } }));
        assert_eq!(catalogue.tool("own").declared_keys, ["key"]);

        // No argument among the places: nothing is advertised.
        let catalogue = Catalogue::new(None, true, Vec::new());
        let mut result = listed();
        catalogue.list(&mut result);
        assert_eq!(result, listed());
    }
}
