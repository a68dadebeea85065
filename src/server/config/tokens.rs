//! Settings that hold tokens: tenants' (`IDEMGATE_TOKENS`) and operators'
//! (`IDEMGATE_ADMIN_TOKENS`), parsed without ever repeating a token.

use crate::server::auth::Tokens;

/// The parser of a setting of tokens. Its errors never repeat the value: it
/// holds secrets (clap's own message for a refused value quotes the value
/// whole).
#[derive(Debug, Clone, Copy)]
pub struct TokensParser {
    flag: &'static str,
    variable: &'static str,
    parse: fn(&str) -> Result<Tokens, String>,
}

impl TokensParser {
    /// The parser of the setting `flag` / `variable`, reading with `parse`.
    pub fn new(
        flag: &'static str,
        variable: &'static str,
        parse: fn(&str) -> Result<Tokens, String>,
    ) -> TokensParser {
        TokensParser {
            flag,
            variable,
            parse,
        }
    }
}

impl clap::builder::TypedValueParser for TokensParser {
    type Value = Tokens;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Tokens, clap::Error> {
        use clap::error::{ContextKind, ContextValue, ErrorKind};
        let problem = match value.to_str() {
            Some(text) => match (self.parse)(text) {
                Ok(tokens) => return Ok(tokens),
                Err(problem) => problem,
            },
            None => "it is not valid UTF-8".to_owned(),
        };
        let name = arg.map_or_else(|| self.flag.to_owned(), ToString::to_string);
        let mut err = clap::Error::raw(
            ErrorKind::ValueValidation,
            format!(
                "invalid value for '{name}' ({}; the value is not shown, it holds secrets): \
                 {problem}\n",
                self.variable
            ),
        );
        // The setting and the problem, without the value: what the command
        // line's refusal names (its source: a flag, the variable, the file).
        err.insert(ContextKind::InvalidArg, ContextValue::String(name));
        err.insert(ContextKind::Custom, ContextValue::String(problem));
        Err(err.with_cmd(cmd))
    }
}

/// `tenant:token,…`. A tenant may hold several tokens (rotation), but a token
/// belongs to one tenant only; a pair listed twice counts once. No message
/// holds a token.
pub fn parse_tenant_tokens(s: &str) -> Result<Tokens, String> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((tenant, token)) = item.split_once(':') else {
            return Err("each entry must be tenant:token (e.g. acme:s3cret)".into());
        };
        let tenant = tenant.trim();
        if tenant.is_empty() || token.is_empty() {
            return Err("a tenant and its token must both be non-empty".into());
        }
        if !tenant
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(format!(
                "tenant {tenant:?} may hold only letters, digits, '-', '_' and '.'"
            ));
        }
        match pairs.iter().find(|(_, t)| t == token) {
            Some((owner, _)) if owner == tenant => continue,
            Some((owner, _)) => {
                return Err(format!(
                    "a token is given to two tenants, {owner:?} and {tenant:?}: requests bearing \
                     it could only ever reach one of them; give each tenant its own tokens"
                ));
            }
            None => pairs.push((tenant.to_owned(), token.to_owned())),
        }
    }
    Ok(Tokens::new(pairs))
}

/// `[NAME:]TOKEN,…`; no message holds a token.
pub fn parse_admin_tokens(s: &str) -> Result<Tokens, String> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for (i, item) in s
        .split(',')
        .map(str::trim)
        .filter(|i| !i.is_empty())
        .enumerate()
    {
        let named = item.split_once(':').filter(|(name, token)| {
            !name.is_empty()
                && !token.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c))
        });
        let (name, token) = match named {
            Some((name, token)) => (name.to_owned(), token.to_owned()),
            None => (format!("admin-{}", i + 1), item.to_owned()),
        };
        if pairs.iter().any(|(_, t)| *t == token) {
            return Err(format!("entry {} repeats an earlier token", i + 1));
        }
        pairs.push((name, token));
    }
    Ok(Tokens::new(pairs))
}
