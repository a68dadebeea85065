//! The fingerprint of arbitrary bytes sent as a form body: never a panic;
//! a body that decodes (no U+FFFD) has the fingerprint of its pairs in
//! reverse order, re-encoded; one that does not is hashed as bytes.
#![no_main]

use idemgate::fingerprint::{FingerprintPolicy, fingerprint_request};
use libfuzzer_sys::fuzz_target;

const FORM: &str = "application/x-www-form-urlencoded";

fuzz_target!(|data: &[u8]| {
    let none = FingerprintPolicy::default();
    let got = fingerprint_request("POST", "/f", Some(FORM), data, &none);
    assert_eq!(got.len(), 64);
    let pairs: Vec<(String, String)> = form_urlencoded::parse(data)
        .map(|(n, v)| (n.into_owned(), v.into_owned()))
        .collect();
    let lossy = pairs
        .iter()
        .any(|(n, v)| n.contains('\u{FFFD}') || v.contains('\u{FFFD}'));
    if lossy {
        assert_eq!(got, fingerprint_request("POST", "/f", None, data, &none));
    } else {
        let reversed = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(pairs.iter().rev())
            .finish();
        assert_eq!(
            fingerprint_request(
                "POST",
                "/f",
                Some("Application/X-WWW-Form-Urlencoded; charset=UTF-8"),
                reversed.as_bytes(),
                &none
            ),
            got
        );
    }
});
