//! The fingerprint of arbitrary bytes sent as a JSON body: never a panic;
//! a body that parses has the fingerprint of its compact re-serialisation
//! (the canonical form does not depend on the spelling); one that does not
//! parse is hashed as bytes.
#![no_main]

use idemgate::fingerprint::{FingerprintPolicy, JsonPointer, fingerprint_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let none = FingerprintPolicy::default();
    let ignoring = FingerprintPolicy {
        ignore: ["/a", "/0", "/a/b", "/", "/~0~1"]
            .iter()
            .map(|p| JsonPointer::parse(p).expect("valid pointer"))
            .collect(),
    };
    for policy in [&none, &ignoring] {
        for ct in ["application/json", "application/vnd.x+json; charset=utf-8"] {
            let got = fingerprint_request("POST", "/x?b=1&a=2", Some(ct), data, policy);
            assert_eq!(got.len(), 64);
            match serde_json::from_slice::<serde_json::Value>(data) {
                Ok(value) => {
                    let compact = serde_json::to_vec(&value).expect("serialize");
                    let pretty = serde_json::to_vec_pretty(&value).expect("serialize");
                    for other in [compact, pretty] {
                        assert_eq!(
                            fingerprint_request("POST", "/x?a=2&b=1", Some(ct), &other, policy),
                            got
                        );
                    }
                }
                Err(_) => assert_eq!(
                    got,
                    fingerprint_request("POST", "/x?b=1&a=2", None, data, &none)
                ),
            }
        }
    }
});
