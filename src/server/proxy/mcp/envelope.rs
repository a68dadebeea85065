//! What the door does with a `POST` body, before anything is forwarded:
//! every envelope a guarded `tools/call` can come in is told apart here, so
//! that none can step around the door (SPEC §12, "Every envelope is
//! guarded").
//!
//! * One message that is a `tools/call` of a guarded tool with a string or
//!   integer `id`: guarded ([`Envelope::Guard`]).
//! * The same sent as a notification (no `id`): never forwarded, answered
//!   `202` and counted ([`Envelope::Drop`]).
//! * A JSON-RPC batch that holds a guarded call (a request or a
//!   notification): none of it is forwarded, each of its requests is
//!   answered with a JSON-RPC error ([`Envelope::Refuse`]). MCP's
//!   streamable HTTP sends no batches since 2025-06-18; one that still
//!   comes is refused whole rather than split, so that nothing in it is
//!   forwarded half-guarded.
//! * Refused as well, because the door and the server could read them
//!   differently: a guarded call whose `id` is no string or integer (`null`,
//!   `1.5`: a server may take `1.0` for `1`, or `null` for a notification);
//!   a message whose `method` is `tools/call` but for its case or
//!   whitespace (or whose member is `Method`), which a lenient server may
//!   run; a body that names `tools/call` and repeats a member name anywhere
//!   (this parser takes the last, a server's may take the first, and read
//!   another tool, key or arguments); a batch that holds an array; and a
//!   body that does not parse as JSON (a server's parser may take what this
//!   one refuses: `NaN`, UTF-16, a depth past 128), unless it is sent as a
//!   form.
//! * Anything else is forwarded as it came ([`Envelope::Forward`]).

use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// The method of a tool call.
const TOOLS_CALL: &str = "tools/call";

/// What to do with a request body.
#[derive(Debug, Clone, PartialEq)]
pub enum Envelope {
    /// Forward it as it came; the message, if the body is one JSON value.
    Forward(Option<Value>),
    /// One guarded tool call: through the layer.
    Guard {
        /// The whole message.
        message: Value,
        /// Its JSON-RPC id, a string or an integer.
        id: Value,
    },
    /// Guarded tool calls sent as notifications, and nothing else that
    /// needs an answer: `202`, never forwarded.
    Drop {
        /// How many.
        dropped: usize,
    },
    /// Forward nothing; answer each request of the body with an error.
    Refuse(Refusal),
}

/// Why a body is refused, and whom to answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// What the error says.
    pub why: &'static str,
    /// The JSON-RPC error code.
    pub code: i64,
    /// Each request's id to answer (a batch), or the one message's id.
    pub ids: Vec<Value>,
    /// The body was a batch: the answer is an array.
    pub batch: bool,
    /// Guarded tool calls sent as notifications among what is refused.
    pub dropped: usize,
}

/// JSON-RPC: the body is no JSON.
pub const PARSE_ERROR: i64 = -32700;
/// JSON-RPC: the message is not a valid request.
pub const INVALID_REQUEST: i64 = -32600;

/// What the door does with `body` (a `POST`'s), sent as `content_type`;
/// `guarded` says whether calls of a tool are guarded.
pub fn classify(
    body: &[u8],
    content_type: Option<&str>,
    guarded: &dyn Fn(&str) -> bool,
) -> Envelope {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Envelope::Forward(None);
    }
    let mut seen = Seen::default();
    let parsed = {
        let mut de = serde_json::Deserializer::from_slice(body);
        Node {
            seen: &mut seen,
            root: true,
            message: true,
        }
        .deserialize(&mut de)
        .and_then(|value| de.end().map(|()| value))
    };
    let Ok(value) = parsed else {
        if is_form(content_type) {
            return Envelope::Forward(None);
        }
        return Envelope::Refuse(Refusal {
            why: "the request body is not JSON this door can read, so it cannot tell whether it \
                  holds a guarded tool call",
            code: PARSE_ERROR,
            ids: Vec::new(),
            batch: false,
            dropped: 0,
        });
    };
    if seen.odd_method {
        return refuse_all(
            &value,
            "a method that is tools/call but for its case or whitespace is not taken: send \
             \"method\": \"tools/call\"",
        );
    }
    if seen.duplicate && seen.tools_call {
        return refuse_all(
            &value,
            "a tool call whose JSON repeats a member name is not taken: parsers differ on \
             which of the two counts",
        );
    }
    match value {
        Value::Array(members) => batch(members, guarded),
        Value::Object(ref message) => match guarded_call(message, guarded) {
            None => Envelope::Forward(Some(value)),
            Some(None) => Envelope::Drop { dropped: 1 },
            Some(Some(id)) if is_valid_id(id) => {
                let id = id.clone();
                Envelope::Guard { message: value, id }
            }
            Some(Some(_)) => Envelope::Refuse(Refusal {
                why: "a guarded tool call's id must be a string or an integer",
                code: INVALID_REQUEST,
                ids: Vec::new(),
                batch: false,
                dropped: 0,
            }),
        },
        other => Envelope::Forward(Some(other)),
    }
}

/// A batch: forwarded if it holds no guarded call and no array; else
/// refused whole.
fn batch(members: Vec<Value>, guarded: &dyn Fn(&str) -> bool) -> Envelope {
    let nested = members.iter().any(Value::is_array);
    let mut holds_guarded = false;
    let mut dropped = 0;
    let mut ids = Vec::new();
    for member in &members {
        let Value::Object(message) = member else {
            continue;
        };
        match guarded_call(message, guarded) {
            Some(None) => {
                holds_guarded = true;
                dropped += 1;
            }
            Some(Some(_)) => holds_guarded = true,
            None => {}
        }
        if let Some(id) = message.get("id") {
            ids.push(id.clone());
        }
    }
    if !holds_guarded && !nested {
        return Envelope::Forward(Some(Value::Array(members)));
    }
    if ids.is_empty() && !nested {
        return Envelope::Drop { dropped };
    }
    Envelope::Refuse(Refusal {
        why: if nested {
            "a batch that holds an array is not taken"
        } else {
            "a JSON-RPC batch that holds a guarded tool call is not forwarded: send each tool \
             call alone"
        },
        code: INVALID_REQUEST,
        ids,
        batch: true,
        dropped,
    })
}

/// Every request of `value` refused for `why`.
fn refuse_all(value: &Value, why: &'static str) -> Envelope {
    let (ids, batch) = match value {
        Value::Array(members) => (
            members
                .iter()
                .filter_map(|m| m.get("id").cloned())
                .collect(),
            true,
        ),
        Value::Object(message) => (
            message
                .get("id")
                .filter(|id| is_valid_id(id))
                .cloned()
                .into_iter()
                .collect(),
            false,
        ),
        _ => (Vec::new(), false),
    };
    Envelope::Refuse(Refusal {
        why,
        code: INVALID_REQUEST,
        ids,
        batch,
        dropped: 0,
    })
}

/// A `tools/call` of a guarded tool: `Some` of its id (`None`: a
/// notification); `None` if `message` is no such call.
fn guarded_call<'a>(
    message: &'a Map<String, Value>,
    guarded: &dyn Fn(&str) -> bool,
) -> Option<Option<&'a Value>> {
    if message.get("method").and_then(Value::as_str) != Some(TOOLS_CALL) {
        return None;
    }
    let name = message
        .get("params")
        .and_then(|p| p.get("name"))
        .and_then(Value::as_str)?;
    guarded(name).then(|| message.get("id"))
}

/// A JSON-RPC id MCP allows: a string or an integer (never `null`).
pub fn is_valid_id(id: &Value) -> bool {
    match id {
        Value::String(_) => true,
        Value::Number(n) => n.is_i64() || n.is_u64(),
        _ => false,
    }
}

/// Whether `content_type` is a form's, which no MCP server reads as JSON.
fn is_form(content_type: Option<&str>) -> bool {
    content_type.is_some_and(|ct| {
        let essence = ct.split(';').next().unwrap_or_default().trim();
        essence.eq_ignore_ascii_case("application/x-www-form-urlencoded")
            || essence
                .get(..10)
                .is_some_and(|p| p.eq_ignore_ascii_case("multipart/"))
    })
}

/// What the parse saw anywhere in the body.
#[derive(Debug, Default)]
struct Seen {
    /// An object repeated a member name.
    duplicate: bool,
    /// A message's `method` member was `tools/call`.
    tools_call: bool,
    /// A message's member that is `method` but for its case or whitespace,
    /// or a `method` that is `tools/call` but for its case or whitespace,
    /// names a tool call.
    odd_method: bool,
}

impl Seen {
    fn member(&mut self, name: &str, value: &Value) {
        let Some(method) = value.as_str() else {
            return;
        };
        let like = |s: &str| s.trim().eq_ignore_ascii_case(TOOLS_CALL);
        if !name.trim().eq_ignore_ascii_case("method") || !like(method) {
            return;
        }
        self.tools_call = true;
        if name != "method" || method != TOOLS_CALL {
            self.odd_method = true;
        }
    }
}

/// A JSON value, parsed as `serde_json::Value` is (the last of a repeated
/// member kept), noting what [`Seen`] asks.
struct Node<'s> {
    seen: &'s mut Seen,
    /// The body's value itself.
    root: bool,
    /// A message: the root, or a member of a root array. Only a message's
    /// `method` is read: a tool's arguments may name any method.
    message: bool,
}

impl<'de> DeserializeSeed<'de> for Node<'_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Node {
            seen: &mut *self.seen,
            root: false,
            message: self.root,
        })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(name) = map.next_key::<String>()? {
            let value = map.next_value_seed(Node {
                seen: &mut *self.seen,
                root: false,
                message: false,
            })?;
            if self.message {
                self.seen.member(&name, &value);
            }
            if out.insert(name, value).is_some() {
                self.seen.duplicate = true;
            }
        }
        Ok(Value::Object(out))
    }
}

/// The invariants of [`classify`] on `body`, for the fuzz target and the
/// property test: it never panics; a guarded `tools/call` (as
/// `serde_json` reads it) alone or in a batch is never forwarded; what is
/// guarded or forwarded is the message as `serde_json` reads it; a body
/// that is not JSON is forwarded only as a form. `guarded` says which tools
/// are guarded. Panics where one does not hold.
#[doc(hidden)]
pub fn assert_invariants(body: &[u8], content_type: Option<&str>, guarded: &dyn Fn(&str) -> bool) {
    let envelope = classify(body, content_type, guarded);
    let is_guarded_call = |m: &Value| {
        m.get("method").and_then(Value::as_str) == Some(TOOLS_CALL)
            && m.pointer("/params/name")
                .and_then(Value::as_str)
                .is_some_and(guarded)
    };
    match serde_json::from_slice::<Value>(body) {
        Ok(parsed) => {
            let holds_guarded = match &parsed {
                Value::Array(members) => members.iter().any(is_guarded_call),
                message => is_guarded_call(message),
            };
            match &envelope {
                Envelope::Forward(forwarded) => {
                    assert!(!holds_guarded, "a guarded call forwarded: {parsed}");
                    assert_eq!(
                        forwarded.as_ref(),
                        Some(&parsed),
                        "forwarded another reading"
                    );
                }
                Envelope::Guard { message, id } => {
                    assert_eq!(message, &parsed, "guarded another reading");
                    assert!(is_guarded_call(message), "guarded what is no guarded call");
                    assert!(
                        is_valid_id(id),
                        "guarded with an id MCP does not allow: {id}"
                    );
                    assert_eq!(message.get("id"), Some(id));
                }
                Envelope::Drop { dropped } => {
                    assert!(*dropped >= 1, "dropped nothing");
                    assert!(holds_guarded, "dropped what holds no guarded call");
                }
                Envelope::Refuse(refusal) => {
                    assert!(refusal.ids.iter().all(|id| !id.is_null() || refusal.batch));
                }
            }
        }
        Err(_) => match &envelope {
            Envelope::Forward(forwarded) => {
                assert!(forwarded.is_none());
                assert!(
                    body.iter().all(u8::is_ascii_whitespace) || is_form(content_type),
                    "a body that is not JSON forwarded as JSON"
                );
            }
            Envelope::Refuse(_) => {}
            other => panic!("a body that is not JSON classified as {other:?}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn all(_: &str) -> bool {
        true
    }

    fn of(body: &str) -> Envelope {
        classify(body.as_bytes(), Some("application/json"), &|n| {
            n != "balance"
        })
    }

    fn call(id: Value) -> Value {
        json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": { "name": "charge", "arguments": { "amount": 5 } } })
    }

    #[test]
    fn a_guarded_call_is_guarded_and_its_notification_dropped() {
        let c = call(json!(1));
        assert_eq!(
            of(&c.to_string()),
            Envelope::Guard {
                message: c.clone(),
                id: json!(1)
            }
        );
        let mut n = c.clone();
        n.as_object_mut().unwrap().remove("id");
        assert_eq!(of(&n.to_string()), Envelope::Drop { dropped: 1 });
        let mut read_only = c.clone();
        read_only["params"]["name"] = json!("balance");
        assert!(matches!(
            of(&read_only.to_string()),
            Envelope::Forward(Some(_))
        ));
        assert!(matches!(
            of(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#),
            Envelope::Forward(Some(_))
        ));
    }

    #[test]
    fn odd_ids_methods_and_repeated_members_are_refused() {
        for id in [json!(null), json!(1.5), json!(1.0), json!(true), json!([1])] {
            assert!(
                matches!(of(&call(id.clone()).to_string()), Envelope::Refuse(_)),
                "{id}"
            );
        }
        assert!(matches!(
            of(&call(json!("a")).to_string()),
            Envelope::Guard { .. }
        ));
        for body in [
            r#"{"jsonrpc":"2.0","id":1,"method":"Tools/Call","params":{"name":"charge"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":" tools/call","params":{"name":"balance"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"Method":"tools/call","params":{"name":"charge"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","method":"ping","params":{"name":"charge"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge","name":"balance"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"balance","arguments":{"a":1,"a":2}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools\/call","params":{"name":"charge","arguments":{"amount":NaN}}}"#,
            "[[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"charge\"}}]]",
        ] {
            assert!(matches!(of(body), Envelope::Refuse(_)), "{body}");
        }
        // A method named in a tool's arguments is the tool's.
        let mut named = call(json!(1));
        named["params"]["arguments"]["method"] = json!("Tools/Call");
        assert!(matches!(of(&named.to_string()), Envelope::Guard { .. }));
        // A repeated member in a message that calls no tool is the server's to read.
        assert!(matches!(
            of(r#"{"jsonrpc":"2.0","id":1,"id":2,"method":"ping"}"#),
            Envelope::Forward(Some(_))
        ));
        // Not JSON: refused, unless sent as a form.
        assert!(matches!(of("{\"a\":"), Envelope::Refuse(_)));
        assert_eq!(
            classify(
                b"grant_type=x",
                Some("application/x-www-form-urlencoded"),
                &all
            ),
            Envelope::Forward(None)
        );
        assert_eq!(of(""), Envelope::Forward(None));
        assert!(matches!(of("42"), Envelope::Forward(Some(_))));
    }

    #[test]
    fn the_invariants_hold_on_the_cases_above() {
        for body in [
            call(json!(1)).to_string(),
            call(json!(null)).to_string(),
            json!([call(json!(1)), call(json!(2))]).to_string(),
            r#"{"method":"tools/call","method":"ping","params":{"name":"x"}}"#.to_owned(),
            "[[]]".to_owned(),
            "\u{feff}{}".to_owned(),
        ] {
            assert_invariants(body.as_bytes(), Some("application/json"), &all);
            assert_invariants(body.as_bytes(), None, &|_| false);
        }
    }

    #[test]
    fn a_batch_with_a_guarded_call_is_refused_whole() {
        let batch = json!([call(json!(3)), call(json!(4)),
            { "jsonrpc": "2.0", "id": 5, "method": "ping" }]);
        let Envelope::Refuse(refusal) = of(&batch.to_string()) else {
            panic!("not refused");
        };
        assert_eq!(refusal.ids, vec![json!(3), json!(4), json!(5)]);
        assert!(refusal.batch);

        let mut n = call(json!(0));
        n.as_object_mut().unwrap().remove("id");
        assert_eq!(
            of(&json!([n.clone(), n]).to_string()),
            Envelope::Drop { dropped: 2 }
        );
        assert!(matches!(
            of(&json!([{ "jsonrpc": "2.0", "id": 5, "method": "ping" }]).to_string()),
            Envelope::Forward(Some(_))
        ));
        assert!(matches!(of("[]"), Envelope::Forward(Some(_))));
    }
}
