//! The form of a request path that per-route rules are matched against, so
//! that a client cannot step around a rule by spelling the path differently
//! (`//pay`, `/x/../pay`, `/./pay`, `/%70ay` for `/pay`). The request that
//! goes on to the service or the upstream keeps its path as sent.

use std::borrow::Cow;

/// `path` with percent-encoded unreserved characters decoded (RFC 3986
/// §6.2.2.2: `ALPHA`, `DIGIT`, `-`, `.`, `_`, `~`), repeated slashes merged,
/// and `.` and `..` segments removed (§5.2.4; `..` never climbs above the
/// root). Decoding comes first, so `%2e%2e` is a `..` segment. Reserved
/// characters such as `%2F` stay encoded, and a `%` not followed by two hex
/// digits stays as it is.
///
/// A path that does not start with `/` (`*`, or an empty one) is returned
/// unchanged, and so, without allocating, is one that is already normal.
pub(crate) fn normalize(path: &str) -> Cow<'_, str> {
    if !path.starts_with('/') || is_normal(path) {
        return Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path);
    Cow::Owned(remove_dot_segments(&decoded))
}

/// No encoded unreserved character, no empty segment but a trailing one, and
/// no dot segment.
fn is_normal(path: &str) -> bool {
    let bytes = path.as_bytes();
    let encoded = (0..bytes.len()).any(|i| encoded_unreserved(bytes, i).is_some());
    !encoded && !path.contains("//") && path[1..].split('/').all(|s| s != "." && s != "..")
}

/// The unreserved character that `bytes[i..i + 3]` percent-encodes, if any.
fn encoded_unreserved(bytes: &[u8], i: usize) -> Option<u8> {
    let [b'%', hi, lo, ..] = *bytes.get(i..)? else {
        return None;
    };
    let hex = |b: u8| char::from(b).to_digit(16);
    let c = u8::try_from(hex(hi)? * 16 + hex(lo)?).ok()?;
    (c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~')).then_some(c)
}

/// `path` with its percent-encoded unreserved characters decoded.
fn decode_unreserved(path: &str) -> Cow<'_, str> {
    let bytes = path.as_bytes();
    let mut out: Option<String> = None;
    let mut copied = 0;
    let mut i = 0;
    while i < bytes.len() {
        if let Some(c) = encoded_unreserved(bytes, i) {
            let out = out.get_or_insert_with(|| String::with_capacity(path.len()));
            out.push_str(&path[copied..i]);
            out.push(char::from(c));
            i += 3;
            copied = i;
        } else {
            i += 1;
        }
    }
    match out {
        Some(mut out) => {
            out.push_str(&path[copied..]);
            Cow::Owned(out)
        }
        None => Cow::Borrowed(path),
    }
}

/// `path` (which starts with `/`) with empty, `.` and `..` segments resolved.
/// A path whose last segment is empty, `.` or `..` ends with `/`.
fn remove_dot_segments(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut last = "";
    for segment in path[1..].split('/') {
        last = segment;
        match segment {
            "" | "." => {}
            ".." => out.truncate(out.rfind('/').unwrap_or(0)),
            _ => {
                out.push('/');
                out.push_str(segment);
            }
        }
    }
    if out.is_empty() || matches!(last, "" | "." | "..") {
        out.push('/');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_what_a_client_could_spell_differently() {
        for (raw, want) in [
            // Already normal.
            ("/", "/"),
            ("/pay", "/pay"),
            ("/pay/", "/pay/"),
            ("/v1/acme/charges", "/v1/acme/charges"),
            ("/a/.../b", "/a/.../b"),
            ("/a/.b/..c/b.", "/a/.b/..c/b."),
            ("/a%2Fb", "/a%2Fb"),
            ("/a%2fb", "/a%2fb"),
            ("/caf%C3%A9", "/caf%C3%A9"),
            ("/a%20b", "/a%20b"),
            ("/%zz", "/%zz"),
            ("/a%", "/a%"),
            ("/a%7", "/a%7"),
            ("/%%70ay", "/%pay"),
            // Repeated slashes.
            ("//pay", "/pay"),
            ("///pay//1", "/pay/1"),
            ("/pay//", "/pay/"),
            ("//", "/"),
            // Dot segments.
            ("/./pay", "/pay"),
            ("/x/../pay", "/pay"),
            ("/a/b/../../..", "/"),
            ("/../pay", "/pay"),
            ("/..", "/"),
            ("/.", "/"),
            ("/pay/.", "/pay/"),
            ("/pay/1/..", "/pay/"),
            ("/a/b/../c/./d", "/a/c/d"),
            ("/a//../b", "/b"),
            // Percent-encoded unreserved characters.
            ("/%70ay", "/pay"),
            ("/%50AY", "/PAY"),
            ("/%7e", "/~"),
            ("/%7E", "/~"),
            ("/%41%2d%5f%2E%30", "/A-_.0"),
            ("/%2e%2e/pay", "/pay"),
            ("/x/%2E%2e/pay", "/pay"),
            ("/%2e/pay", "/pay"),
            ("/x/.%2e/p%61y%2F1", "/pay%2F1"),
            // Not a path: as it is.
            ("", ""),
            ("*", "*"),
        ] {
            assert_eq!(normalize(raw), want, "{raw:?}");
        }
    }

    #[test]
    fn a_normal_path_is_borrowed() {
        for path in ["/", "/pay", "/pay/", "/a%2Fb/%zz", "/a/.../b"] {
            assert!(matches!(normalize(path), Cow::Borrowed(_)), "{path:?}");
        }
        for path in ["//pay", "/./pay", "/%70ay"] {
            assert!(matches!(normalize(path), Cow::Owned(_)), "{path:?}");
        }
    }

    #[test]
    fn normalizing_twice_changes_nothing() {
        for path in ["/%252e%252e/pay", "/a/%2e%2e%2f/b", "/x/..//./%7e/"] {
            let once = normalize(path).into_owned();
            assert_eq!(normalize(&once), once, "{path:?}");
        }
    }
}
