//! `idemgate keys --server URL`: the same commands through a running
//! idemgate's admin endpoints (`GET /v1/admin/keys`, `GET` and `POST …/resolve`
//! of `/v1/admin/keys/{tenant}/{key_hash}`), with the same shapes, over the
//! binary's own HTTP client and TLS (`crate::server::tls`).

use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use axum::body::Body;
use http::{Method, Request, StatusCode, Uri, header};
use http_body_util::BodyExt as _;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use secrecy::{ExposeSecret as _, SecretString};
use serde::de::DeserializeOwned;

use crate::server::operations::{KeyList, KeyView, ListQuery, ResolveBody};
use crate::server::tls::{self, Connector, Trust};

/// How long one request to the server may take, connect included.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A running idemgate's admin endpoints.
pub(super) struct Remote {
    base: String,
    token: Option<SecretString>,
    client: Client<Connector, Body>,
}

impl Remote {
    /// The server at `url` (`http://` or `https://`, a host and port; a
    /// path is the base the admin paths go under), asked with `token`.
    pub(super) fn new(url: &str, token: Option<SecretString>) -> anyhow::Result<Remote> {
        let url = url.trim().trim_end_matches('/');
        let uri: Uri = url
            .parse()
            .map_err(|e| anyhow!("--server {url:?}: not a URL ({e})"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => bail!(
                "--server {url:?}: expected http://HOST:PORT or https://HOST:PORT (serve's \
                 listener, or the proxy's admin listener)"
            ),
        };
        if uri.host().is_none_or(str::is_empty) {
            bail!("--server {url:?}: names no host");
        }
        let connector = tls::connector(https, Trust::System, Duration::from_secs(10))
            .map_err(|e| anyhow!("--server {url:?}: {e}"))?;
        Ok(Remote {
            base: url.to_owned(),
            token,
            client: Client::builder(TokioExecutor::new()).build(connector),
        })
    }

    /// One page of keys.
    pub(super) async fn list(&self, query: &ListQuery) -> anyhow::Result<KeyList> {
        let mut pairs = form_urlencoded::Serializer::new(String::new());
        if let Some(state) = query.state {
            pairs.append_pair("state", state.as_str());
        }
        if let Some(tenant) = &query.tenant {
            pairs.append_pair("tenant", tenant);
        }
        if let Some(secs) = query.older_than {
            pairs.append_pair("older_than", &secs.to_string());
        }
        if let Some(limit) = query.limit {
            pairs.append_pair("limit", &limit.to_string());
        }
        if let Some(cursor) = &query.cursor {
            pairs.append_pair("cursor", cursor);
        }
        let path = format!("/v1/admin/keys?{}", pairs.finish());
        self.ask(Method::GET, &path, None).await
    }

    /// One key.
    pub(super) async fn show(&self, tenant: &str, key_hash: &str) -> anyhow::Result<KeyView> {
        let path = key_path(tenant, key_hash);
        self.ask(Method::GET, &path, None).await
    }

    /// Settles one key; the server records the operator its token names.
    pub(super) async fn resolve(
        &self,
        tenant: &str,
        key_hash: &str,
        body: &ResolveBody,
    ) -> anyhow::Result<KeyView> {
        let path = format!("{}/resolve", key_path(tenant, key_hash));
        let mut json = serde_json::json!({ "action": body.action.as_str(), "reason": body.reason });
        if let Some(r) = &body.response {
            json["response"] = serde_json::json!({
                "status": r.status,
                "headers": r.headers,
                "body": r.body,
                "body_base64": r.body_base64,
            });
        }
        let body = serde_json::to_vec(&json)?;
        self.ask(Method::POST, &path, Some(body)).await
    }

    async fn ask<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> anyhow::Result<T> {
        let url = format!("{}{path}", self.base);
        let mut req = Request::builder()
            .method(method)
            .uri(&url)
            .header(header::ACCEPT, "application/json");
        if let Some(token) = &self.token {
            req = req.header(
                header::AUTHORIZATION,
                format!("Bearer {}", token.expose_secret()),
            );
        }
        let req = match body {
            Some(body) => req
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(body)),
            None => req.body(Body::empty()),
        }
        .with_context(|| format!("--server {}: cannot make a request of it", self.base))?;
        let res = tokio::time::timeout(TIMEOUT, self.client.request(req))
            .await
            .map_err(|_| anyhow!("{}: no answer within {} s", self.base, TIMEOUT.as_secs()))?
            .map_err(|e| {
                anyhow!(
                    "cannot reach {} (--server): {}; is idemgate serve (its listener) or proxy \
                     (its admin listener) running there?",
                    self.base,
                    source_chain(&e)
                )
            })?;
        let status = res.status();
        let bytes = tokio::time::timeout(TIMEOUT, res.into_body().collect())
            .await
            .map_err(|_| anyhow!("{}: the answer did not end", self.base))?
            .map_err(|e| anyhow!("{}: the answer broke off: {e}", self.base))?
            .to_bytes();
        if status.is_success() {
            return serde_json::from_slice(&bytes).with_context(|| {
                format!(
                    "{} answered {status} with something that is not idemgate's admin JSON; \
                     is --server the listener of idemgate serve, or the proxy's admin listener?",
                    self.base
                )
            });
        }
        Err(refusal(&self.base, status, &bytes))
    }
}

/// `/v1/admin/keys/{tenant}/{key_hash}`, each part escaped.
fn key_path(tenant: &str, key_hash: &str) -> String {
    let escape = |s: &str| {
        form_urlencoded::byte_serialize(s.as_bytes())
            .collect::<String>()
            .replace('+', "%20")
    };
    format!("/v1/admin/keys/{}/{}", escape(tenant), escape(key_hash))
}

/// A refusal in its problem's words (`title: detail (slug)`), or the status.
fn refusal(base: &str, status: StatusCode, body: &[u8]) -> anyhow::Error {
    let problem: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let field = |name: &str| {
        problem
            .as_ref()
            .and_then(|p| p.get(name))
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
    };
    let slug = field("type").and_then(|t| t.rsplit('/').next().map(str::to_owned));
    match (field("detail"), slug) {
        (Some(detail), Some(slug)) => anyhow!("{detail} ({slug}; {base} answered {status})"),
        _ => anyhow!(
            "{base} answered {status}; is --server the listener of idemgate serve, or the \
             proxy's admin listener?"
        ),
    }
}

/// An error and its causes, joined: hyper's own words are only "client
/// error (Connect)".
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_paths_escape_tenants() {
        assert_eq!(key_path("acme", "ab12"), "/v1/admin/keys/acme/ab12");
        assert_eq!(key_path("a b/c", "ab"), "/v1/admin/keys/a%20b%2Fc/ab");
    }

    #[test]
    fn a_server_url_must_be_http_with_a_host() {
        assert!(Remote::new("ftp://x", None).is_err());
        assert!(Remote::new("127.0.0.1:8080", None).is_err());
        assert!(Remote::new("http://127.0.0.1:8080/", None).is_ok());
    }
}
