//! The MCP door's envelope classification (`idemgate proxy --protocol
//! mcp`): what it does with a request body — forward it, guard the one
//! tool call in it, drop the notifications, or refuse it — on arbitrary
//! bytes, and on JSON-RPC messages built from the pieces that make
//! envelopes odd (ids of every type, the method in other case or with
//! whitespace, repeated members, batches and nested batches). Never a
//! panic; a guarded `tools/call` in any envelope is never forwarded; what
//! is guarded or forwarded is the message as the door reads it.
#![no_main]

use idemgate::fuzzing::assert_mcp_envelope_invariants;
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

const METHODS: [&str; 7] = [
    "\"tools/call\"",
    "\"Tools/Call\"",
    "\" tools/call\"",
    "\"tools\\/call\"",
    "\"tools/list\"",
    "\"notifications/cancelled\"",
    "7",
];

const IDS: [&str; 8] = ["1", "\"a\"", "null", "1.0", "1.5", "true", "[1]", "18446744073709551616"];

const NAMES: [&str; 4] = ["\"charge\"", "\"balance\"", "7", "\"\""];

const CONTENT_TYPES: [Option<&str>; 4] = [
    None,
    Some("application/json"),
    Some("application/x-www-form-urlencoded"),
    Some("multipart/form-data; boundary=x"),
];

#[derive(Debug, Arbitrary)]
enum Member {
    Method(u8),
    /// `Method`, not `method`.
    OddMethod(u8),
    Id(u8),
    Name(u8),
    Key(String),
    Raw(String, String),
}

#[derive(Debug, Arbitrary)]
enum Message {
    Object(Vec<Member>),
    Batch(Vec<Message>),
    Text(String),
}

#[derive(Debug, Arbitrary)]
enum Input {
    Bytes(Vec<u8>),
    Built(Message),
}

fn member(m: &Member) -> String {
    let at = |list: &[&str], i: u8| list[usize::from(i) % list.len()].to_owned();
    match m {
        Member::Method(i) => format!("\"method\":{}", at(&METHODS, *i)),
        Member::OddMethod(i) => format!("\"Method\":{}", at(&METHODS, *i)),
        Member::Id(i) => format!("\"id\":{}", at(&IDS, *i)),
        Member::Name(i) => format!("\"params\":{{\"name\":{}}}", at(&NAMES, *i)),
        Member::Key(k) => format!(
            "\"params\":{{\"name\":\"charge\",\"arguments\":{{\"idempotency_key\":{}}}}}",
            serde_json::Value::from(k.as_str())
        ),
        Member::Raw(name, value) => format!("{}:{value}", serde_json::Value::from(name.as_str())),
    }
}

fn message(m: &Message, depth: usize) -> String {
    match m {
        Message::Object(members) => {
            let members: Vec<String> = members.iter().map(member).collect();
            format!("{{{}}}", members.join(","))
        }
        Message::Batch(messages) if depth < 8 => {
            let messages: Vec<String> = messages.iter().map(|m| message(m, depth + 1)).collect();
            format!("[{}]", messages.join(","))
        }
        Message::Batch(_) => "[]".to_owned(),
        Message::Text(text) => text.clone(),
    }
}

fuzz_target!(|input: (Input, u8)| {
    let (input, choice) = input;
    let body = match &input {
        Input::Bytes(bytes) => bytes.clone(),
        Input::Built(m) => message(m, 0).into_bytes(),
    };
    let content_type = CONTENT_TYPES[usize::from(choice) % CONTENT_TYPES.len()];
    // Every tool guarded, none, or all but `balance`.
    match choice / 4 % 3 {
        0 => assert_mcp_envelope_invariants(&body, content_type, &|_| true),
        1 => assert_mcp_envelope_invariants(&body, content_type, &|_| false),
        _ => assert_mcp_envelope_invariants(&body, content_type, &|name| name != "balance"),
    }
});
