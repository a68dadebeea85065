//! The `/docs` page: Swagger UI over `/openapi.json`, with its scripts and
//! styles served from the binary (`utoipa-swagger-ui`'s vendored copy, built
//! in without a download), so the page renders wherever the server is
//! reachable, CDN or none.
//!
//! `/docs` itself is a page of ours rather than Swagger UI's `index.html`: it
//! answers 200 at the fixed path (no redirect to `/docs/`), names its assets
//! by absolute path, and carries plain links that work without scripts: to
//! the document and to the reference pages of `docs/`, served beside it
//! (`docs_pages`).

use std::sync::{Arc, LazyLock};

use axum::Router;
use axum::extract::Path;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use http::{HeaderValue, header};
use tower_http::set_header::SetResponseHeaderLayer;
use utoipa_swagger_ui::Config;

use super::docs_pages;
use crate::problem::ApiError;

/// The page at `/docs`. Swagger UI renders into `#swagger-ui`; the links
/// above it are there even when scripts are off or fail.
const PAGE: &str = r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>idemgate API</title>
<link rel="stylesheet" href="/docs/swagger-ui.css">
<link rel="icon" type="image/png" href="/docs/favicon-32x32.png" sizes="32x32">
<style>body { margin: 0 } .idemgate-doc-link { font-family: sans-serif; margin: 1em 20px 0 } .idemgate-doc-link ul { margin: .25em 0 }</style>
</head>
<body>
<div class="idemgate-doc-link"><p>The OpenAPI document: <a href="/openapi.json">/openapi.json</a>. The reference pages:</p>
<ul>{pages}</ul></div>
<div id="swagger-ui"></div>
<script src="/docs/swagger-ui-bundle.js" charset="utf-8"></script>
<script src="/docs/swagger-ui-standalone-preset.js" charset="utf-8"></script>
<script src="/docs/swagger-initializer.js" charset="utf-8"></script>
</body>
</html>
"#;

/// `/docs`, `/docs/` and the assets under `/docs/`, for a router of any state.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    // The base layout: the standalone one adds a bar that loads any URL typed
    // into it. No validator: it would send the document to a public service.
    let config = Arc::new(
        Config::from("/openapi.json")
            .use_base_layout()
            .validator_url("none"),
    );
    Router::new()
        .route("/docs", get(page))
        .route("/docs/", get(page))
        .route(
            "/docs/{*file}",
            get(move |Path(file): Path<String>| asset(file, config.clone())),
        )
        .layer(SetResponseHeaderLayer::if_not_present(
            header::X_FRAME_OPTIONS,
            HeaderValue::from_static("DENY"),
        ))
        .layer(SetResponseHeaderLayer::if_not_present(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(FRAME_ANCESTORS),
        ))
}

/// No page under `/docs` is framed by another site's page (clickjacking):
/// `X-Frame-Options: DENY` for the browsers that know only it, and this
/// policy, which asks nothing else of Swagger UI's scripts and styles. The
/// console sets its own, stricter one.
const FRAME_ANCESTORS: &str = "frame-ancestors 'none'";

/// [`PAGE`] with the reference pages' links.
static PAGE_WITH_INDEX: LazyLock<String> =
    LazyLock::new(|| PAGE.replace("{pages}", &docs_pages::index_items()));

async fn page() -> Html<&'static str> {
    Html(PAGE_WITH_INDEX.as_str())
}

/// A reference page (`/docs/proxy`), or one of Swagger UI's files
/// (`swagger-initializer.js` carries `config`).
async fn asset(file: String, config: Arc<Config<'static>>) -> Response {
    if let Some(page) = docs_pages::find(&file) {
        return Html(page.html.as_str()).into_response();
    }
    match utoipa_swagger_ui::serve(&file, config) {
        Ok(Some(found)) => {
            let mut res = found.bytes.into_owned().into_response();
            if let Ok(value) = http::HeaderValue::from_str(&found.content_type) {
                res.headers_mut().insert(header::CONTENT_TYPE, value);
            }
            res
        }
        Ok(None) => {
            ApiError::NotFound("no such page or file under /docs; see /docs for the list".into())
                .into_response()
        }
        // Only the initializer's config can fail to build, and it is ours:
        // a bug, not the client's doing.
        Err(e) => ApiError::Internal(format!("the docs page's initializer: {e}")).into_response(),
    }
}
