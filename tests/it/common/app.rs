//! A reservation API over a real PostgreSQL database, driven with `oneshot`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use idemgate::server::api::AppState;
use idemgate::server::config::ServeArgs;
use idemgate::server::wiring;
use idemgate::store::postgres::PgSettings;
use idemgate::store::{PgStore, SqliteStore, Store};
use serde_json::Value;
use tower::ServiceExt;

use super::logs;

/// The serve settings a test asks for, as command-line flags.
pub fn serve_args(flags: &[&str]) -> ServeArgs {
    super::bin::parse_args(flags)
}

/// One idemgate "process": its own pool, engine and router.
pub struct TestApp {
    pub router: Router,
    pub state: AppState,
    pub store: Arc<dyn Store>,
    /// The PostgreSQL pool, when the store is PostgreSQL.
    pub pg: Option<PgStore>,
    /// Keys and tokens this app saw: none may show up in the logs.
    secrets: Arc<Mutex<Vec<String>>>,
}

/// A response, its body parsed as JSON where it is JSON.
#[derive(Debug)]
pub struct TestResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
    pub text: String,
}

impl TestResponse {
    #[track_caller]
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .unwrap_or_else(|| panic!("no {name} header in {self:?}"))
            .to_str()
            .unwrap()
    }

    /// Asserts a problem+json answer with this status and slug.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status.as_u16(), status, "{self:#?}");
        assert_eq!(
            self.header("content-type"),
            "application/problem+json",
            "{self:#?}"
        );
        let ty = self.body["type"].as_str().unwrap_or_default();
        assert!(
            ty.ends_with(&format!("/{slug}")),
            "type {ty:?} is not {slug}"
        );
        assert_eq!(self.body["status"], status);
        assert!(self.body["title"].is_string() && self.body["detail"].is_string());
    }

    pub fn reservation_id(&self) -> String {
        self.body["reservation_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no reservation_id in {self:#?}"))
            .to_owned()
    }
}

impl TestApp {
    /// An app over `url` (postgres:// or sqlite://) with default settings
    /// plus `flags`.
    pub async fn new(url: &str, flags: &[&str]) -> TestApp {
        Self::with_settings(url, flags, PgSettings::default()).await
    }

    pub async fn with_settings(url: &str, flags: &[&str], pg: PgSettings) -> TestApp {
        logs::init();
        let (store, pg): (Arc<dyn Store>, _) = if url.starts_with("sqlite:") {
            let store = SqliteStore::open(url).await.expect("SQLite store");
            store.migrate().await.expect("migrations apply");
            (Arc::new(store), None)
        } else {
            let store = PgStore::connect_lazy(url, &pg).expect("store");
            store.migrate().await.expect("migrations apply");
            // Through the pooler of `IDEMGATE_TEST_PG_POOLER`, if set: the
            // app's store only; `pg` (the tests' own reads) stays direct.
            match super::pg::through_pooler(url) {
                Some(pooled) => {
                    let settings = PgSettings {
                        transaction_pooler: true,
                        ..pg
                    };
                    let app_store = PgStore::connect_lazy(&pooled, &settings).expect("store");
                    (Arc::new(app_store), Some(store))
                }
                None => (Arc::new(store.clone()), Some(store)),
            }
        };
        let args = serve_args(flags);
        let checked = args.validate().expect("valid settings");
        let state = wiring::app_state(&args, checked, store.clone());
        // As `serve` does at start (a seal key missing makes the binary
        // refuse to start; here the engine then turns new keys away).
        let _ = state.engine.keep_naming_windows().await;
        let mut secrets = Vec::new();
        if let Some(pos) = flags.iter().position(|f| *f == "--tokens") {
            for pair in flags[pos + 1].split(',') {
                if let Some((_, token)) = pair.split_once(':') {
                    secrets.push(token.to_owned());
                }
            }
        }
        TestApp {
            router: wiring::router(state.clone()),
            state,
            store,
            pg,
            secrets: Arc::new(Mutex::new(secrets)),
        }
    }

    /// Sends one request. `headers` may repeat a name.
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> TestResponse {
        let mut req = Request::builder().method(method).uri(path);
        for (name, value) in headers {
            if name.eq_ignore_ascii_case("idempotency-key") {
                let raw = value.trim().trim_matches('"');
                if raw.len() >= 4 {
                    // The key, and its whole hash: logs may carry only a short
                    // prefix of the hash (docs/operations.md, “Traces”).
                    let hash = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(raw));
                    self.secrets.lock().unwrap().extend([raw.to_owned(), hash]);
                }
            }
            req = req.header(*name, *value);
        }
        let req = req
            .body(body.map_or_else(Body::empty, |b| Body::from(b.to_owned())))
            .unwrap();
        let res = self.router.clone().oneshot(req).await.unwrap();
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        TestResponse {
            status,
            headers,
            body,
            text,
        }
    }

    /// `POST /v1/reservations` with `key` (sent as given) and a JSON body.
    pub async fn reserve(&self, key: &str, body: &str) -> TestResponse {
        self.send(
            "POST",
            "/v1/reservations",
            &[("idempotency-key", key)],
            Some(body),
        )
        .await
    }

    /// `POST /v1/reservations` with `key` as the tenant `auth` (an
    /// `Authorization` value) names.
    pub async fn reserve_as(&self, auth: &str, key: &str, body: &str) -> TestResponse {
        self.send(
            "POST",
            "/v1/reservations",
            &[("idempotency-key", key), ("authorization", auth)],
            Some(body),
        )
        .await
    }

    /// `POST /v1/reservations/{id}/{action}` as the tenant `auth` names.
    pub async fn act_as(&self, auth: &str, id: &str, action: &str, body: &str) -> TestResponse {
        self.send(
            "POST",
            &format!("/v1/reservations/{id}/{action}"),
            &[("authorization", auth)],
            Some(body),
        )
        .await
    }

    /// `POST /v1/reservations/{id}/{action}`.
    pub async fn act(&self, id: &str, action: &str, body: &str) -> TestResponse {
        self.send(
            "POST",
            &format!("/v1/reservations/{id}/{action}"),
            &[],
            Some(body),
        )
        .await
    }

    /// Sleeps until every lease of `secs` seconds taken before now has ended.
    pub async fn outlive(secs: u64) {
        tokio::time::sleep(Duration::from_millis(secs * 1000 + 150)).await;
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let secrets = self.secrets.lock().unwrap().clone();
        let refs: Vec<&str> = secrets.iter().map(String::as_str).collect();
        logs::assert_absent(&refs);
    }
}

/// A fresh key that no other test uses.
pub fn fresh_key() -> String {
    format!("key-{}", uuid::Uuid::new_v4())
}
