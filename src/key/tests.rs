//! The key parser against the draft's forms and this server's limits.

use super::*;
use http::{HeaderMap, HeaderName, HeaderValue};

const UUID: &str = "8e03978e-40d5-43e8-bc93-6894a57f9324";

fn lenient() -> KeyPolicy {
    KeyPolicy::default()
}

fn strict() -> KeyPolicy {
    KeyPolicy {
        strict: true,
        ..KeyPolicy::default()
    }
}

fn uuid_policy() -> KeyPolicy {
    KeyPolicy {
        format: KeyFormat::Uuid,
        ..KeyPolicy::default()
    }
}

#[test]
fn valid_values() {
    let long_255 = "a".repeat(255);
    let quoted_255 = format!("\"{long_255}\"");
    let quoted_uuid = format!("\"{UUID}\"");
    let cases: Vec<(&str, &[u8], KeyPolicy, &str)> = vec![
        ("quoted", b"\"abc\"", lenient(), "abc"),
        ("quoted uuid", quoted_uuid.as_bytes(), lenient(), UUID),
        ("escaped quote", br#""a\"b""#, lenient(), "a\"b"),
        ("escaped backslash", br#""a\\b""#, lenient(), "a\\b"),
        ("quoted with space", b"\"a b\"", lenient(), "a b"),
        ("bare", b"abc", lenient(), "abc"),
        ("bare uuid", UUID.as_bytes(), lenient(), UUID),
        (
            "bare punctuation",
            b"k_1-2.3:4/5+6=",
            lenient(),
            "k_1-2.3:4/5+6=",
        ),
        ("bare with inner quote", b"a\"b", lenient(), "a\"b"),
        ("quoted in strict mode", b"\"abc\"", strict(), "abc"),
        ("leading/trailing SP", b"  \"abc\"  ", lenient(), "abc"),
        ("leading/trailing HTAB", b"\tabc\t", lenient(), "abc"),
        ("255 bare", long_255.as_bytes(), lenient(), &long_255),
        ("255 quoted", quoted_255.as_bytes(), lenient(), &long_255),
        (
            "custom max_len exact",
            b"abcd",
            KeyPolicy {
                max_len: 4,
                ..lenient()
            },
            "abcd",
        ),
        ("uuid format bare", UUID.as_bytes(), uuid_policy(), UUID),
        (
            "uuid format quoted",
            quoted_uuid.as_bytes(),
            uuid_policy(),
            UUID,
        ),
        (
            "uuid format uppercase",
            b"8E03978E-40D5-43E8-BC93-6894A57F9324",
            uuid_policy(),
            "8E03978E-40D5-43E8-BC93-6894A57F9324",
        ),
    ];
    for (name, raw, policy, want) in cases {
        match parse_value(raw, &policy) {
            Ok(key) => assert_eq!(key.as_str(), want, "{name}"),
            Err(e) => panic!("{name}: unexpected error {e}"),
        }
    }
}

#[test]
fn invalid_values() {
    let long_256 = "a".repeat(256);
    let quoted_256 = format!("\"{long_256}\"");
    let cases: Vec<(&str, &[u8], KeyPolicy, &str)> = vec![
        ("empty", b"", lenient(), "empty"),
        ("only whitespace", b" \t ", lenient(), "empty"),
        ("empty sf-string", b"\"\"", lenient(), "empty"),
        (
            "unterminated quote",
            b"\"abc",
            lenient(),
            "unterminated string",
        ),
        (
            "bad escape",
            br#""\a""#,
            lenient(),
            "invalid escape sequence",
        ),
        ("dangling escape", br#""abc\"#, lenient(), "sf-string"),
        (
            "trailing garbage",
            b"\"abc\"x",
            lenient(),
            "trailing characters",
        ),
        (
            "two strings",
            b"\"a\", \"b\"",
            lenient(),
            "trailing characters",
        ),
        ("parameters", b"\"abc\";p=1", lenient(), "parameters"),
        ("bare parameter flag", b"\"abc\";p", lenient(), "parameters"),
        (
            "non-ASCII quoted",
            b"\"caf\xC3\xA9\"",
            lenient(),
            "non-ASCII",
        ),
        ("non-ASCII bare", b"caf\xC3\xA9", lenient(), "non-ASCII"),
        (
            "control char bare",
            b"ab\x01c",
            lenient(),
            "control character",
        ),
        (
            "control char quoted",
            b"\"ab\x01c\"",
            lenient(),
            "control character",
        ),
        ("inner HTAB", b"a\tb", lenient(), "control character"),
        ("DEL", b"ab\x7F", lenient(), "control character"),
        ("space in bare", b"a b", lenient(), "spaces"),
        ("bare in strict mode", b"abc", strict(), "strict mode"),
        (
            "256 bare",
            long_256.as_bytes(),
            lenient(),
            "256 characters long; the limit is 255",
        ),
        (
            "256 quoted",
            quoted_256.as_bytes(),
            lenient(),
            "256 characters long; the limit is 255",
        ),
        (
            "custom max_len",
            b"abcde",
            KeyPolicy {
                max_len: 4,
                ..lenient()
            },
            "5 characters long; the limit is 4",
        ),
        ("not a uuid", b"abc", uuid_policy(), "UUID"),
        (
            "uuid simple form",
            b"8e03978e40d543e8bc936894a57f9324",
            uuid_policy(),
            "UUID",
        ),
        (
            "uuid braced form",
            b"{8e03978e-40d5-43e8-bc93-6894a57f9324}",
            uuid_policy(),
            "UUID",
        ),
        (
            "uuid with bad digit",
            b"8e03978e-40d5-43e8-bc93-6894a57f932g",
            uuid_policy(),
            "UUID",
        ),
    ];
    for (name, raw, policy, want) in cases {
        match parse_value(raw, &policy) {
            Ok(key) => panic!("{name}: accepted as {key:?}"),
            Err(KeyError::Missing) => panic!("{name}: Missing instead of Invalid"),
            Err(KeyError::Invalid(msg)) => {
                assert!(msg.contains(want), "{name}: message {msg:?} lacks {want:?}");
            }
        }
    }
}

#[test]
fn messages_never_contain_the_key() {
    let secret = "s3cr3tvalue";
    let cases: Vec<(String, KeyPolicy)> = vec![
        (format!("\"{secret}"), lenient()),
        (format!("\"{secret}\"x"), lenient()),
        (format!("\"{secret}\";p=1"), lenient()),
        (format!("\"{secret}\\a\""), lenient()),
        (format!("{secret} x"), lenient()),
        (secret.to_owned(), strict()),
        (secret.to_owned(), uuid_policy()),
        (
            secret.to_owned(),
            KeyPolicy {
                max_len: 3,
                ..lenient()
            },
        ),
    ];
    for (raw, policy) in cases {
        match parse_value(raw.as_bytes(), &policy) {
            Err(KeyError::Invalid(msg)) => assert!(!msg.contains(secret), "{msg}"),
            other => panic!("{raw:?}: expected Invalid, got {other:?}"),
        }
    }
}

#[test]
fn quoted_and_bare_are_the_same_key() {
    let quoted = parse_value(b"\"abc\"", &lenient()).expect("quoted");
    let bare = parse_value(b"abc", &lenient()).expect("bare");
    assert_eq!(quoted, bare);
    assert_eq!(quoted.hash(), bare.hash());
    assert_eq!(quoted.hash_prefix(), bare.hash_prefix());
}

#[test]
fn hash_is_sha256_of_the_unquoted_key() {
    let key = parse_value(b"\"abc\"", &lenient()).expect("valid");
    // SHA-256("abc") from FIPS 180-2.
    let want = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    assert_eq!(hex::encode(key.hash()), want);
    assert_eq!(key.hash_prefix(), &want[..12]);
}

#[test]
fn debug_and_display_are_redacted() {
    let key = parse_value(b"\"my-secret-key\"", &lenient()).expect("valid");
    let expected = format!("IdempotencyKey({})", key.hash_prefix());
    for shown in [format!("{key:?}"), format!("{key:#?}"), format!("{key}")] {
        assert!(!shown.contains("my-secret-key"), "{shown}");
        assert_eq!(shown, expected);
    }
}

#[test]
fn from_headers_cases() {
    let name = HeaderName::from_static("idempotency-key");
    let policy = lenient();

    let empty = HeaderMap::new();
    assert_eq!(from_headers(&empty, &name, &policy), Err(KeyError::Missing));

    let mut one = HeaderMap::new();
    one.insert(&name, HeaderValue::from_static("\"abc\""));
    assert_eq!(
        from_headers(&one, &name, &policy).map(|k| k.as_str().to_owned()),
        Ok("abc".to_owned())
    );

    let mut two = HeaderMap::new();
    two.append(&name, HeaderValue::from_static("\"abc\""));
    two.append(&name, HeaderValue::from_static("\"abc\""));
    match from_headers(&two, &name, &policy) {
        Err(KeyError::Invalid(msg)) => {
            assert!(
                msg.contains("Idempotency-Key header appears more than once"),
                "{msg}"
            );
        }
        other => panic!("expected Invalid, got {other:?}"),
    }

    let mut blank = HeaderMap::new();
    blank.insert(&name, HeaderValue::from_static(""));
    assert!(matches!(
        from_headers(&blank, &name, &policy),
        Err(KeyError::Invalid(_))
    ));

    let mut obs_text = HeaderMap::new();
    let value = HeaderValue::from_bytes(b"caf\xC3\xA9").expect("obs-text is a valid header value");
    obs_text.insert(&name, value);
    assert!(matches!(
        from_headers(&obs_text, &name, &policy),
        Err(KeyError::Invalid(_))
    ));
}

#[test]
fn from_headers_custom_name() {
    let custom = HeaderName::from_static("x-request-key");
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", HeaderValue::from_static("other"));
    assert_eq!(
        from_headers(&headers, &custom, &lenient()),
        Err(KeyError::Missing)
    );
    headers.insert(&custom, HeaderValue::from_static("abc"));
    let key = from_headers(&headers, &custom, &lenient()).expect("valid");
    assert_eq!(key.as_str(), "abc");

    headers.append(&custom, HeaderValue::from_static("abc"));
    match from_headers(&headers, &custom, &lenient()) {
        Err(KeyError::Invalid(msg)) => assert!(msg.contains("x-request-key"), "{msg}"),
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn never_panics_on_arbitrary_bytes() {
    // Every single byte and every pair, under both modes: errors are fine, panics are not.
    for policy in [lenient(), strict(), uuid_policy()] {
        for a in 0..=255u8 {
            let _ = parse_value(&[a], &policy);
            for b in 0..=255u8 {
                let _ = parse_value(&[b'"', a, b], &policy);
            }
        }
    }
}

#[test]
fn key_format_serde_names() {
    assert_eq!(
        serde_json::to_string(&KeyFormat::Uuid).expect("serialize"),
        "\"uuid\""
    );
    assert_eq!(
        serde_json::from_str::<KeyFormat>("\"any\"").expect("deserialize"),
        KeyFormat::Any
    );
}

#[test]
fn a_models_key_has_a_hash_of_its_own_and_a_clients_keeps_its_own() {
    let key = parse_value(b"\"rt-2\"", &KeyPolicy::default()).unwrap();
    let plain: [u8; 32] = Sha256::digest(b"rt-2").into();
    assert_eq!(key.hash(), plain, "a client's key hash is unchanged");
    let model = key.clone().in_model_scope();
    assert_ne!(model.hash(), plain);
    let scoped: [u8; 32] = Sha256::digest(b"idemgate/model-key\0rt-2").into();
    assert_eq!(model.hash(), scoped, "as docs/mcp.md says");
    assert_eq!(model.hash(), model_key_hash("rt-2"));
    assert_eq!(model.as_str(), "rt-2");
}
