//! JSON-RPC messages as MCP's streamable HTTP carries them: one message as
//! `application/json`, or server-sent events (`text/event-stream`) whose
//! `data` are messages. Event streams are parsed by `eventsource-stream`.

use axum::body::{Body, Bytes};
use axum::response::Response;
use futures::StreamExt;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::{Value, json};

/// How a response carried its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Form {
    Json,
    EventStream,
}

impl Form {
    /// The form of a response with these headers, if it is one of the two.
    pub(super) fn of(headers: &HeaderMap) -> Option<Form> {
        let ct = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
        let essence = ct.split(';').next()?.trim().to_ascii_lowercase();
        match essence.as_str() {
            "application/json" => Some(Form::Json),
            "text/event-stream" => Some(Form::EventStream),
            _ => None,
        }
    }

    /// The form to answer a request with these headers in, `preferred`
    /// where its `Accept` takes it (or says nothing), else the other.
    pub(super) fn for_request(headers: &HeaderMap, preferred: Form) -> Form {
        let accept: Vec<String> = headers
            .get_all(header::ACCEPT)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(|v| {
                v.split(';')
                    .next()
                    .unwrap_or_default()
                    .trim()
                    .to_ascii_lowercase()
            })
            .collect();
        let takes = |form: Form| {
            accept.is_empty()
                || accept.iter().any(|a| {
                    a == "*/*"
                        || match form {
                            Form::Json => a == "application/json" || a == "application/*",
                            Form::EventStream => a == "text/event-stream" || a == "text/*",
                        }
                })
        };
        match preferred {
            Form::Json if !takes(Form::Json) && takes(Form::EventStream) => Form::EventStream,
            Form::EventStream if !takes(Form::EventStream) && takes(Form::Json) => Form::Json,
            form => form,
        }
    }
}

/// The JSON-RPC messages of a body in `form`: the one message of a JSON
/// body (or each of a batch), or each event's `data` that parses.
pub(super) async fn read(form: Form, body: &Bytes) -> Vec<Value> {
    match form {
        Form::Json => match serde_json::from_slice::<Value>(body) {
            Ok(Value::Array(batch)) => batch,
            Ok(message) => vec![message],
            Err(_) => Vec::new(),
        },
        Form::EventStream => {
            use eventsource_stream::Eventsource;
            let chunks = futures::stream::iter([Ok::<_, std::convert::Infallible>(body.clone())]);
            chunks
                .eventsource()
                .filter_map(|event| async move {
                    let event = event.ok()?;
                    serde_json::from_str::<Value>(&event.data).ok()
                })
                .collect()
                .await
        }
    }
}

/// The response to request `id` among `messages`: the last message with
/// that id and a `result` or an `error`.
pub(super) fn response_to<'a>(messages: &'a [Value], id: &Value) -> Option<&'a Value> {
    messages.iter().rev().find(|m| {
        m.get("id") == Some(id) && (m.get("result").is_some() || m.get("error").is_some())
    })
}

/// `message` as a `200` in `form`: the JSON itself, or one `message` event.
pub(super) fn answer(form: Form, message: &Value, mut headers: HeaderMap) -> Response {
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::TRANSFER_ENCODING);
    headers.remove(header::CONTENT_ENCODING);
    let (content_type, body) = match form {
        Form::Json => ("application/json", message.to_string()),
        Form::EventStream => (
            "text/event-stream",
            format!("event: message\ndata: {message}\n\n"),
        ),
    };
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    let mut res = Response::new(Body::from(body));
    *res.status_mut() = StatusCode::OK;
    *res.headers_mut() = headers;
    res
}

/// A JSON-RPC result for request `id`.
pub(super) fn result(id: &Value, result: Value) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "result": result })
}

/// A JSON-RPC error for request `id`.
pub(super) fn error(id: &Value, code: i64, message: &str, data: Option<Value>) -> Value {
    let mut error = json!({ "code": code, "message": message });
    if let Some(data) = data {
        error["data"] = data;
    }
    json!({ "jsonrpc": "2.0", "id": id, "error": error })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_event_stream_gives_its_messages_and_the_response_is_found() {
        let body = Bytes::from_static(
            b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n\
              id: 7\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{\"x\":1}}\n\n",
        );
        let messages = read(Form::EventStream, &body).await;
        assert_eq!(messages.len(), 2);
        let found = response_to(&messages, &json!(3)).unwrap();
        assert_eq!(found["result"]["x"], 1);
        assert!(response_to(&messages, &json!(4)).is_none());
    }

    #[test]
    fn the_answer_form_follows_accept() {
        let mut h = HeaderMap::new();
        h.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        assert_eq!(Form::for_request(&h, Form::EventStream), Form::Json);
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("application/json, text/event-stream"),
        );
        assert_eq!(Form::for_request(&h, Form::EventStream), Form::EventStream);
        assert_eq!(Form::for_request(&HeaderMap::new(), Form::Json), Form::Json);
    }
}
