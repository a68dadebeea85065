//! The operators' console (`/console`; docs/operations.md, “The operators'
//! console”): a page where a person finds the keys that wait for one and
//! settles them — one more door onto [`operations`], beside the admin endpoints
//! and `idemgate keys`.
//!
//! Server-rendered HTML ([`maud`]) with [htmx](https://htmx.org) for the
//! little that moves: the page itself holds no data and needs no token; its
//! fragments (`/console/fragments/…`) are the operations' answers rendered
//! as HTML, asked for by htmx with the admin token the operator pasted,
//! which the page keeps in the tab's `sessionStorage` and sends as
//! `Authorization: Bearer` — never a cookie, so another site's page cannot
//! act with it. The fragments answer only htmx's requests from this origin
//! (`HX-Request`, [`refuse_cross_site`]) and take the admin endpoints'
//! access rule ([`AdminAccess`]) as it is. Every asset is served from the
//! binary.
//!
//! The pages are `/console` (the queue) and `/console/keys/{tenant}/{key_hash}`
//! (one key); their fragments are the queue's `counts`, the `queue` itself, a
//! `lookup` of one key, a key, and its `resolve`, each [`operations`] rendered
//! by `pages`; a refusal or a failure is the problem rendered in the
//! fragment's place, with its status. The assets (`/console/assets/…`) are
//! htmx, the page's own script (which keeps the token and adds it to htmx's
//! requests) and its styles. `idemgate serve` mounts the console beside the
//! API, the proxy on its admin listener.

mod pages;

use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderValue, StatusCode, header};
use serde::Deserialize;

use crate::engine::Engine;
use crate::problem::ApiError;
use crate::server::auth::{bearer_token, refuse_cross_site};
use crate::server::config::AdminAccess;
use crate::server::operations::{self, Action, ListQuery, ResolveBody, list::StateFilter};
use crate::server::views::CommitBody;

/// What the console needs: the engine whose keys it shows, who may use it,
/// and the largest response body an operator may enter.
#[derive(Clone)]
pub struct Console(Arc<ConsoleInner>);

struct ConsoleInner {
    engine: Arc<Engine>,
    admin: AdminAccess,
    max_body_bytes: usize,
    /// Whether the listener serves `/docs` too (`serve`'s does; the proxy's
    /// admin listener does not).
    docs: bool,
}

impl Console {
    /// The console over `engine`, behind `admin` (the listener's rule for
    /// the operators' endpoints); `docs`: the listener serves the API's
    /// `/docs` page too, and the page links to it.
    pub fn new(
        engine: Arc<Engine>,
        admin: AdminAccess,
        max_body_bytes: usize,
        docs: bool,
    ) -> Console {
        Console(Arc::new(ConsoleInner {
            engine,
            admin,
            max_body_bytes,
            docs,
        }))
    }
}

/// Keys a page of the queue shows.
pub const PAGE_SIZE: u32 = 50;

/// `/console` and everything under it.
pub fn router(console: Console) -> Router {
    Router::new()
        .route("/console", get(queue_page))
        .route("/console/", get(queue_page))
        .route("/console/keys/{tenant}/{key_hash}", get(key_page))
        .route("/console/assets/{file}", get(asset))
        .route("/console/fragments/counts", get(counts))
        .route("/console/fragments/queue", get(queue))
        .route("/console/fragments/lookup", post(lookup))
        .route("/console/fragments/keys/{tenant}/{key_hash}", get(key))
        .route(
            "/console/fragments/keys/{tenant}/{key_hash}/resolve",
            post(settle),
        )
        .layer(axum::middleware::map_response(page_headers))
        .with_state(console)
}

/// No page of the console is framed, cached, or sent on as a referrer; its
/// scripts and styles come from idemgate alone.
async fn page_headers(mut res: Response) -> Response {
    let headers = res.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    res
}

// === the pages: no data, no token needed ===

async fn queue_page(State(console): State<Console>) -> maud::Markup {
    pages::shell(pages::Main::Queue, console.0.docs)
}

async fn key_page(
    State(console): State<Console>,
    Path((tenant, key_hash)): Path<(String, String)>,
) -> maud::Markup {
    pages::shell(
        pages::Main::Key {
            tenant: &tenant,
            key_hash: &key_hash,
        },
        console.0.docs,
    )
}

/// The page's scripts and styles, from the binary: htmx as published
/// (`htmx.org` 2.0.11, its `dist/htmx.min.js`), and the console's own.
async fn asset(Path(file): Path<String>) -> Response {
    let (body, kind): (&'static [u8], &str) = match file.as_str() {
        "htmx.min.js" => (
            include_bytes!("assets/htmx.min.js"),
            "text/javascript; charset=utf-8",
        ),
        "console.js" => (
            include_bytes!("assets/console.js"),
            "text/javascript; charset=utf-8",
        ),
        "icon.svg" => (include_bytes!("assets/icon.svg"), "image/svg+xml"),
        "console.css" => (
            include_bytes!("assets/console.css"),
            "text/css; charset=utf-8",
        ),
        _ => {
            return ApiError::NotFound("no such file of the console; see /console".into())
                .into_response();
        }
    };
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        body,
    )
        .into_response()
}

// === the fragments: the operations, for an operator ===

/// An operator of the console: the name its token is recorded under, once
/// the request is htmx's, from this origin, and allowed by the admin rule.
struct Operator(String);

impl FromRequestParts<Console> for Operator {
    type Rejection = Fragment;

    async fn from_request_parts(parts: &mut Parts, console: &Console) -> Result<Self, Fragment> {
        refuse_cross_site(&parts.headers)?;
        if parts.headers.get("hx-request").is_none() {
            return Err(ApiError::InvalidRequest(
                "the console's fragments answer the console page (/console) alone; \
                 scripts use /v1/admin/keys"
                    .into(),
            )
            .into());
        }
        let name = console.0.admin.authorize(|| {
            bearer_token(
                &parts.headers,
                "paste an admin token (one of IDEMGATE_ADMIN_TOKENS) into the console",
            )
        })?;
        Ok(Operator(name))
    }
}

/// A fragment's refusal or failure: the problem, as HTML, with its status
/// (the page shows it where the fragment would have gone).
pub struct Fragment(ApiError);

impl From<ApiError> for Fragment {
    fn from(e: ApiError) -> Fragment {
        Fragment(e)
    }
}

impl IntoResponse for Fragment {
    fn into_response(self) -> Response {
        if let ApiError::Internal(reason) = &self.0 {
            tracing::error!(error = %reason, "internal error");
        }
        (self.0.status(), pages::problem(&self.0)).into_response()
    }
}

async fn counts(State(console): State<Console>, operator: Result<Operator, Fragment>) -> Response {
    // A refusal is the whole page's, and the queue or the key says it: the
    // counts only note it (with its status, so that a 401 still brings the
    // token form back).
    if let Err(Fragment(e)) = operator {
        return (e.status(), pages::counts_refused()).into_response();
    }
    // The store away is what the counts are there to say: shown, not
    // refused, and asked again at the next refresh.
    pages::counts(operations::counts(&console.0.engine).await).into_response()
}

/// The queue's filters, as the page's form sends them.
#[derive(Debug, Default, Deserialize)]
struct QueueForm {
    tenant: Option<String>,
    /// `stuck` (the default: the keys that wait for a person), `unknown`,
    /// `in_flight`, `completed`, or empty for any.
    state: Option<String>,
    /// Minutes; empty for any age.
    older_than: Option<String>,
    cursor: Option<String>,
}

async fn queue(
    State(console): State<Console>,
    _: Operator,
    form: Result<Query<QueueForm>, axum::extract::rejection::QueryRejection>,
) -> Result<maud::Markup, Fragment> {
    let Query(form) = form.map_err(|e| ApiError::InvalidRequest(e.body_text()))?;
    let state = match form.state.as_deref().map(str::trim) {
        None | Some("stuck") => Some(StateFilter::Stuck),
        Some("unknown") => Some(StateFilter::Unknown),
        Some("in_flight") => Some(StateFilter::InFlight),
        Some("completed") => Some(StateFilter::Completed),
        Some("") => None,
        Some(other) => {
            return Err(ApiError::InvalidRequest(format!(
                "state {other:?} is not one of stuck, unknown, in_flight, completed (or empty: any)"
            ))
            .into());
        }
    };
    let older_than = match form.older_than.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(minutes) => Some(
            minutes
                .parse::<u64>()
                .ok()
                .and_then(|m| m.checked_mul(60))
                .ok_or_else(|| {
                    ApiError::InvalidRequest(format!(
                        "older than {minutes:?}: give whole minutes (0 or more), or leave it empty"
                    ))
                })?,
        ),
    };
    let query = ListQuery {
        state,
        tenant: form
            .tenant
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty()),
        older_than,
        limit: Some(PAGE_SIZE),
        cursor: form.cursor.filter(|c| !c.is_empty()),
    };
    let page = operations::list(&console.0.engine, &query).await?;
    Ok(pages::queue(&page, &query))
}

async fn key(
    State(console): State<Console>,
    _: Operator,
    Path((tenant, key_hash)): Path<(String, String)>,
) -> Result<maud::Markup, Fragment> {
    let shown = operations::show_with_response(&console.0.engine, &tenant, &key_hash).await?;
    Ok(pages::key(&shown, None))
}

/// The look-up box, as the page sends it: a tenant and a key, which is the
/// raw key (`kind=raw`) or its hash or a prefix of it (`kind=hash`).
#[derive(Debug, Deserialize)]
struct LookupForm {
    tenant: Option<String>,
    key: Option<String>,
    kind: Option<String>,
}

/// Finds one key and sends the page to it (`HX-Redirect`, to the key's own
/// page, which names it by its hash). A raw key is hashed here, in a form
/// posted (never a URL, so no log or history line holds it), and is neither
/// logged nor kept.
async fn lookup(
    State(console): State<Console>,
    _: Operator,
    form: Result<axum::Form<LookupForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    let found = async {
        let axum::Form(form) = form.map_err(|e| ApiError::InvalidRequest(e.body_text()))?;
        let tenant = form
            .tenant
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                ApiError::InvalidRequest(
                    "give the key's tenant, as the queue shows it (`default` on a server without \
                     tenant tokens, `anonymous` on a proxy without a tenant header)"
                        .into(),
                )
            })?;
        let text = form.key.unwrap_or_default();
        if text.trim().is_empty() {
            return Err(ApiError::InvalidRequest(
                "give the key: as the client sent it, or its hash (all 64 hex digits or the \
                 first 8 or more)"
                    .into(),
            ));
        }
        let hash = match form.kind.as_deref() {
            Some("hash") => operations::expand_key_hash(&console.0.engine, &tenant, &text).await?,
            Some("raw") | None => {
                let key = crate::key::parse_value(
                    text.trim().as_bytes(),
                    &crate::key::KeyPolicy::default(),
                )
                .map_err(ApiError::from)?;
                // Under sealing the stored hash is keyed, and during a
                // window it may be the plain one: the first that is there.
                let mut found = None;
                for (_, hash) in console.0.engine.names_of(&tenant, false, &key.hash()) {
                    let hash = hex::encode(hash);
                    if operations::show(&console.0.engine, &tenant, &hash)
                        .await
                        .is_ok()
                    {
                        found = Some(hash);
                        break;
                    }
                    found.get_or_insert(hash);
                }
                found.expect("a key has one name at least")
            }
            Some(other) => {
                return Err(ApiError::InvalidRequest(format!(
                    "kind {other:?} is not raw (the key as sent) or hash (its hash or a prefix)"
                )));
            }
        };
        operations::show(&console.0.engine, &tenant, &hash).await?;
        Ok(format!(
            "/console/keys/{}/{}",
            pages::segment(&tenant),
            pages::segment(&hash)
        ))
    }
    .await;
    match found {
        Ok(href) => match HeaderValue::from_str(&href) {
            Ok(location) => ([("hx-redirect", location)], pages::found(&href)).into_response(),
            Err(_) => Fragment(ApiError::Internal("a key page's address".into())).into_response(),
        },
        Err(e) => Fragment(e).into_response(),
    }
}

/// The settle form, as the page sends it.
#[derive(Debug, Deserialize)]
struct SettleForm {
    action: Option<String>,
    reason: Option<String>,
    status: Option<String>,
    headers: Option<String>,
    body: Option<String>,
}

async fn settle(
    State(console): State<Console>,
    Operator(by): Operator,
    Path((tenant, key_hash)): Path<(String, String)>,
    form: Result<axum::Form<SettleForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    let outcome = async {
        let axum::Form(form) = form.map_err(|e| ApiError::InvalidRequest(e.body_text()))?;
        let body = settle_body(form)?;
        operations::resolve(
            &console.0.engine,
            &tenant,
            &key_hash,
            body,
            &by,
            console.0.max_body_bytes,
        )
        .await
    }
    .await;
    let settled = matches!(outcome, Ok(_) | Err(ApiError::NotStuck(_)));
    let mut res = match outcome {
        Ok(_) => {
            // The key as it now is, with what a retry gets, in place of the
            // page's key panel.
            match operations::show_with_response(&console.0.engine, &tenant, &key_hash).await {
                Ok(shown) => pages::key(&shown, Some(pages::SettleMessage::Now)).into_response(),
                // Released: forgotten, so there is nothing left to show but
                // that.
                Err(ApiError::NotFound(_)) => pages::released(&by).into_response(),
                Err(e) => Fragment(e).into_response(),
            }
        }
        // Settled meanwhile (a double click, another operator, its holder):
        // the key as it is, and by whom.
        Err(ApiError::NotStuck(detail)) => {
            match operations::show_with_response(&console.0.engine, &tenant, &key_hash).await {
                Ok(shown) => (
                    StatusCode::CONFLICT,
                    pages::key(&shown, Some(pages::SettleMessage::Already(&detail))),
                )
                    .into_response(),
                // Released: forgotten, but who released it is in the
                // detail.
                Err(ApiError::NotFound(_)) => {
                    (StatusCode::CONFLICT, pages::released_already(&detail)).into_response()
                }
                Err(e) => Fragment(e).into_response(),
            }
        }
        // Anything the operator can mend (a missing reason, a bad status)
        // goes beside the form, which keeps what was typed.
        Err(e) => {
            let mut res = Fragment(e).into_response();
            res.headers_mut()
                .insert("hx-retarget", HeaderValue::from_static("#settle-result"));
            res.headers_mut()
                .insert("hx-reswap", HeaderValue::from_static("innerHTML"));
            res
        }
    };
    if settled {
        // The counts follow at once (htmx fires the event as the answer
        // arrives, from the form, before the form is replaced).
        res.headers_mut()
            .insert("hx-trigger", HeaderValue::from_static("key-settled"));
    }
    res
}

/// The operation's body from the form: `complete` takes a status, header
/// lines (`Name: value`, one per line) and a text body.
fn settle_body(form: SettleForm) -> Result<ResolveBody, ApiError> {
    let action = match form.action.as_deref() {
        Some("release") => Action::Release,
        Some("complete") => Action::Complete,
        _ => {
            return Err(ApiError::InvalidRequest(
                "choose what happened: release (nothing happened) or complete (this is what \
                 happened)"
                    .into(),
            ));
        }
    };
    let response = match action {
        Action::Release => None,
        Action::Complete => {
            let status_text = form.status.unwrap_or_default();
            let status = status_text
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|s| (100..=599).contains(s))
                .ok_or_else(|| {
                    ApiError::InvalidRequest(format!(
                        "status {:?}: give the HTTP status that happened, 100 to 599",
                        status_text.trim()
                    ))
                })?;
            let mut headers = Vec::new();
            for line in form.headers.unwrap_or_default().lines() {
                let line = line.trim();
                if line.is_empty() {
                    continue;
                }
                let Some((name, value)) = line.split_once(':') else {
                    return Err(ApiError::InvalidRequest(format!(
                        "header line {line:?} has no colon: write one header a line, \
                         Name: value"
                    )));
                };
                headers.push((name.trim().to_owned(), value.trim().to_owned()));
            }
            Some(CommitBody {
                status,
                headers,
                body: form.body.filter(|b| !b.is_empty()),
                body_base64: None,
            })
        }
    };
    Ok(ResolveBody {
        action,
        reason: form.reason.unwrap_or_default(),
        response,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(action: &str, status: &str, headers: &str) -> SettleForm {
        SettleForm {
            action: Some(action.into()),
            reason: Some("checked".into()),
            status: Some(status.into()),
            headers: Some(headers.into()),
            body: Some("{}".into()),
        }
    }

    #[test]
    fn the_settle_form_reads_as_the_operation_body() {
        let body = settle_body(form(
            "complete",
            " 201 ",
            "Content-Type: application/json\n\nX-A:  b\n",
        ))
        .unwrap();
        let response = body.response.unwrap();
        assert_eq!(response.status, 201);
        assert_eq!(
            response.headers,
            vec![
                ("Content-Type".to_owned(), "application/json".to_owned()),
                ("X-A".to_owned(), "b".to_owned())
            ]
        );
        assert!(
            settle_body(form("release", "", ""))
                .unwrap()
                .response
                .is_none()
        );
        for (action, status, headers) in [
            ("complete", "99", ""),
            ("complete", "two hundred", ""),
            ("complete", "200", "no colon"),
            ("maybe", "200", ""),
        ] {
            assert!(
                settle_body(form(action, status, headers)).is_err(),
                "{action} {status} {headers}"
            );
        }
    }
}
