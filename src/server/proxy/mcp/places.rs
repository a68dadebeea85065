//! Where a guarded call's key is read from: `IDEMGATE_MCP_KEY_FROM`
//! (`--mcp-key-from`), a comma-separated list of places, first found wins.
//!
//! * `meta:NAME`: `params._meta[NAME]`, set by a runtime (idemgate's own
//!   `dev.idemgate/idempotency-key`; the commerce protocols'
//!   `idempotency-key` (UCP) and `idempotency_key` (ACP)).
//! * `header`: the key header (`IDEMGATE_KEY_HEADER`), set by a runtime.
//! * `param:NAME`: `params[NAME]`, set by a runtime (SEP-3182's
//!   `params.idempotencyKey`). Forwarded, as servers that take it read it
//!   there, and never part of the fingerprint.
//! * `argument:NAME`: `params.arguments[NAME]`, set by a model. Removed from
//!   the arguments before the call is forwarded and fingerprinted, unless
//!   the tool declares that argument itself; its keys live in a scope of
//!   their own (`ModelKey`).
//!
//! Runtime places come before model places, so that a key a model invents
//! never beats the runtime's: a list that puts an `argument:` before a
//! runtime place is refused at startup, as are an empty list, an unknown
//! kind and a place named twice.

use std::fmt;

/// The places of the default list, in order.
pub const DEFAULT_KEY_FROM: &str = "meta:dev.idemgate/idempotency-key,meta:idempotency-key,\
    meta:idempotency_key,header,argument:idempotency_key,argument:idempotencyKey";

/// Members of `params` that are the call's own, never a key.
const CALL_PARAMS: [&str; 6] = [
    "name",
    "arguments",
    "_meta",
    "task",
    "inputResponses",
    "requestState",
];

/// One place of a `tools/call` request a key may be in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyPlace {
    /// `meta:NAME`: `params._meta[NAME]`, a runtime's.
    Meta(String),
    /// `header`: the key header, a runtime's.
    Header,
    /// `param:NAME`: `params[NAME]`, a runtime's; forwarded, never
    /// fingerprinted.
    Param(String),
    /// `argument:NAME`: `params.arguments[NAME]`, a model's.
    Argument(String),
}

impl KeyPlace {
    /// `meta:NAME`, `header`, `param:NAME` or `argument:NAME` (the kind in
    /// any case), the form `IDEMGATE_MCP_KEY_FROM` takes.
    ///
    /// # Errors
    /// What is wrong with `s`, to follow the setting's name.
    pub fn parse(s: &str) -> Result<KeyPlace, String> {
        let given = s.trim();
        if given.is_empty() {
            return Err(
                "names an empty place (an empty list, or nothing between two commas); give a \
                 comma-separated list of meta:NAME, header, param:NAME and argument:NAME"
                    .into(),
            );
        }
        let (kind, name) = match given.split_once(':') {
            Some((kind, name)) => (kind.trim(), Some(name.trim())),
            None => (given, None),
        };
        let kind = kind.to_ascii_lowercase();
        let named = |make: fn(String) -> KeyPlace| match name {
            Some(name) if !name.is_empty() => Ok(make(name.to_owned())),
            _ => Err(format!("{given:?} names no member: give {kind}:NAME")),
        };
        let place = match kind.as_str() {
            "header" if name.is_none() => KeyPlace::Header,
            "header" => {
                return Err(format!(
                    "{given:?}: `header` takes no name; the key header is IDEMGATE_KEY_HEADER \
                     (--key-header)"
                ));
            }
            "meta" => named(KeyPlace::Meta)?,
            "param" => named(KeyPlace::Param)?,
            "argument" => named(KeyPlace::Argument)?,
            _ => {
                return Err(format!(
                    "{given:?} is not a place a key is read from: give meta:NAME \
                     (params._meta[NAME]), header (the key header), param:NAME (params[NAME]) \
                     or argument:NAME (params.arguments[NAME])"
                ));
            }
        };
        match &place {
            KeyPlace::Param(name) if CALL_PARAMS.contains(&name.as_str()) => Err(format!(
                "{given:?}: params.{name} is the call's own, never a key"
            )),
            KeyPlace::Meta(name)
                if name == "progressToken" || name.starts_with("io.modelcontextprotocol/") =>
            {
                Err(format!(
                    "{given:?}: _meta[{name:?}] is the protocol's own, never a key"
                ))
            }
            _ => Ok(place),
        }
    }

    /// Whether a model sets what is in this place (an argument), rather
    /// than a runtime.
    pub fn is_models(&self) -> bool {
        matches!(self, KeyPlace::Argument(_))
    }

    /// The place as a message names it: `_meta["idempotency-key"]`, the
    /// key header, `params.idempotencyKey`, the `idempotency_key` argument.
    pub fn described(&self) -> String {
        match self {
            KeyPlace::Meta(name) => format!("_meta[{name:?}]"),
            KeyPlace::Header => "the key header".into(),
            KeyPlace::Param(name) => format!("params.{name}"),
            KeyPlace::Argument(name) => format!("the {name} argument"),
        }
    }
}

impl fmt::Display for KeyPlace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPlace::Meta(name) => write!(f, "meta:{name}"),
            KeyPlace::Header => f.write_str("header"),
            KeyPlace::Param(name) => write!(f, "param:{name}"),
            KeyPlace::Argument(name) => write!(f, "argument:{name}"),
        }
    }
}

/// The places a call's key is read from, in order: runtime places, then
/// model places.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFrom(Vec<KeyPlace>);

impl Default for KeyFrom {
    fn default() -> KeyFrom {
        let places = DEFAULT_KEY_FROM
            .split(',')
            .map(|p| KeyPlace::parse(p).expect("the default places parse"))
            .collect();
        KeyFrom::new(places).expect("the default list is valid")
    }
}

impl KeyFrom {
    /// `places` as a list the door reads keys from.
    ///
    /// # Errors
    /// An empty list, a place named twice, or a model's place (`argument:`)
    /// before a runtime's: a key a model invents must never beat the
    /// runtime's.
    pub fn new(places: Vec<KeyPlace>) -> Result<KeyFrom, String> {
        if places.is_empty() {
            return Err(format!(
                "names no place; give a comma-separated list, e.g. {DEFAULT_KEY_FROM}"
            ));
        }
        for (i, place) in places.iter().enumerate() {
            if places[..i].contains(place) {
                return Err(format!("names {place} twice"));
            }
        }
        if let Some(model) = places.iter().position(KeyPlace::is_models)
            && let Some(runtime) = places[model..].iter().find(|p| !p.is_models())
        {
            return Err(format!(
                "puts {} (a model's place) before {runtime} (a runtime's): runtime places come \
                 first, so that a key a model invents never beats the runtime's",
                places[model]
            ));
        }
        Ok(KeyFrom(places))
    }

    /// The places, in order.
    pub fn places(&self) -> &[KeyPlace] {
        &self.0
    }

    /// The arguments that are key places, in order.
    pub fn arguments(&self) -> impl Iterator<Item = &str> {
        self.0.iter().filter_map(|p| match p {
            KeyPlace::Argument(name) => Some(name.as_str()),
            _ => None,
        })
    }

    /// The argument `tools/list` answers offer a model: the first model
    /// place's, if any.
    pub fn advertised(&self) -> Option<&str> {
        self.arguments().next()
    }

    /// Whether the key header is one of the places.
    pub fn reads_header(&self) -> bool {
        self.0.contains(&KeyPlace::Header)
    }

    /// The JSON-Pointers of the `param:` places, which are forwarded and
    /// never part of the fingerprint.
    pub fn unfingerprinted(&self) -> Vec<String> {
        self.0
            .iter()
            .filter_map(|p| match p {
                KeyPlace::Param(name) => Some(format!(
                    "/params/{}",
                    name.replace('~', "~0").replace('/', "~1")
                )),
                _ => None,
            })
            .collect()
    }
}

impl fmt::Display for KeyFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, place) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{place}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(s: &str) -> Result<KeyFrom, String> {
        KeyFrom::new(
            s.split(',')
                .map(KeyPlace::parse)
                .collect::<Result<_, _>>()?,
        )
    }

    #[test]
    fn places_parse_and_print_back() {
        for (given, place) in [
            (
                "meta:dev.idemgate/idempotency-key",
                KeyPlace::Meta("dev.idemgate/idempotency-key".into()),
            ),
            (" Header ", KeyPlace::Header),
            (
                "param:idempotencyKey",
                KeyPlace::Param("idempotencyKey".into()),
            ),
            (
                "ARGUMENT: idempotency_key",
                KeyPlace::Argument("idempotency_key".into()),
            ),
        ] {
            assert_eq!(KeyPlace::parse(given), Ok(place.clone()), "{given}");
            assert_eq!(KeyPlace::parse(&place.to_string()), Ok(place));
        }
        for bad in [
            "",
            " ",
            "meta:",
            "meta",
            "argument: ",
            "header:X-Key",
            "cookie:k",
            "arguments:k",
            "idempotency_key",
            "param:name",
            "param:arguments",
            "param:_meta",
            "param:task",
            "meta:progressToken",
            "meta:io.modelcontextprotocol/protocolVersion",
        ] {
            assert!(KeyPlace::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn the_default_is_spec_12s_list() {
        let default = KeyFrom::default();
        assert_eq!(default.to_string(), DEFAULT_KEY_FROM);
        assert_eq!(default.advertised(), Some("idempotency_key"));
        assert_eq!(
            default.arguments().collect::<Vec<_>>(),
            ["idempotency_key", "idempotencyKey"]
        );
        assert!(default.reads_header());
        assert!(default.unfingerprinted().is_empty());
    }

    #[test]
    fn runtime_places_come_first_and_no_place_twice() {
        assert!(list("header,meta:k,param:idempotencyKey,argument:a,argument:b").is_ok());
        assert!(list("argument:a").is_ok());
        assert!(list("meta:k").is_ok());
        let said = list("argument:a,header").unwrap_err();
        assert!(
            said.contains("argument:a") && said.contains("header"),
            "{said}"
        );
        assert!(list("meta:k,argument:a,param:p").is_err());
        assert!(list("meta:k,header,meta:k").unwrap_err().contains("twice"));
        assert!(list("header,HEADER").is_err());
        assert!(KeyFrom::new(Vec::new()).is_err());
        // Names are case-sensitive: two places.
        assert!(list("argument:Key,argument:key").is_ok());
    }

    #[test]
    fn param_places_are_left_out_of_the_fingerprint() {
        let from = list("param:idempotencyKey,param:a/b~c,argument:k").unwrap();
        assert_eq!(
            from.unfingerprinted(),
            ["/params/idempotencyKey", "/params/a~1b~0c"]
        );
        assert!(!from.reads_header());
        assert_eq!(list("header,meta:k").unwrap().advertised(), None);
    }
}
