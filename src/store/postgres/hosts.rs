//! A `DATABASE_URL` that names several servers, as libpq and pgx take it:
//! `postgres://u@db1:5432,db2:5433/idemgate?target_session_attrs=read-write`.
//! sqlx's options take one host, so the URL is cut here into one URL per
//! host (the user, path and parameters shared), tried in order; and
//! `target_session_attrs`, which sqlx does not know, is taken out and read
//! here.
//!
//! idemgate writes on every request, so only a server that takes writes can
//! serve it: whatever the setting, each new connection is checked
//! (`pg_is_in_recovery()`, `transaction_read_only`) and one that leads to a
//! server that will not take writes is closed and the next host tried.
//! `any` (libpq's default), `read-write` and `primary` are therefore the
//! same here — the first host, in order, that takes writes — and `read-only`,
//! `standby` and `prefer-standby`, which ask for a server idemgate cannot
//! use, refuse the start.

/// The URL's hosts, each as a URL of its own, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hosts {
    pub(super) urls: Vec<String>,
}

/// The setting's name, as refusals say it.
const SETTING: &str = "target_session_attrs";

/// Cuts `url` into one URL per host. A URL of one host comes back as it was,
/// less `target_session_attrs`.
pub(super) fn split(url: &str) -> Result<Hosts, String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(Hosts {
            urls: vec![url.to_owned()],
        });
    };
    // The authority ends at the path, the query or the fragment.
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hostlist) = match authority.rfind('@') {
        Some(at) => authority.split_at(at + 1),
        None => ("", authority),
    };
    let tail = without_session_attrs(tail)?;
    let hosts: Vec<&str> = hostlist.split(',').collect();
    if hosts.len() > 1 && hosts.iter().any(|h| h.is_empty()) {
        return Err(format!(
            "DATABASE_URL names an empty host in its list `{hostlist}`: separate hosts with one \
             comma, as in postgres://user@db1:5432,db2:5432/idemgate"
        ));
    }
    Ok(Hosts {
        urls: hosts
            .into_iter()
            .map(|host| format!("{scheme}://{userinfo}{host}{tail}"))
            .collect(),
    })
}

/// `tail` (the path, the query and the fragment) without the
/// `target_session_attrs` parameter, once its value is found acceptable.
fn without_session_attrs(tail: &str) -> Result<String, String> {
    let (before, fragment) = match tail.find('#') {
        Some(i) => tail.split_at(i),
        None => (tail, ""),
    };
    let Some((path, query)) = before.split_once('?') else {
        return Ok(tail.to_owned());
    };
    let mut kept = Vec::new();
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key == SETTING {
            check_session_attrs(value)?;
        } else if !pair.is_empty() {
            kept.push(pair);
        }
    }
    let query = if kept.is_empty() {
        String::new()
    } else {
        format!("?{}", kept.join("&"))
    };
    Ok(format!("{path}{query}{fragment}"))
}

fn check_session_attrs(value: &str) -> Result<(), String> {
    match value {
        "any" | "read-write" | "primary" => Ok(()),
        "read-only" | "standby" | "prefer-standby" => Err(format!(
            "{SETTING}={value} in DATABASE_URL asks for a server that does not take writes, \
             and idemgate writes on every request: use read-write (any and primary mean the \
             same for idemgate: the first host, in order, that takes writes)"
        )),
        other => Err(format!(
            "{SETTING}={other} in DATABASE_URL is not one libpq knows: use read-write (or any, \
             or primary: for idemgate all three mean the first host, in order, that takes \
             writes)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(url: &str) -> Vec<String> {
        split(url).expect("splits").urls
    }

    #[test]
    fn one_host_is_left_as_it_was() {
        for url in [
            "postgres://postgres@127.0.0.1:5432/postgres",
            "postgres://u:p%40ss@db/idemgate?sslmode=require&options=-c%20x%3Dy",
            "postgresql:///idemgate?host=/var/run/postgresql",
            "postgres://%2Fvar%2Frun%2Fpostgresql/idemgate",
            "postgres://user@[::1]:5433/db#frag",
        ] {
            assert_eq!(urls(url), vec![url.to_owned()], "{url}");
        }
    }

    #[test]
    fn several_hosts_become_one_url_each_in_order() {
        assert_eq!(
            urls("postgres://u:pw@db1:5432,db2:5433/idemgate?target_session_attrs=read-write"),
            vec![
                "postgres://u:pw@db1:5432/idemgate".to_owned(),
                "postgres://u:pw@db2:5433/idemgate".to_owned(),
            ]
        );
        assert_eq!(
            urls(
                "postgresql://db1,[::1]:6000,db3:7/x?sslmode=require&target_session_attrs=any&application_name=a"
            ),
            vec![
                "postgresql://db1/x?sslmode=require&application_name=a".to_owned(),
                "postgresql://[::1]:6000/x?sslmode=require&application_name=a".to_owned(),
                "postgresql://db3:7/x?sslmode=require&application_name=a".to_owned(),
            ]
        );
        // An @ in the password (as sqlx reads it: the last @ ends the user).
        assert_eq!(
            urls("postgres://u:p@ss@a:1,b:2"),
            vec![
                "postgres://u:p@ss@a:1".to_owned(),
                "postgres://u:p@ss@b:2".to_owned()
            ]
        );
        // No user, no path.
        assert_eq!(
            urls("postgres://a,b?target_session_attrs=primary"),
            vec!["postgres://a".to_owned(), "postgres://b".to_owned()]
        );
    }

    #[test]
    fn session_attrs_that_ask_for_no_writes_or_are_unknown_are_refused() {
        for value in ["read-only", "standby", "prefer-standby", "readwrite", ""] {
            let url = format!("postgres://a,b/db?target_session_attrs={value}");
            let why = split(&url).expect_err(&url);
            assert!(why.contains("target_session_attrs"), "{why}");
            assert!(why.contains("read-write"), "{why}");
        }
    }

    #[test]
    fn an_empty_host_in_a_list_is_refused() {
        let why = split("postgres://u@a,,b/db").expect_err("empty host");
        assert!(why.contains("empty host"), "{why}");
    }
}
