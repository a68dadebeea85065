//! Per-route rules from the `--config` file's top-level `[[routes]]` array:
//!
//! ```toml
//! [[routes]]
//! path = "/payments/"        # a prefix; or a glob such as "/v1/*/charges"
//! methods = ["POST", "PUT"]  # guarded methods here (default: IDEMGATE_METHODS)
//! require_key = true         # default: IDEMGATE_REQUIRE_KEY
//! ttl_seconds = 3600         # default: IDEMGATE_DEFAULT_TTL
//! on_lease_expiry = "takeover"  # default: IDEMGATE_ON_LEASE_EXPIRY (hold)
//! ```
//!
//! The first rule whose path matches applies; what it leaves out comes from
//! the global settings. The request path (without its query) is matched after
//! normalization: percent-encoded unreserved characters (RFC 3986 §6.2.2.2)
//! decoded, repeated slashes merged, then `.` and `..` segments resolved
//! (§5.2.4, never above the root), so `//pay`, `/x/../pay` and `/%70ay` all
//! match a rule for `/pay`; reserved characters such as `%2F` stay encoded,
//! and the path forwarded upstream is unchanged.

use std::path::Path;
use std::time::Duration;

use http::Method;
use serde::Deserialize;

use crate::layer::Route;
use crate::server::config::{ConfigError, file};
use crate::store::LeaseExpiry;

/// One `[[routes]]` entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteEntry {
    path: String,
    methods: Option<Vec<String>>,
    require_key: Option<bool>,
    ttl_seconds: Option<u32>,
    on_lease_expiry: Option<String>,
}

/// The rules of the file at `path`; `max_ttl` bounds `ttl_seconds`.
///
/// # Errors
/// A [`ConfigError`] of the `config` setting (named as it was given, which
/// shows the file) naming the entry and the field.
pub fn from_file(path: &Path, max_ttl: u32) -> Result<Vec<Route>, ConfigError> {
    let table = file::read(path)?;
    // Named as the `config` setting, whose name shows the path.
    from_table(&table, max_ttl).map_err(|problem| ConfigError {
        setting: "config",
        problem,
    })
}

/// The rules of a parsed config file.
///
/// # Errors
/// What is wrong, naming the entry and the field.
pub fn from_table(table: &toml::Table, max_ttl: u32) -> Result<Vec<Route>, String> {
    if table
        .get("proxy")
        .and_then(toml::Value::as_table)
        .is_some_and(|t| t.contains_key("routes"))
    {
        return Err("routes belong at the top level ([[routes]]), not in [proxy]".into());
    }
    let Some(value) = table.get("routes") else {
        return Ok(Vec::new());
    };
    let Some(entries) = value.as_array() else {
        return Err("routes must be an array of tables ([[routes]])".into());
    };
    entries
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            route(entry, max_ttl)
                .map_err(|e| format!("routes[{i}] ([[routes]] number {}): {e}", i + 1))
        })
        .collect()
}

fn route(value: &toml::Value, max_ttl: u32) -> Result<Route, String> {
    let entry: RouteEntry = value
        .clone()
        .try_into()
        .map_err(|e: toml::de::Error| e.message().to_owned())?;
    let mut route = Route::new(entry.path.trim())?;
    if let Some(methods) = entry.methods {
        let parsed = methods
            .iter()
            .map(|m| {
                let m = m.trim().to_ascii_uppercase();
                Method::from_bytes(m.as_bytes())
                    .map_err(|_| format!("methods: {m:?} is not an HTTP method"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        route.methods = Some(parsed);
    }
    route.require_key = entry.require_key;
    if let Some(ttl) = entry.ttl_seconds {
        if !(1..=max_ttl).contains(&ttl) {
            return Err(format!(
                "ttl_seconds is {ttl}; it must be between 1 and {max_ttl} (IDEMGATE_MAX_TTL)"
            ));
        }
        route.ttl = Some(Duration::from_secs(u64::from(ttl)));
    }
    if let Some(choice) = entry.on_lease_expiry {
        route.on_lease_expiry =
            Some(LeaseExpiry::parse(&choice).map_err(|e| format!("on_lease_expiry: {e}"))?);
    }
    Ok(route)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<Route>, String> {
        from_table(&text.parse().unwrap(), 86_400)
    }

    #[test]
    fn reads_prefix_and_glob_rules() {
        let routes = parse(
            r#"
            [[routes]]
            path = "/payments/"
            require_key = true
            [[routes]]
            path = "/v1/*/charges"
            methods = ["post", "PUT"]
            ttl_seconds = 60
            on_lease_expiry = "takeover"
            "#,
        )
        .unwrap();
        assert_eq!(routes.len(), 2);
        assert_eq!(routes[0].require_key, Some(true));
        assert!(routes[1].matches("/v1/acme/charges"));
        assert_eq!(routes[1].methods, Some(vec![Method::POST, Method::PUT]));
        assert_eq!(routes[1].ttl, Some(Duration::from_secs(60)));
        assert_eq!(routes[1].on_lease_expiry, Some(LeaseExpiry::Takeover));
        assert_eq!(routes[0].on_lease_expiry, None);
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn errors_name_the_entry_and_field() {
        for (text, want) in [
            ("[[routes]]\npath = \"/a\"\nttl_seconds = 0", "routes[0]"),
            ("[[routes]]\npath = \"/a\"\nnope = 1", "nope"),
            ("[[routes]]\nmethods = [\"POST\"]", "path"),
            ("[[routes]]\npath = \"a\"", "start with '/'"),
            (
                "[[routes]]\npath = \"/a\"\nmethods = [\"P O\"]",
                "not an HTTP method",
            ),
            ("routes = 1", "array"),
            (
                "[[routes]]\npath = \"/a\"\non_lease_expiry = \"retry\"",
                "on_lease_expiry",
            ),
            ("[proxy]\n[[proxy.routes]]\npath = \"/a\"", "top level"),
        ] {
            let err = parse(text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
        }
    }
}
