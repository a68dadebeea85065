//! Calls that ask for input (MCP 2026-07-28's multi-round-trip results,
//! SPEC §12). A tool that needs its user's confirmation answers a round with
//! `resultType: "input_required"`, its questions and an opaque
//! `requestState`; the client answers them in a new round of the same call:
//! the same tool and arguments, with `inputResponses` and the `requestState`
//! echoed.
//!
//! * An `input_required` answer is not the call's outcome: `upstream.rs`
//!   marks it [`AwaitingInput`], and the layer neither stores nor releases
//!   the key, but keeps it held by this call, its lease extended, to be
//!   released at the lease's end if no round continues the call.
//! * The `requestState` the client gets names the call it continues: the
//!   door puts the reservation that holds the key in front of the server's
//!   own state ([`STATE_PREFIX`]), and takes it off again before the next
//!   round reaches the server, which sees its state as it wrote it. That
//!   round holds the key as the first did ([`Resumes`]), with no new claim,
//!   if the reservation still holds it under the same fingerprint
//!   (`inputResponses` and `requestState` are outside it); otherwise it is
//!   reserved as any call is. Several doors over one store continue each
//!   other's calls: the reservation is in the store, not in this process.
//! * The round that completes the call is stored, as any call's answer.
//!   One whose client declined or cancelled the question and whose tool then
//!   reported an error ([`Declined`]) has not acted: its key is released,
//!   so that the call can be asked again.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use serde_json::{Map, Value};
use uuid::Uuid;

use super::messages::{self, Form};
use crate::layer::Resumes;
use crate::problem::ApiError;

/// What the door puts in front of a server's `requestState`:
/// `idemgate.1.<reservation>` for a server that sent none, else
/// `idemgate.1.<reservation>.<the server's state>`.
pub(super) const STATE_PREFIX: &str = "idemgate.1.";

/// Request extension: this round answers the server's questions with a
/// decline or a cancel (an elicitation's `action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Declined;

/// Readies a guarded call's `message` for the server: a round that names a
/// call of this door ([`STATE_PREFIX`]) gets its `requestState` back as the
/// server wrote it, and [`Resumes`] in `extensions`; one that declines gets
/// [`Declined`]. A `requestState` that claims to be the door's and is not
/// is refused (the text says why).
pub(super) fn continuing(
    message: &mut Value,
    extensions: &mut http::Extensions,
) -> Result<(), String> {
    let Some(params) = message.get_mut("params").and_then(Value::as_object_mut) else {
        return Ok(());
    };
    if declines(params.get("inputResponses")) {
        extensions.insert(Declined);
    }
    let Some(Value::String(state)) = params.get("requestState") else {
        // None, or not a string: the server's to judge.
        return Ok(());
    };
    let Some(rest) = state.strip_prefix(STATE_PREFIX) else {
        // Minted by a server with no door in between.
        return Ok(());
    };
    let (held, theirs) = match rest.split_once('.') {
        Some((held, theirs)) => (held, Some(theirs.to_owned())),
        None => (rest, None),
    };
    let held = Uuid::parse_str(held).map_err(|_| {
        "the requestState is not one this door handed out: echo the requestState of the \
         input_required answer as it came"
            .to_owned()
    })?;
    match theirs {
        Some(theirs) => {
            params.insert("requestState".into(), Value::String(theirs));
        }
        None => {
            params.remove("requestState");
        }
    }
    extensions.insert(Resumes(held));
    Ok(())
}

/// Whether `message` is a round of a call this door holds a key for (its
/// `requestState` is one the door handed out).
pub(super) fn names_a_call(message: &Value) -> bool {
    message
        .pointer("/params/requestState")
        .and_then(Value::as_str)
        .is_some_and(|state| state.starts_with(STATE_PREFIX))
}

/// Whether `responses` (a round's `inputResponses`) declines or cancels a
/// question.
fn declines(responses: Option<&Value>) -> bool {
    let Some(responses) = responses.and_then(Value::as_object) else {
        return false;
    };
    responses.values().any(|response| {
        // An elicitation's result, bare or as the `result` of a response.
        let action = response
            .get("action")
            .or_else(|| response.pointer("/result/action"));
        matches!(action.and_then(Value::as_str), Some("decline" | "cancel"))
    })
}

/// An `input_required` answer to call `id` whose key reservation `held`
/// keeps: its `requestState` names that reservation, for the round that
/// continues the call.
pub(super) async fn naming_the_call(res: Response, id: &Value, held: Uuid) -> Response {
    let (mut parts, body) = res.into_parts();
    let Some(form) = Form::of(&parts.headers) else {
        return Response::from_parts(parts, body);
    };
    let bytes = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            return ApiError::UpstreamUnavailable(format!(
                "the MCP server's answer broke off: {e}"
            ))
            .into_response();
        }
    };
    let messages = messages::read(form, &bytes).await;
    let Some(mut response) = messages::response_to(&messages, id).cloned() else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    if let Some(result) = response.get_mut("result").and_then(Value::as_object_mut) {
        name_the_call(result, held);
    }
    parts.headers.remove(http::header::CONTENT_LENGTH);
    messages::answer(form, &response, parts.headers)
}

/// `result`'s `requestState`, the server's own behind the door's prefix.
fn name_the_call(result: &mut Map<String, Value>, held: Uuid) {
    let state = match result.get("requestState").and_then(Value::as_str) {
        Some(theirs) => format!("{STATE_PREFIX}{held}.{theirs}"),
        None => format!("{STATE_PREFIX}{held}"),
    };
    result.insert("requestState".into(), Value::String(state));
}

/// Whether `response` (a JSON-RPC response) asks its client for input.
pub(super) fn asks_for_input(response: &Value) -> bool {
    response
        .pointer("/result/resultType")
        .and_then(Value::as_str)
        == Some("input_required")
}

/// Whether `response` is a tool's error result (`isError`).
pub(super) fn is_tool_error(response: &Value) -> bool {
    response.pointer("/result/isError").and_then(Value::as_bool) == Some(true)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_state_the_door_handed_out_comes_back_as_the_server_wrote_it() {
        let held = Uuid::now_v7();
        for theirs in [Some("v1.abc.def"), Some(""), None] {
            let mut result = Map::new();
            if let Some(theirs) = theirs {
                result.insert("requestState".into(), json!(theirs));
            }
            name_the_call(&mut result, held);
            let mut round = json!({ "params": { "name": "charge", "arguments": {},
                "inputResponses": { "q": { "action": "accept", "content": {} } },
                "requestState": result["requestState"] } });
            let mut extensions = http::Extensions::new();
            continuing(&mut round, &mut extensions).unwrap();
            assert_eq!(extensions.get::<Resumes>(), Some(&Resumes(held)));
            assert_eq!(extensions.get::<Declined>(), None);
            assert_eq!(
                round["params"].get("requestState").and_then(Value::as_str),
                theirs
            );
        }
    }

    #[test]
    fn a_state_of_the_servers_own_is_left_alone_and_a_forged_one_refused() {
        let mut round = json!({ "params": { "requestState": "v1.server" } });
        let mut extensions = http::Extensions::new();
        continuing(&mut round, &mut extensions).unwrap();
        assert_eq!(round["params"]["requestState"], "v1.server");
        assert!(extensions.get::<Resumes>().is_none());
        let mut forged = json!({ "params": { "requestState": "idemgate.1.not-an-id.x" } });
        assert!(continuing(&mut forged, &mut http::Extensions::new()).is_err());
    }

    #[test]
    fn a_decline_or_a_cancel_is_seen_in_either_shape() {
        for responses in [
            json!({ "q": { "action": "decline" } }),
            json!({ "a": { "action": "accept" }, "q": { "result": { "action": "cancel" } } }),
        ] {
            let mut round = json!({ "params": { "inputResponses": responses } });
            let mut extensions = http::Extensions::new();
            continuing(&mut round, &mut extensions).unwrap();
            assert_eq!(extensions.get::<Declined>(), Some(&Declined));
        }
        let mut accepted =
            json!({ "params": { "inputResponses": { "q": { "action": "accept" } } } });
        let mut extensions = http::Extensions::new();
        continuing(&mut accepted, &mut extensions).unwrap();
        assert!(extensions.get::<Declined>().is_none());
    }
}
