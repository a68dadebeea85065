//! Protocol upgrades (WebSocket) through the proxy, as any reverse proxy
//! passes them: unguarded.
//!
//! An upgrade request is one whose `Connection` names `upgrade`, that has an
//! `Upgrade` header, and whose client connection can switch (hyper's
//! `OnUpgrade` is in its extensions: the layer takes it out of guarded
//! requests, which go upstream as ordinary ones). Such a request goes
//! upstream with its `Upgrade` and `Connection: upgrade`; an upstream `101`
//! goes back to the client with them, and once both sides have switched the
//! two connections are spliced until either closes. Any other answer is an
//! ordinary response.
//!
//! A `101` to a request that did not ask to switch is never passed on (nor
//! recorded): the client gets `502`, the outcome unknown.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::uri::Authority;
use http::{HeaderMap, HeaderValue, Request, StatusCode, header};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use crate::layer::headers::connection_named;
use crate::layer::{OutcomeUnknown, strip_connection_headers};
use crate::problem::ApiError;

/// A client's request to switch protocols, taken from its request.
#[derive(Debug)]
pub(super) struct Asked {
    /// The client connection, once it has switched.
    client: OnUpgrade,
    /// The protocols asked for, as sent (`Upgrade` lines).
    protocols: Vec<HeaderValue>,
}

// === impl Asked ===

impl Asked {
    /// The upgrade `req` asks for, if it is an upgrade request; its
    /// `OnUpgrade` is taken either way, for only the splice may use it.
    pub(super) fn take(req: &mut Request<Body>) -> Option<Asked> {
        let client = req.extensions_mut().remove::<OnUpgrade>()?;
        let headers = req.headers();
        if !connection_has_upgrade(headers) {
            return None;
        }
        let protocols: Vec<HeaderValue> =
            headers.get_all(header::UPGRADE).iter().cloned().collect();
        (!protocols.is_empty()).then_some(Asked { client, protocols })
    }

    /// Puts the request's `Upgrade` back on its headers as they go upstream
    /// (the hop-by-hop set stripped), with `Connection: upgrade`.
    pub(super) fn ask(&self, headers: &mut HeaderMap) {
        headers.remove(header::UPGRADE);
        upgrade_to(headers, self.protocols.iter().cloned());
    }
}

/// The client's answer to an upstream `101`: for an upgrade request, the
/// `101` with its `Upgrade` and `Connection: upgrade` (the rest of the
/// hop-by-hop set stripped), the splice of the two connections started;
/// else a `502` marked [`OutcomeUnknown`], since the request was sent.
pub(super) fn switched(
    asked: Option<Asked>,
    mut upstream: http::Response<Incoming>,
    authority: &Authority,
) -> Response {
    let Some(asked) = asked else {
        tracing::warn!(
            upstream = %authority,
            "the upstream switched protocols (101) for a request that did not ask to; \
             whether it acted is unknown"
        );
        let mut res = ApiError::UpstreamUnavailable(
            "the upstream answered 101 Switching Protocols to a request that did not ask to \
             switch; whether it acted is unknown"
                .into(),
        )
        .into_response();
        res.extensions_mut().insert(OutcomeUnknown);
        return res;
    };
    let to_upstream = hyper::upgrade::on(&mut upstream);
    let mut headers = std::mem::take(upstream.headers_mut());
    let protocols: Vec<HeaderValue> = headers.get_all(header::UPGRADE).iter().cloned().collect();
    strip_connection_headers(&mut headers);
    upgrade_to(&mut headers, protocols);
    let mut res = Response::new(Body::empty());
    *res.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    *res.headers_mut() = headers;
    tokio::spawn(splice(asked.client, to_upstream, authority.clone()));
    res
}

/// Once the client has its `101` and both connections have switched,
/// copies bytes both ways until both sides are done. Not counted by the
/// shutdown: the connection lives as long as the process, or its peers.
async fn splice(client: OnUpgrade, upstream: OnUpgrade, authority: Authority) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(both) => both,
        Err(e) => {
            tracing::debug!(upstream = %authority, error = %e, "the protocol switch did not complete");
            return;
        }
    };
    let mut client = TokioIo::new(client);
    let mut upstream = TokioIo::new(upstream);
    match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        Ok((sent, received)) => tracing::debug!(
            upstream = %authority,
            bytes.sent = sent,
            bytes.received = received,
            "upgraded connection closed"
        ),
        Err(e) => tracing::debug!(
            upstream = %authority,
            error = %e,
            "upgraded connection ended with an error"
        ),
    }
}

/// Whether a `Connection` line names the `upgrade` option.
fn connection_has_upgrade(headers: &HeaderMap) -> bool {
    connection_named(headers).contains(&header::UPGRADE)
}

/// Asks for (or answers with) a switch to `protocols`: their `Upgrade`
/// lines, and `Connection: upgrade`, on headers whose hop-by-hop set was
/// stripped.
fn upgrade_to(headers: &mut HeaderMap, protocols: impl IntoIterator<Item = HeaderValue>) {
    for protocol in protocols {
        headers.append(header::UPGRADE, protocol);
    }
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(lines: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in lines {
            h.append(*name, HeaderValue::from_static(value));
        }
        h
    }

    #[test]
    fn connection_options_are_tokens_in_any_case_and_line() {
        assert!(connection_has_upgrade(&headers(&[(
            "connection",
            "Upgrade"
        )])));
        assert!(connection_has_upgrade(&headers(&[(
            "connection",
            "keep-alive, upgrade"
        )])));
        assert!(connection_has_upgrade(&headers(&[
            ("connection", "keep-alive"),
            ("connection", "UPGRADE")
        ])));
        assert!(!connection_has_upgrade(&headers(&[(
            "connection",
            "keep-alive, upgrade-insecure"
        )])));
        assert!(!connection_has_upgrade(&headers(&[(
            "upgrade",
            "websocket"
        )])));
    }

    #[test]
    fn only_a_request_that_asks_and_can_switch_is_an_upgrade() {
        let request = |connection: Option<&'static str>, upgradable: bool| {
            let mut req = Request::get("/ws")
                .header(header::UPGRADE, "websocket")
                .body(Body::empty())
                .unwrap();
            if let Some(connection) = connection {
                req.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static(connection));
            }
            if upgradable {
                // An `OnUpgrade` of a request made here never resolves, but
                // it is one.
                let on = hyper::upgrade::on(Request::new(Body::empty()));
                req.extensions_mut().insert(on);
            }
            req
        };
        let mut asked = request(Some("keep-alive, Upgrade"), true);
        let upgrade = Asked::take(&mut asked).expect("an upgrade request");
        assert!(asked.extensions().get::<OnUpgrade>().is_none());
        let mut up = headers(&[("x-forwarded-proto", "http")]);
        upgrade.ask(&mut up);
        assert_eq!(up["upgrade"], "websocket");
        assert_eq!(up["connection"], "upgrade");
        assert_eq!(up["x-forwarded-proto"], "http");

        let mut no_connection = request(None, true);
        assert!(Asked::take(&mut no_connection).is_none());
        assert!(
            no_connection.extensions().get::<OnUpgrade>().is_none(),
            "taken either way"
        );
        // A guarded request: the layer took its OnUpgrade.
        assert!(Asked::take(&mut request(Some("upgrade"), false)).is_none());
    }
}
