//! JSON-RPC messages as MCP's streamable HTTP carries them: one message as
//! `application/json`, or server-sent events (`text/event-stream`) whose
//! `data` are messages. Event streams are parsed by `eventsource-stream`,
//! whole ([`read`]) or as they come ([`events`]).

use axum::body::{Body, Bytes};
use axum::response::Response;
use futures::StreamExt;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde_json::{Value, json};

/// How a response carried its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::server::proxy) enum Form {
    Json,
    EventStream,
}

impl Form {
    /// The form of a response with these headers, if it is one of the two.
    pub(in crate::server::proxy) fn of(headers: &HeaderMap) -> Option<Form> {
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

/// The events of an event stream's body as they come: each event's `data`
/// (`\r\n`, multi-line data, comments, `id:` and `retry:` fields as the
/// format has them; an event without data, such as the priming event a
/// server sends for resumption, is no event here). An error when the body
/// breaks off, is not UTF-8, or grows past `most` bytes.
pub(super) fn events(
    body: Body,
    most: usize,
) -> impl futures::Stream<Item = Result<String, String>> + Send {
    use eventsource_stream::Eventsource;
    let mut total = 0usize;
    body.into_data_stream()
        .map(move |chunk| {
            let chunk = chunk.map_err(|e| e.to_string())?;
            total += chunk.len();
            if total > most {
                return Err(format!("the event stream is over {most} bytes"));
            }
            Ok(chunk)
        })
        .eventsource()
        .filter_map(|event| async move {
            match event {
                Ok(event) if event.data.is_empty() => None,
                Ok(event) => Some(Ok(event.data)),
                Err(e) => Some(Err(e.to_string())),
            }
        })
}

/// One `message` event whose `data` is `data` (a line of it for each of its
/// lines), as a body or a part of one.
pub(super) fn event(data: &str) -> Bytes {
    let mut event = String::with_capacity(data.len() + 24);
    event.push_str("event: message\n");
    for line in data.split('\n') {
        event.push_str("data: ");
        event.push_str(line);
        event.push('\n');
    }
    event.push('\n');
    Bytes::from(event)
}

/// Whether `message` is the response to request `id` (a request of the
/// server's own may have the same `id`: it has a `method`).
pub(super) fn is_response_to(message: &Value, id: &Value) -> bool {
    message.get("id") == Some(id)
        && (message.get("result").is_some() || message.get("error").is_some())
}

/// The response to request `id` among `messages`: the last message with
/// that id and a `result` or an `error`.
pub(super) fn response_to<'a>(messages: &'a [Value], id: &Value) -> Option<&'a Value> {
    messages.iter().rev().find(|m| is_response_to(m, id))
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

    #[tokio::test]
    async fn an_event_stream_is_read_as_it_comes_however_it_is_cut() {
        // The SDK's priming event (an id, empty data), a comment, a retry
        // field, CRLF lines, data over two lines, a character of two bytes,
        // and chunks cut anywhere.
        let stream = "id: 0\r\ndata: \r\nretry: 3000\r\n\r\n: keep-alive\r\n\
                      event: message\r\nid: 1\r\ndata: {\"jsonrpc\":\"2.0\",\r\n\
                      data: \"method\":\"notifications/progress\"}\r\n\r\n\
                      data: {\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{\"x\":\"\u{e9}\"}}\n\n";
        let bytes = stream.as_bytes();
        for cut in 1..bytes.len() {
            let (a, rest) = bytes.split_at(cut);
            let (b, c) = rest.split_at(rest.len() / 2);
            let chunks = [a, b, c].map(|p| Ok::<_, std::io::Error>(Bytes::copy_from_slice(p)));
            let body = Body::from_stream(futures::stream::iter(chunks));
            let got: Vec<String> = events(body, 1 << 20)
                .map(|e| e.expect("an event"))
                .collect()
                .await;
            assert_eq!(got.len(), 2, "cut at {cut}: {got:?}");
            let first: Value = serde_json::from_str(&got[0]).expect("JSON");
            assert_eq!(first["method"], "notifications/progress");
            let second: Value = serde_json::from_str(&got[1]).expect("JSON");
            assert!(is_response_to(&second, &json!(3)));
            assert_eq!(second["result"]["x"], "\u{e9}");
        }
        // Past the limit, or broken off: an error, never an event.
        let got: Vec<_> = events(Body::from(stream.to_owned()), 10).collect().await;
        assert!(got.iter().any(Result::is_err), "{got:?}");
        let broken = [
            Ok(Bytes::from_static(b"data: {\"id\":3,")),
            Err(std::io::Error::other("reset")),
        ];
        let body = Body::from_stream(futures::stream::iter(broken));
        let got: Vec<_> = events(body, 1 << 20).collect().await;
        assert!(matches!(got.as_slice(), [Err(_)]), "{got:?}");
    }

    #[tokio::test]
    async fn an_event_is_one_message_event_however_many_lines_its_data_has() {
        let data = "{\"a\":\n1}";
        let event = event(data);
        assert_eq!(&event[..], b"event: message\ndata: {\"a\":\ndata: 1}\n\n");
        let messages = read(Form::EventStream, &event).await;
        assert_eq!(messages, vec![json!({ "a": 1 })]);
        // A server's request with the call's id is no response to it.
        let request = json!({ "jsonrpc": "2.0", "id": 3, "method": "elicitation/create" });
        assert!(!is_response_to(&request, &json!(3)));
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
