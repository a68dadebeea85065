//! The canonical form and its hash: what makes two requests the same.

use super::*;
use serde_json::json;

fn no_ignore() -> FingerprintPolicy {
    FingerprintPolicy::default()
}

fn ignoring(pointers: &[&str]) -> FingerprintPolicy {
    FingerprintPolicy {
        ignore: pointers
            .iter()
            .map(|p| JsonPointer::parse(p).expect("valid pointer"))
            .collect(),
    }
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).expect("valid JSON")
}

fn fp_json(body: &str, policy: &FingerprintPolicy) -> String {
    fingerprint_request(
        "POST",
        "/orders",
        Some("application/json"),
        body.as_bytes(),
        policy,
    )
}

#[test]
fn rfc8785_section_3_2_2_example() {
    let input = r#"{
        "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
        "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
        "literals": [null, true, false]
    }"#;
    let want = "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"€$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";
    assert_eq!(canonical_json(&parse(input), &no_ignore()), want);
}

#[test]
fn rfc8785_section_3_2_3_sorting() {
    let input = r#"{
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\ud83d\ude00": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis"
    }"#;
    let want = concat!(
        "{\"\\r\":\"Carriage Return\",",
        "\"1\":\"One\",",
        "\"\u{0080}\":\"Control\",",
        "\"\u{00f6}\":\"Latin Small Letter O With Diaeresis\",",
        "\"\u{20ac}\":\"Euro Sign\",",
        "\"\u{1f600}\":\"Emoji: Grinning Face\",",
        "\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
    );
    assert_eq!(canonical_json(&parse(input), &no_ignore()), want);
}

#[test]
fn rfc8785_number_serialisation() {
    // Cases from RFC 8785 Appendix B and section 3.2.2.3.
    let cases = [
        ("0", "0"),
        ("-0", "0"),
        ("-0.0", "0"),
        ("1e21", "1e+21"),
        ("1e20", "100000000000000000000"),
        ("0.1", "0.1"),
        ("1e-7", "1e-7"),
        ("-1e-7", "-1e-7"),
        ("0.000001", "0.000001"),
        ("1.0", "1"),
        ("4.50", "4.5"),
        ("12e1", "120"),
        ("5e-324", "5e-324"),
        ("1.7976931348623157e308", "1.7976931348623157e+308"),
        ("-1.7976931348623157e308", "-1.7976931348623157e+308"),
        ("9007199254740992", "9007199254740992"),
        ("295147905179352830000", "295147905179352830000"),
        ("333333333.33333329", "333333333.3333333"),
        ("1E30", "1e+30"),
        ("0.000000000000000000000000001", "1e-27"),
    ];
    for (input, want) in cases {
        assert_eq!(canonical_json(&parse(input), &no_ignore()), want, "{input}");
    }
}

#[test]
fn reordered_and_reindented_json_matches() {
    let a = r#"{"amount":100,"currency":"EUR","items":[{"sku":"a","qty":1}]}"#;
    let b = "{\n  \"items\": [ { \"qty\": 1, \"sku\": \"a\" } ],\n  \"currency\": \"EUR\",\n  \"amount\": 1.0e2\n}\n";
    assert_eq!(fp_json(a, &no_ignore()), fp_json(b, &no_ignore()));
    let c = r#"{"amount":101,"currency":"EUR","items":[{"sku":"a","qty":1}]}"#;
    assert_ne!(fp_json(a, &no_ignore()), fp_json(c, &no_ignore()));
    // Array order is significant.
    assert_ne!(
        fp_json("[1,2]", &no_ignore()),
        fp_json("[2,1]", &no_ignore())
    );
}

#[test]
fn json_media_types() {
    let compact = br#"{"a":1,"b":2}"#;
    let spaced = br#"{ "b": 2, "a": 1 }"#;
    let reference = fingerprint_request(
        "POST",
        "/x",
        Some("application/json"),
        compact,
        &no_ignore(),
    );
    for ct in [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON;charset=UTF-8",
        " application/json ",
        "application/merge-patch+json",
        "application/problem+json; charset=utf-8",
        "APPLICATION/VND.API+JSON",
    ] {
        let got = fingerprint_request("POST", "/x", Some(ct), spaced, &no_ignore());
        assert_eq!(got, reference, "{ct}");
    }
    for ct in [
        "text/plain",
        "application/jsonx",
        "application/+json",
        "json",
        "application/octet-stream",
    ] {
        let got = fingerprint_request("POST", "/x", Some(ct), spaced, &no_ignore());
        assert_ne!(got, reference, "{ct} must not be treated as JSON");
    }
}

#[test]
fn ignored_pointers() {
    let cases: Vec<(&str, &[&str], &str, &str)> = vec![
        (
            "top-level",
            &["/sent_at"],
            r#"{"a":1,"sent_at":"2024-01-01T00:00:00Z"}"#,
            r#"{"a":1}"#,
        ),
        (
            "nested",
            &["/metadata/trace_id"],
            r#"{"a":1,"metadata":{"trace_id":"x","k":"v"}}"#,
            r#"{"a":1,"metadata":{"k":"v"}}"#,
        ),
        ("~1 escape", &["/a~1b"], r#"{"a/b":1,"c":2}"#, r#"{"c":2}"#),
        ("~0 escape", &["/a~0b"], r#"{"a~b":1,"c":2}"#, r#"{"c":2}"#),
        (
            "~01 is ~1 literally",
            &["/a~01"],
            r#"{"a~1":1,"a/":2}"#,
            r#"{"a/":2}"#,
        ),
        (
            "array index",
            &["/items/1"],
            r#"{"items":[1,2,3]}"#,
            r#"{"items":[1,3]}"#,
        ),
        (
            "through an array",
            &["/items/0/ts"],
            r#"{"items":[{"ts":1,"v":2}]}"#,
            r#"{"items":[{"v":2}]}"#,
        ),
        ("empty member name", &["/"], r#"{"":1,"a":2}"#, r#"{"a":2}"#),
        ("missing member", &["/nope"], r#"{"a":1}"#, r#"{"a":1}"#),
        (
            "missing parent",
            &["/nope/deeper"],
            r#"{"a":1}"#,
            r#"{"a":1}"#,
        ),
        (
            "index out of range",
            &["/items/9"],
            r#"{"items":[1]}"#,
            r#"{"items":[1]}"#,
        ),
        (
            "leading-zero index",
            &["/items/01"],
            r#"{"items":[1,2]}"#,
            r#"{"items":[1,2]}"#,
        ),
        (
            "dash index",
            &["/items/-"],
            r#"{"items":[1,2]}"#,
            r#"{"items":[1,2]}"#,
        ),
        ("through a scalar", &["/a/b"], r#"{"a":1}"#, r#"{"a":1}"#),
        ("non-object document", &["/a"], "[1,2]", "[1,2]"),
        (
            "several, in order",
            &["/sent_at", "/metadata/trace_id"],
            r#"{"sent_at":1,"metadata":{"trace_id":2},"x":3}"#,
            r#"{"metadata":{},"x":3}"#,
        ),
    ];
    for (name, pointers, body, want) in cases {
        let policy = ignoring(pointers);
        assert_eq!(canonical_json(&parse(body), &policy), want, "{name}");
        assert_eq!(
            fp_json(body, &policy),
            fp_json(want, &no_ignore()),
            "{name}: fingerprint"
        );
    }
    // A retry differing only in an ignored member has the same fingerprint.
    let policy = ignoring(&["/sent_at"]);
    assert_eq!(
        fp_json(r#"{"a":1,"sent_at":"t1"}"#, &policy),
        fp_json(r#"{"sent_at":"t2","a":1}"#, &policy)
    );
    assert_ne!(
        fp_json(r#"{"a":1,"sent_at":"t1"}"#, &no_ignore()),
        fp_json(r#"{"a":1,"sent_at":"t2"}"#, &no_ignore())
    );
}

#[test]
fn pointer_parsing() {
    let ok = JsonPointer::parse("/a~1b/~0/0").expect("valid");
    assert_eq!(ok.as_str(), "/a~1b/~0/0");
    assert_eq!(ok.tokens, ["a/b", "~", "0"]);
    assert_eq!(ok.to_string(), "/a~1b/~0/0");
    assert_eq!("/x".parse::<JsonPointer>(), JsonPointer::parse("/x"));

    let bad = [
        ("", "must not be empty"),
        ("sent_at", "must start with '/'"),
        ("/a~2", "'~'"),
        ("/a~", "'~'"),
    ];
    for (input, want) in bad {
        match JsonPointer::parse(input) {
            Ok(p) => panic!("{input:?} accepted as {p:?}"),
            Err(msg) => assert!(msg.contains(want), "{input:?}: {msg}"),
        }
    }
}

#[test]
fn form_bodies() {
    let form = Some("application/x-www-form-urlencoded");
    let fp = |ct: Option<&str>, body: &str| {
        fingerprint_request("POST", "/f", ct, body.as_bytes(), &no_ignore())
    };
    let reference = fp(form, "a=1&b=2&b=1");
    assert_eq!(fp(form, "b=1&a=1&b=2"), reference);
    assert_eq!(fp(form, "b=2&b=1&a=1"), reference);
    assert_eq!(
        fp(
            Some("Application/X-WWW-Form-Urlencoded; charset=UTF-8"),
            "b=1&a=1&b=2"
        ),
        reference
    );
    // Encodings of the same text are the same pair.
    assert_eq!(fp(form, "q=a+b"), fp(form, "q=a%20b"));
    assert_ne!(fp(form, "a=1&b=2"), fp(form, "a=2&b=1"));
    assert_ne!(fp(form, "a=1"), fp(form, "a=1&a=1"));
    // Not a form type: order matters.
    assert_ne!(
        fp(Some("text/plain"), "a=1&b=2"),
        fp(Some("text/plain"), "b=2&a=1")
    );
    // Undecodable bytes fall back to raw bytes, so distinct ones stay distinct.
    assert_ne!(fp(form, "a=%FF"), fp(form, "a=%FE"));
    let raw = fingerprint_request("POST", "/f", form, b"a=\xff", &no_ignore());
    assert_eq!(
        raw,
        fingerprint_request("POST", "/f", None, b"a=\xff", &no_ignore())
    );
}

#[test]
fn invalid_json_is_hashed_as_bytes() {
    let ct = Some("application/json");
    let bodies: [&[u8]; 6] = [b"{", b"{\"a\":1,}", b"\xff\xfe", b"1e400", b"[1] [2]", b""];
    for body in bodies {
        let a = fingerprint_request("POST", "/x", ct, body, &ignoring(&["/a"]));
        let b = fingerprint_request("POST", "/x", ct, body, &ignoring(&["/a"]));
        assert_eq!(a, b, "deterministic");
        assert_eq!(a.len(), 64);
        // Hashed as bytes: the same as without a content type.
        assert_eq!(
            a,
            fingerprint_request("POST", "/x", None, body, &no_ignore())
        );
    }
    assert_ne!(
        fingerprint_request("POST", "/x", ct, b"{", &no_ignore()),
        fingerprint_request("POST", "/x", ct, b"{{", &no_ignore())
    );
    // Nesting beyond serde_json's recursion limit is just invalid JSON here.
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let _ = fingerprint_request("POST", "/x", ct, deep.as_bytes(), &no_ignore());
}

#[test]
fn query_order_and_method_case() {
    let fp = |m: &str, p: &str| fingerprint_request(m, p, None, b"", &no_ignore());
    let reference = fp("POST", "/p?a=1&b=2");
    assert_eq!(fp("POST", "/p?b=2&a=1"), reference);
    assert_eq!(fp("POST", "/p?&b=2&&a=1&"), reference);
    assert_eq!(fp("post", "/p?a=1&b=2"), reference);
    assert_eq!(fp("Post", "/p?b=2&a=1"), reference);
    assert_ne!(fp("PUT", "/p?a=1&b=2"), reference);
    assert_ne!(fp("POST", "/p?a=1&b=3"), reference);
    assert_ne!(fp("POST", "/q?a=1&b=2"), reference);
    assert_eq!(fp("GET", "/p?"), fp("GET", "/p"));
    assert_eq!(fp("GET", "/p?&"), fp("GET", "/p"));
    // Raw segments: no decoding, so differently encoded queries differ.
    assert_ne!(fp("GET", "/p?q=a%20b"), fp("GET", "/p?q=a+b"));
    // Only the first '?' splits.
    assert_eq!(fp("GET", "/p?b=?&a=1"), fp("GET", "/p?a=1&b=?"));
    assert_eq!(canonical_target("/p?b=2&a=1&a=0"), "/p?a=0&a=1&b=2");
}

#[test]
fn framing_is_unambiguous() {
    let fp = |m: &str, p: &str, body: &[u8]| fingerprint_request(m, p, None, body, &no_ignore());
    // Moving bytes between fields must change the digest.
    assert_ne!(fp("GET", "/a\n4:body", b""), fp("GET", "/a", b"body"));
    assert_ne!(fp("GE", "T/a", b""), fp("G", "ET/a", b""));
    // JSON, form and bytes with identical canonical bytes differ by their kind tag.
    let json = fingerprint_request("POST", "/", Some("application/json"), b"1", &no_ignore());
    let bytes = fingerprint_request("POST", "/", None, b"1", &no_ignore());
    assert_ne!(json, bytes);
}

#[test]
fn output_is_lowercase_hex_sha256() {
    let got = fingerprint_request("GET", "/", None, b"", &no_ignore());
    assert_eq!(got.len(), 64);
    assert!(got.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
    // Pin the framing: this is the published v1 canonical form.
    let canonical = b"idemgate-fp-v1\n3:GET\n1:/\n5:bytes\n0:\n";
    assert_eq!(got, hex::encode(Sha256::digest(canonical)));
}

#[test]
fn json_request_equals_request() {
    let policies = [no_ignore(), ignoring(&["/sent_at", "/items/0", "/m~1n"])];
    let values = [
        json!({"b": [1, 2.5, -0.0, 1e21], "a": "x", "sent_at": "t", "m/n": null}),
        json!({"items": [{"k": 1}, {"k": 2}], "u": 18_446_744_073_709_551_615u64}),
        json!([3, 2, 1]),
        json!("text"),
        json!(null),
        json!(1.0),
        json!({}),
    ];
    for policy in &policies {
        for value in &values {
            let bytes = serde_json::to_vec(value).expect("serialize");
            let via_request = fingerprint_request(
                "post",
                "/o?b=1&a=2",
                Some("application/json"),
                &bytes,
                policy,
            );
            assert_eq!(
                fingerprint_json_request("post", "/o?b=1&a=2", Some(value), policy),
                via_request,
                "{value}"
            );
            // And both are the canonical text, hashed as JSON.
            let canonical = canonical_json(value, policy);
            assert_eq!(
                via_request,
                digest("POST", "/o?b=1&a=2", "json", canonical.as_bytes())
            );
        }
        assert_eq!(
            fingerprint_json_request("GET", "/o", None, policy),
            fingerprint_request("GET", "/o", None, b"", policy)
        );
    }
}

#[test]
fn method_constant() {
    assert!(METHOD.starts_with("sha256 over method, path with sorted query"));
}
