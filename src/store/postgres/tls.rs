//! TLS to PostgreSQL as libpq takes it from the URL: `sslmode` (`disable`,
//! `allow`, `prefer` — the default, `require`, `verify-ca`, `verify-full`),
//! `sslrootcert` (a PEM file, or `system`), `sslcert` and `sslkey` (the
//! `PGSSL*` variables when the URL is silent). sqlx makes the TLS connection
//! (rustls, ring); this module adds what sqlx leaves out of libpq's meaning:
//!
//! * `allow` tries without TLS, then with it when the server turns the first
//!   attempt away; `prefer` tries with TLS, then without it when the server
//!   turns the TLS attempt away or the handshake fails (sqlx alone treats
//!   `allow` as `disable`, and never falls back under `prefer`);
//! * `require` with a `sslrootcert` checks the certificate as `verify-ca`;
//! * `sslrootcert=system` trusts the system's roots and asks `verify-full`,
//!   and refuses a weaker mode, as libpq 16 does;
//! * the files are read once when the URL is taken, so a missing or
//!   unreadable one refuses the start naming its setting rather than
//!   failing every connection (they are read again at each connection, as
//!   libpq does, so a renewed certificate is used without a restart);
//! * a certificate that does not verify, a server without TLS under a mode
//!   that requires it, or a client certificate the server refuses is a
//!   refusal at start that names the setting ([`refusal`]), not an outage.
//!
//! The server's certificate is checked against `sslrootcert` and the
//! system's trusted roots (`SSL_CERT_FILE`/`SSL_CERT_DIR` replace those),
//! where libpq trusts `sslrootcert` alone.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgSslMode};

use super::errors::Target;

/// The TLS parameters of a URL, as given (the `PGSSL*` variables fill in
/// what the URL leaves out, as sqlx and libpq read them).
#[derive(Debug, Default)]
struct Given {
    mode: Option<String>,
    root_cert: Option<String>,
    cert: Option<String>,
    key: Option<String>,
}

impl Given {
    fn of(url: &str) -> Given {
        let mut given = Given::default();
        let query = url
            .split_once('?')
            .map(|(_, q)| q.split('#').next().unwrap_or_default())
            .unwrap_or_default();
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            let slot = match &*key {
                "sslmode" | "ssl-mode" => &mut given.mode,
                "sslrootcert" | "ssl-root-cert" | "ssl-ca" => &mut given.root_cert,
                "sslcert" | "ssl-cert" => &mut given.cert,
                "sslkey" | "ssl-key" => &mut given.key,
                _ => continue,
            };
            *slot = Some(value.into_owned());
        }
        let env = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
        given.mode = given.mode.or_else(|| env("PGSSLMODE"));
        given.root_cert = given.root_cert.or_else(|| env("PGSSLROOTCERT"));
        given.cert = given.cert.or_else(|| env("PGSSLCERT"));
        given.key = given.key.or_else(|| env("PGSSLKEY"));
        given
    }
}

/// How the store connects: the options of the first attempt and, under
/// `allow` and `prefer`, those of the second.
#[derive(Debug, Clone)]
pub(super) struct Attempts {
    /// `sslmode` as given (or its default), for messages: `require` with a
    /// root certificate is made `verify-ca`, and says `require`.
    pub(super) given: &'static str,
    pub(super) first: PgConnectOptions,
    pub(super) fallback: Option<PgConnectOptions>,
}

/// `url`'s options with libpq's meaning of its TLS parameters; `Err` names
/// the parameter at fault (a file that cannot be read, a mode unknown).
pub(super) fn options(url: &str) -> Result<Attempts, String> {
    let given = Given::of(url);
    let system = given.root_cert.as_deref() == Some("system");
    let mode = match given.mode.as_deref() {
        None if system => PgSslMode::VerifyFull,
        None => PgSslMode::Prefer,
        Some(word) => PgSslMode::from_str(word).map_err(|_| {
            format!(
                "sslmode={word} is not one of disable, allow, prefer, require, verify-ca, \
                 verify-full"
            )
        })?,
    };
    // sqlx would read `system` as a file's name: the URL goes to it without.
    let url = if system {
        without_param(url, &["sslrootcert", "ssl-root-cert", "ssl-ca"])
    } else {
        url.to_owned()
    };
    let mut options = PgConnectOptions::from_str(&url).map_err(|e| e.to_string())?;
    if system && std::env::var_os("PGSSLROOTCERT").is_some() {
        // The variable would otherwise stand in for the parameter taken out.
        options = PgConnectOptions::from_str(&url)
            .map_err(|e| e.to_string())?
            .ssl_root_cert_from_pem(Vec::new());
    }
    if system && !matches!(mode, PgSslMode::VerifyFull) {
        return Err(format!(
            "sslrootcert=system asks that the server's name be checked: use sslmode=verify-full \
             with it (sslmode={} was given)",
            mode_word(mode)
        ));
    }
    if let Some(path) = given.root_cert.as_deref().filter(|_| !system) {
        check_certs(path, "sslrootcert")?;
    }
    match (given.cert.as_deref(), given.key.as_deref()) {
        (Some(cert), Some(key)) => {
            check_certs(cert, "sslcert")?;
            check_key(key)?;
        }
        (Some(_), None) => return Err("sslcert is given without sslkey: give both".into()),
        (None, Some(_)) => return Err("sslkey is given without sslcert: give both".into()),
        (None, None) => {}
    }
    let said = mode_word(mode);
    // libpq: "require" with a root certificate verifies as "verify-ca".
    let mode = match mode {
        PgSslMode::Require if given.root_cert.is_some() && !system => PgSslMode::VerifyCa,
        mode => mode,
    };
    let options = options.ssl_mode(mode);
    let fallback = match mode {
        PgSslMode::Prefer => Some(options.clone().ssl_mode(PgSslMode::Disable)),
        PgSslMode::Allow => Some(options.clone().ssl_mode(PgSslMode::Require)),
        _ => None,
    };
    Ok(Attempts {
        given: said,
        first: options,
        fallback,
    })
}

/// Whether a first attempt's failure lets the second one be tried: the
/// server turned the connection away (an error at start-up: `allow`'s
/// plain attempt to a server that takes TLS only, `prefer`'s TLS attempt to
/// one whose pg_hba.conf takes it only without), or the TLS handshake failed
/// (`prefer`). A server that cannot be reached is not tried twice.
pub(super) fn worth_a_second_attempt(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(_) | sqlx::Error::Tls(_)) || tls_error(e).is_some()
}

/// The rustls error inside `e`, if its connection failed in the handshake.
fn tls_error(e: &sqlx::Error) -> Option<&rustls::Error> {
    match e {
        sqlx::Error::Io(io) => io.get_ref()?.downcast_ref::<rustls::Error>(),
        sqlx::Error::Tls(inner) => inner.downcast_ref::<rustls::Error>(),
        _ => None,
    }
}

/// Why a connection's failure is a setting to change rather than a server
/// to wait for, in words naming the setting: a certificate that does not
/// verify, a server without TLS under a mode that needs it, a client
/// certificate refused in the handshake. `None` for anything else.
pub(super) fn refusal(
    e: &sqlx::Error,
    mode: &str,
    options: &PgConnectOptions,
    at: &Target,
) -> Option<String> {
    let server = at.server();
    if let sqlx::Error::Tls(inner) = e
        && inner.to_string().contains("does not support TLS")
    {
        return Some(format!(
            "PostgreSQL at {server} does not offer TLS, and sslmode={mode} in DATABASE_URL \
             requires it: turn ssl on at the server, or choose sslmode=prefer"
        ));
    }
    let tls = tls_error(e)?;
    match tls {
        rustls::Error::InvalidCertificate(why) => {
            let fix = match why {
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. } => format!(
                    "connect by a name the certificate bears (DATABASE_URL's host is {}), or \
                     choose sslmode=verify-ca, which does not check the name",
                    options.get_host()
                ),
                rustls::CertificateError::Expired
                | rustls::CertificateError::ExpiredContext { .. }
                | rustls::CertificateError::NotValidYet
                | rustls::CertificateError::NotValidYetContext { .. } => {
                    "renew the server's certificate".to_owned()
                }
                _ => "give in sslrootcert (DATABASE_URL) the certificate of the CA that signed \
                      the server's, or of the provider's bundle"
                    .to_owned(),
            };
            Some(format!(
                "the certificate of PostgreSQL at {server} does not verify under sslmode={mode} \
                 (DATABASE_URL): {tls}: {fix}"
            ))
        }
        rustls::Error::AlertReceived(_) => Some(format!(
            "PostgreSQL at {server} ended the TLS handshake ({tls}): it refused the client \
             certificate, or asks for one: check sslcert and sslkey in DATABASE_URL against \
             the server's ssl_ca_file"
        )),
        _ => None,
    }
}

/// The word libpq uses for `mode`.
pub(super) fn mode_word(mode: PgSslMode) -> &'static str {
    match mode {
        PgSslMode::Disable => "disable",
        PgSslMode::Allow => "allow",
        PgSslMode::Prefer => "prefer",
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
    }
}

/// `path` (the value of `setting`) holds at least one PEM certificate.
fn check_certs(path: &str, setting: &str) -> Result<(), String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let bytes = read(path, setting)?;
    let mut found = 0usize;
    for cert in CertificateDer::pem_slice_iter(&bytes) {
        cert.map_err(|e| format!("{setting}={path} is not a PEM file: {e}"))?;
        found += 1;
    }
    if found == 0 {
        return Err(format!(
            "{setting}={path} holds no certificate (expected PEM: -----BEGIN CERTIFICATE-----)"
        ));
    }
    Ok(())
}

/// `path` (sslkey) holds a PEM private key.
fn check_key(path: &str) -> Result<(), String> {
    use rustls::pki_types::PrivateKeyDer;
    use rustls::pki_types::pem::PemObject as _;
    let bytes = read(path, "sslkey")?;
    PrivateKeyDer::from_pem_slice(&bytes)
        .map(drop)
        .map_err(|e| format!("sslkey={path} holds no usable PEM private key: {e}"))
}

fn read(path: &str, setting: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{setting}={path} cannot be read: {e}"))
}

/// `url` without the query parameters named `names`.
fn without_param(url: &str, names: &[&str]) -> String {
    let Some((base, rest)) = url.split_once('?') else {
        return url.to_owned();
    };
    let (query, fragment) = match rest.split_once('#') {
        Some((q, f)) => (q, Some(f)),
        None => (rest, None),
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let name = pair.split('=').next().unwrap_or_default();
            !pair.is_empty() && !names.contains(&name)
        })
        .collect();
    let mut out = base.to_owned();
    if !kept.is_empty() {
        out.push('?');
        out.push_str(&kept.join("&"));
    }
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_modes_mean_what_libpq_says() {
        let mode = |url: &str| {
            let a = options(url).unwrap();
            (
                mode_word(a.first.get_ssl_mode()),
                a.fallback.map(|f| mode_word(f.get_ssl_mode())),
            )
        };
        if std::env::var_os("PGSSLMODE").is_none() {
            assert_eq!(mode("postgres://u@h/db"), ("prefer", Some("disable")));
        }
        assert_eq!(
            mode("postgres://u@h/db?sslmode=allow"),
            ("allow", Some("require"))
        );
        assert_eq!(mode("postgres://u@h/db?sslmode=disable"), ("disable", None));
        assert_eq!(mode("postgres://u@h/db?sslmode=require"), ("require", None));
        assert_eq!(
            mode("postgres://u@h/db?sslmode=verify-full"),
            ("verify-full", None)
        );
        assert_eq!(
            mode("postgres://u@h/db?sslrootcert=system"),
            ("verify-full", None)
        );
        let weak = options("postgres://u@h/db?sslrootcert=system&sslmode=require").unwrap_err();
        assert!(weak.contains("verify-full"), "{weak}");
        let bad = options("postgres://u@h/db?sslmode=sometimes").unwrap_err();
        assert!(bad.contains("sslmode=sometimes"), "{bad}");
    }

    #[test]
    fn files_that_cannot_be_used_are_named_with_their_setting() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.crt");
        let e = options(&format!(
            "postgres://u@h/db?sslmode=verify-full&sslrootcert={}",
            missing.display()
        ))
        .unwrap_err();
        assert!(e.starts_with("sslrootcert="), "{e}");
        let empty = dir.path().join("empty.crt");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let e = options(&format!(
            "postgres://u@h/db?sslmode=require&sslrootcert={}",
            empty.display()
        ))
        .unwrap_err();
        assert!(e.contains("holds no certificate"), "{e}");
        let e = options(&format!("postgres://u@h/db?sslcert={}", empty.display())).unwrap_err();
        assert!(e.contains("without sslkey"), "{e}");
    }

    #[test]
    fn a_parameter_is_taken_out_and_the_rest_kept() {
        assert_eq!(
            without_param(
                "postgres://u@h/db?sslrootcert=system&sslmode=verify-full#x",
                &["sslrootcert"]
            ),
            "postgres://u@h/db?sslmode=verify-full#x"
        );
        assert_eq!(
            without_param("postgres://u@h/db?sslrootcert=system", &["sslrootcert"]),
            "postgres://u@h/db"
        );
    }
}
