//! Who is calling the reservation API: bearer tokens, each mapped to the
//! tenant whose keys it may touch; and, for the operators' endpoints and the
//! console, the refusal of a request another site's page made a browser
//! send ([`refuse_cross_site`]).

use http::HeaderMap;
use http::header::{AUTHORIZATION, HOST, ORIGIN};
use secrecy::{ExposeSecret as _, SecretString};
use subtle::ConstantTimeEq as _;

use crate::problem::ApiError;

/// Bearer tokens mapped to tenants. `Debug` never shows a token.
#[derive(Clone, Default)]
pub struct Tokens(Vec<(String, SecretString)>);

// === impl Tokens ===

impl Tokens {
    /// Tokens from `(tenant, token)` pairs.
    pub fn new(pairs: impl IntoIterator<Item = (String, String)>) -> Tokens {
        Tokens(
            pairs
                .into_iter()
                .map(|(t, s)| (t, SecretString::from(s)))
                .collect(),
        )
    }

    /// No token configured: open, single-tenant mode.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The tenant `token` belongs to. Every configured token is compared, in
    /// constant time over equal-length digests, so neither a match's position
    /// nor a token's length shows in the timing.
    pub fn tenant_for(&self, token: &str) -> Option<&str> {
        use sha2::{Digest, Sha256};
        let given = Sha256::digest(token.as_bytes());
        let mut found = None;
        for (tenant, secret) in &self.0 {
            let want = Sha256::digest(secret.expose_secret().as_bytes());
            if bool::from(given.ct_eq(&want)) && found.is_none() {
                found = Some(tenant.as_str());
            }
        }
        found
    }
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(t, _)| format!("{t}:[redacted]")))
            .finish()
    }
}

/// The token of the request's one `Authorization: Bearer <token>` header;
/// `401 unauthorized` with `missing` when there is none (or several).
pub fn bearer_token<'a>(
    headers: &'a HeaderMap,
    missing: &'static str,
) -> Result<&'a str, ApiError> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(ApiError::Unauthorized(missing));
    };
    value
        .to_str()
        .ok()
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .ok_or(ApiError::Unauthorized(
            "the Authorization header must be Bearer <token>",
        ))
}

/// `403 forbidden` for a request another site's page made a browser send.
/// Where the operators' endpoints are open without a token (a loopback
/// listener, development), a page on any site the operator visits could
/// otherwise post a form to them; with tokens it could not send one, and is
/// refused all the same. A browser says where a request comes from in
/// `Sec-Fetch-Site` (only `same-origin`, or `none` for one the person typed,
/// passes); an older one, only in `Origin`, which must then name the `Host`
/// the request went to. Clients that are not browsers send neither.
pub fn refuse_cross_site(headers: &HeaderMap) -> Result<(), ApiError> {
    const REFUSED: &str = "a request another site's page sent cannot use the operators' \
                           endpoints or console: open the console from idemgate itself";
    let text = |name: http::header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = text(http::header::HeaderName::from_static("sec-fetch-site")) {
        return match site.to_ascii_lowercase().as_str() {
            "same-origin" | "none" => Ok(()),
            _ => Err(ApiError::Forbidden(REFUSED)),
        };
    }
    let Some(origin) = text(ORIGIN) else {
        return Ok(());
    };
    let origin_host = origin
        .split_once("://")
        .map(|(_, rest)| rest.trim_end_matches('/'));
    match (origin_host, text(HOST)) {
        (Some(o), Some(h)) if o.eq_ignore_ascii_case(h) => Ok(()),
        _ => Err(ApiError::Forbidden(REFUSED)),
    }
}
