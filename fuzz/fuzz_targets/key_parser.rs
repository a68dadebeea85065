//! The `Idempotency-Key` parser on arbitrary bytes: never a panic, and
//! whatever it accepts is a 1..=255-character printable-ASCII key that
//! parses to itself again once written as an sf-string.
#![no_main]

use idemgate::key::{KeyError, KeyFormat, KeyPolicy, from_headers, parse_value};
use libfuzzer_sys::fuzz_target;

fn sf_quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

fuzz_target!(|data: &[u8]| {
    let policies = [
        KeyPolicy::default(),
        KeyPolicy {
            strict: true,
            ..KeyPolicy::default()
        },
        KeyPolicy {
            format: KeyFormat::Uuid,
            ..KeyPolicy::default()
        },
    ];
    for policy in &policies {
        match parse_value(data, policy) {
            Ok(key) => {
                let k = key.as_str();
                assert!((1..=255).contains(&k.len()), "length {}", k.len());
                assert!(k.bytes().all(|b| (0x20..=0x7E).contains(&b)));
                let again = parse_value(sf_quote(k).as_bytes(), policy).expect("quoted form");
                assert_eq!(again, key);
                // Debug output never shows the key, only its hash prefix.
                assert_eq!(
                    format!("{key:?}"),
                    format!("IdempotencyKey({})", key.hash_prefix())
                );
            }
            Err(KeyError::Invalid(msg)) => assert!(!msg.is_empty()),
            Err(KeyError::Missing) => panic!("Missing from parse_value"),
        }
        // The same bytes as a header line, where the http crate allows them.
        if let Ok(value) = http::HeaderValue::from_bytes(data) {
            let name = http::HeaderName::from_static("idempotency-key");
            let mut headers = http::HeaderMap::new();
            headers.insert(&name, value);
            let via_headers = from_headers(&headers, &name, policy);
            assert_eq!(via_headers, parse_value(data, policy));
        }
    }
});
