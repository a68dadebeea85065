//! The committed OpenAPI document is the one the code generates.
//! Regenerate it with `IDEMGATE_UPDATE_OPENAPI=1 cargo test --test it openapi::`
//! (or `cargo run -- openapi --output openapi/openapi.json`).

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{Value, json};

/// The document as JSON, as clients and generators read it.
fn doc() -> Value {
    serde_json::to_value(idemgate::server::api::openapi()).unwrap()
}

/// `schema`, with a `$ref` followed into the document's components.
fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str() {
        Some(target) => {
            let pointer = target.strip_prefix('#').unwrap_or(target);
            let found = doc
                .pointer(pointer)
                .unwrap_or_else(|| panic!("{target} points at nothing"));
            resolve(doc, found)
        }
        None => schema,
    }
}

#[test]
fn committed_openapi_matches_the_code() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi/openapi.json");
    let generated = idemgate::server::api::openapi_json();
    if std::env::var_os("IDEMGATE_UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "openapi/openapi.json differs from what the code generates.\n\
         Regenerate it with: IDEMGATE_UPDATE_OPENAPI=1 cargo test --test it openapi::\n\
         and commit the result."
    );
}

#[test]
fn every_operation_has_a_verb_resource_id_and_problem_errors() {
    let doc = serde_json::to_value(idemgate::server::api::openapi()).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    let mut ids = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let id = op["operationId"].as_str().unwrap_or_default().to_owned();
            assert!(
                [
                    "get_",
                    "create_",
                    "commit_",
                    "release_",
                    "extend_",
                    "mark_",
                    "checkpoint_",
                    "list_",
                    "show_",
                    "resolve_"
                ]
                .iter()
                .any(|p| id.starts_with(p)),
                "{method} {path}: operation id {id:?}"
            );
            for (status, res) in op["responses"].as_object().unwrap() {
                if status.starts_with('4') || status.starts_with('5') {
                    assert!(
                        res["content"]["application/problem+json"].is_object(),
                        "{method} {path} {status} is not problem+json"
                    );
                }
            }
            ids.push(id);
        }
    }
    assert_eq!(ids.len(), 14, "{ids:?}");
}

/// A reserve answers `201` (reserved) or `200` (the replay); a client that
/// holds either must be able to tell which from the body alone, so `state`
/// is required and allows exactly one value in each.
#[test]
fn the_two_answers_of_a_reserve_are_told_apart_by_state() {
    let doc = doc();
    for (view, value) in [("ReservedView", "reserved"), ("CompletedView", "completed")] {
        let schema = &doc["components"]["schemas"][view];
        let required = schema["required"].as_array().unwrap();
        assert!(required.contains(&json!("state")), "{view}: {schema:#}");
        let state = resolve(&doc, &schema["properties"]["state"]);
        assert_eq!(state["type"], "string", "{view}.state: {state:#}");
        assert_eq!(state["enum"], json!([value]), "{view}.state: {state:#}");
    }
}

/// Header lines, in the commit body and in the stored response, are each
/// exactly `[name, value]`: a tuple of two strings, which generators type as
/// `[string, string]`.
#[test]
fn header_lines_are_name_value_pairs() {
    let doc = doc();
    for (schema, field) in [("CommitBody", "headers"), ("ResponseView", "headers")] {
        let lines = resolve(
            &doc,
            &doc["components"]["schemas"][schema]["properties"][field],
        );
        assert_eq!(lines["type"], "array", "{schema}.{field}: {lines:#}");
        let pair = resolve(&doc, &lines["items"]);
        assert_eq!(pair["type"], "array", "{schema}.{field}: {pair:#}");
        assert_eq!(
            pair["prefixItems"],
            json!([{"type": "string"}, {"type": "string"}]),
            "{schema}.{field}: {pair:#}"
        );
        assert_eq!(pair["minItems"], 2, "{schema}.{field}: {pair:#}");
        assert_eq!(pair["maxItems"], 2, "{schema}.{field}: {pair:#}");
        // Not `false`, which would say the same: openapi-python-client
        // refuses a document that holds a boolean schema.
        assert_eq!(
            pair["items"],
            json!({"type": "string"}),
            "{schema}.{field}: {pair:#}"
        );
    }
}

/// The reserve and extend bodies may be left out: each is an optional body
/// whose schema is the body's own, not `oneOf [body, null]`, which
/// openapi-python-client's client crashed on when the body was left out.
/// The commit and checkpoint bodies stay required.
#[test]
fn optional_bodies_are_declared_optional_not_nullable() {
    let doc = doc();
    for (path, schema, required) in [
        ("/v1/reservations", "ReserveBody", false),
        ("/v1/reservations/{id}/extend", "ExtendBody", false),
        ("/v1/reservations/{id}/commit", "CommitBody", true),
        ("/v1/reservations/{id}/checkpoint", "Recovery", true),
    ] {
        let body = &doc["paths"][path]["post"]["requestBody"];
        assert_eq!(body["required"], required, "{path}: {body:#}");
        assert_eq!(
            body["content"]["application/json"]["schema"],
            json!({ "$ref": format!("#/components/schemas/{schema}") }),
            "{path}: {body:#}"
        );
    }
    let text = doc["paths"].to_string();
    assert!(
        !text.contains(r#"{"type":"null"}"#),
        "a schema under paths is oneOf [..., null]: {text}"
    );
}

/// The response headers a client needs are declared on exactly the answers
/// that carry them (tests/api.rs checks that they are sent): the expiry on
/// every reserve, replay and commit, the replay marker, the reservation's
/// `Location`, `Repeatability-Result` for OASIS's dialect, and `Retry-After` on every refusal that says when to retry,
/// which includes every `503 store-unavailable`.
#[test]
fn response_headers_are_declared_where_they_are_sent() {
    let doc = doc();
    let mut declared = BTreeSet::new();
    let mut unavailable = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            for (status, res) in op["responses"].as_object().unwrap() {
                if status == "503" {
                    unavailable.insert(format!("{method} {path}"));
                }
                for (name, header) in res["headers"].as_object().into_iter().flatten() {
                    declared.insert(format!("{method} {path} {status} {name}"));
                    if name == "Retry-After" {
                        let schema = &header["schema"];
                        assert_eq!(schema["type"], "integer", "{method} {path} {status}");
                        assert_eq!(schema["minimum"], 1, "{method} {path} {status}");
                    }
                }
            }
        }
    }
    // Every door that reads or writes the store can find it away.
    let store_doors: BTreeSet<String> = [
        "get /readyz",
        "get /v1/admin/keys",
        "get /v1/admin/keys/{tenant}/{key_hash}",
        "post /v1/admin/keys/{tenant}/{key_hash}/resolve",
        "get /v1/reservations/{id}",
        "post /v1/reservations",
        "post /v1/reservations/{id}/checkpoint",
        "post /v1/reservations/{id}/commit",
        "post /v1/reservations/{id}/extend",
        "post /v1/reservations/{id}/release",
        "post /v1/reservations/{id}/unknown",
    ]
    .map(String::from)
    .into();
    assert_eq!(unavailable, store_doors);
    let mut expected: BTreeSet<String> = [
        "post /v1/reservations 201 Idempotency-Expires",
        "post /v1/reservations 201 Location",
        "post /v1/reservations 200 Idempotency-Expires",
        "post /v1/reservations 200 Idempotent-Replayed",
        "post /v1/reservations 409 Retry-After",
        "post /v1/reservations 429 Retry-After",
        "post /v1/reservations/{id}/commit 200 Idempotency-Expires",
        // OASIS Repeatable Requests' answer, to that dialect's requests.
        "post /v1/reservations 200 Repeatability-Result",
        "post /v1/reservations 201 Repeatability-Result",
        "post /v1/reservations 400 Repeatability-Result",
        "post /v1/reservations 409 Repeatability-Result",
        "post /v1/reservations 412 Repeatability-Result",
        "post /v1/reservations 422 Repeatability-Result",
    ]
    .map(String::from)
    .into();
    expected.extend(
        store_doors
            .iter()
            .map(|door| format!("{door} 503 Retry-After")),
    );
    assert_eq!(declared, expected);
}

/// Every `$ref` of the document names a schema it holds: a dangling one
/// (a query parameter's enum, which utoipa does not collect) makes the
/// client generators refuse the whole document.
#[test]
fn every_reference_resolves() {
    fn refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("$ref", Value::String(r)) => out.push(r.clone()),
                        _ => refs(v, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let doc = doc();
    let mut found = Vec::new();
    refs(&doc, &mut found);
    assert!(!found.is_empty());
    for r in found {
        let pointer = r
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("external $ref {r}"));
        assert!(
            doc.pointer(pointer).is_some(),
            "{r} names nothing in the document"
        );
    }
}
