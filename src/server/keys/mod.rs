//! `idemgate keys list | show | resolve`: the operators' work on stuck keys,
//! straight against `DATABASE_URL`, or with `--server URL` through a running
//! idemgate's admin endpoints (`remote.rs`), which run the same
//! `crate::server::operations`. Output is a table a person reads, with ages
//! in words, or JSON (`--json`) in the admin endpoints' shapes for scripts.

mod remote;

use std::io::Write as _;

use anyhow::{Context as _, bail};
use chrono::{DateTime, Utc};

use crate::engine::{Engine, Limits};
use crate::problem::ApiError;
use crate::server::config::keys::{
    Database, KeyRef, KeysCommand, ListArgs, ListState, ResolveArgs, ShowArgs,
};
use crate::server::open::{Opening, open_store_as};
use crate::server::operations::{
    self, Action, KeyList, KeyView, ListQuery, ResolveBody, ShownState, list::StateFilter,
};
use crate::server::views::CommitBody;

/// Runs one `keys` command.
pub async fn run(command: KeysCommand) -> anyhow::Result<()> {
    match command {
        KeysCommand::List(args) => list(args).await,
        KeysCommand::Show(args) => show(args).await,
        KeysCommand::Resolve(args) => resolve(args).await,
    }
}

/// Where the keys are asked for: the database, or a running idemgate.
enum Keys {
    Database(Box<Engine>),
    Server(Box<remote::Remote>),
}

impl Keys {
    /// The source `db` names: `--server`, else the database, opened as
    /// `prune` opens it (a PostgreSQL database is not migrated).
    async fn of(db: &Database) -> anyhow::Result<Keys> {
        if let Some(url) = &db.server {
            return Ok(Keys::Server(Box::new(remote::Remote::new(
                url,
                db.token.clone(),
            )?)));
        }
        let store = open_store_as(&db.store, Opening::Existing)
            .await
            .map_err(|e| {
                if db.store.database_url.trim().starts_with("sqlite")
                    && e.to_string().contains("is in use")
                {
                    let asked = ask_instead(&e.to_string());
                    e.context(asked)
                } else {
                    e
                }
            })?;
        let sealer = db.seal.sealer()?;
        Ok(Keys::Database(Box::new(
            Engine::new(store, Limits::default())
                .with_replay_cache(0)
                .with_sealer(sealer),
        )))
    }

    async fn list(&self, query: &ListQuery) -> anyhow::Result<KeyList> {
        match self {
            Keys::Database(engine) => operations::list(engine, query).await.map_err(refused),
            Keys::Server(server) => server.list(query).await,
        }
    }

    /// The view of `(tenant, hash)`, `hash` all 64 digits or a prefix.
    async fn show(&self, tenant: &str, hash: &str) -> anyhow::Result<KeyView> {
        match self {
            Keys::Database(engine) => {
                let hash = operations::expand_key_hash(engine, tenant, hash)
                    .await
                    .map_err(refused)?;
                operations::show(engine, tenant, &hash)
                    .await
                    .map_err(refused)
            }
            Keys::Server(server) => server.show(tenant, hash).await,
        }
    }

    /// Of `names` (one key's possible names, the likeliest first), the
    /// first under which a record is found, else the first.
    async fn first_found(&self, mut names: Vec<(String, String)>) -> (String, String) {
        if names.len() > 1 {
            for (i, (tenant, hash)) in names.iter().enumerate() {
                if self.show(tenant, hash).await.is_ok() {
                    return names.swap_remove(i);
                }
            }
        }
        names.swap_remove(0)
    }

    /// Settles `(tenant, hash)`; `by` is recorded where the database is
    /// asked (a server records its token's name).
    async fn resolve(
        &self,
        tenant: &str,
        hash: &str,
        body: ResolveBody,
        by: &str,
    ) -> anyhow::Result<KeyView> {
        match self {
            Keys::Database(engine) => {
                let hash = operations::expand_key_hash(engine, tenant, hash)
                    .await
                    .map_err(refused)?;
                operations::resolve(engine, tenant, &hash, body, by, usize::MAX)
                    .await
                    .map_err(refused)
            }
            Keys::Server(server) => server.resolve(tenant, hash, &body).await,
        }
    }
}

/// What to run instead when a running idemgate holds the SQLite file: this
/// command with `--server` and the URL the holder announced in its lock file
/// (`refusal` quotes it), else its default listener's.
fn ask_instead(refusal: &str) -> String {
    let url = refusal
        .split("It answers the operators' endpoints at ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .map(|url| url.trim_end_matches('.').to_owned());
    let command = command_with_server(
        std::env::args().skip(1),
        url.as_deref().unwrap_or("http://127.0.0.1:8080"),
    );
    match url {
        Some(_) => format!("a running idemgate holds this SQLite file: ask it instead: {command}"),
        None => format!(
            "a running idemgate holds this SQLite file: ask it instead, on its admin endpoints \
             (serve's listener, or the proxy's admin listener; add --token or \
             IDEMGATE_ADMIN_TOKEN if it has admin tokens), e.g. {command}"
        ),
    }
}

/// `idemgate` and `args` (this command's, after the program), without its
/// `--database-url`, and with `--server URL`.
fn command_with_server(args: impl Iterator<Item = String>, url: &str) -> String {
    let mut words = vec!["idemgate".to_owned()];
    let mut skip_value = false;
    for arg in args {
        if skip_value {
            skip_value = false;
            continue;
        }
        if arg == "--database-url" {
            skip_value = true;
            continue;
        }
        if arg.starts_with("--database-url=") {
            continue;
        }
        let quoted = if arg.is_empty()
            || arg
                .chars()
                .any(|c| c.is_whitespace() || "'\"$`\\|&;<>()*?!#~".contains(c))
        {
            format!("'{}'", arg.replace('\'', "'\\''"))
        } else {
            arg
        };
        words.push(quoted);
    }
    words.push("--server".to_owned());
    words.push(url.to_owned());
    words.join(" ")
}

async fn list(args: ListArgs) -> anyhow::Result<()> {
    let keys = Keys::of(&args.db).await?;
    let mut query = ListQuery {
        state: args.state.map(StateFilter::from),
        tenant: args.tenant.clone(),
        older_than: args.older_than,
        limit: Some(args.limit),
        cursor: args.cursor.clone(),
    };
    let mut all = KeyList {
        keys: Vec::new(),
        next: None,
        now: chrono::Utc::now(),
    };
    loop {
        let page = keys.list(&query).await?;
        all.keys.extend(page.keys);
        all.next = page.next;
        all.now = page.now;
        match &all.next {
            Some(next) if args.all => query.cursor = Some(next.clone()),
            _ => break,
        }
    }
    if args.db.json {
        return print_json(&all);
    }
    let now = Utc::now();
    let mut out = std::io::stdout().lock();
    if all.keys.is_empty() {
        let which = match args.state {
            Some(ListState::Stuck) => "No key waits for a person.",
            Some(ListState::Unknown) => "No key is unknown or held past its lease.",
            Some(ListState::InFlight) => "No key is in flight.",
            Some(ListState::Completed) => "No key is completed.",
            None => "No keys.",
        };
        writeln!(out, "{which}")?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<10} {:<10} {:<14} {:<14} {:<40} {:>7}  {:<22}  DETAIL",
        "STATE", "AGE", "TENANT", "KEY HASH", "REQUEST · LABEL", "ATTEMPT", "LEASE"
    )?;
    for key in &all.keys {
        writeln!(
            out,
            "{:<10} {:<10} {:<14} {:<14} {:<40} {:>7}  {:<22}  {}",
            state_word(key.state),
            words(now - key.created_at),
            short(&key.tenant),
            &key.key_hash[..12],
            request_words(key, 40),
            key.attempt,
            lease_words(key, now),
            detail(key),
        )?;
    }
    writeln!(
        out,
        "\n{} key(s).{}",
        all.keys.len(),
        match &all.next {
            Some(next) => format!(" More: --cursor {next} (or --all)."),
            None => String::new(),
        }
    )?;
    if all.keys.iter().any(|k| k.state == ShownState::Unknown) {
        writeln!(
            out,
            "Settle an unknown key with: idemgate keys resolve TENANT KEY_HASH --release \
             --reason '…' (nothing happened) or --complete --status N --body '…' --reason '…' \
             (this happened); `idemgate keys show TENANT KEY_HASH` shows one whole."
        )?;
    }
    Ok(())
}

async fn show(args: ShowArgs) -> anyhow::Result<()> {
    let names = names_of(&args.key, args.db.seal.sealer()?.as_ref())?;
    let keys = Keys::of(&args.db).await?;
    let (tenant, hash) = keys.first_found(names).await;
    let view = keys
        .show(&tenant, &hash)
        .await
        .map_err(|e| hint_seal(e, &args.db))?;
    if args.db.json {
        return print_json(&view);
    }
    print_view(&view)
}

async fn resolve(args: ResolveArgs) -> anyhow::Result<()> {
    let names = names_of(&args.key, args.db.seal.sealer()?.as_ref())?;
    let response = if args.complete {
        let Some(status) = args.status else {
            bail!("--complete needs --status: the status of the response that really happened");
        };
        let mut headers = Vec::new();
        for line in &args.header {
            let Some((name, value)) = line.split_once(':') else {
                bail!("--header {line:?}: expected `Name: value`");
            };
            headers.push((name.trim().to_owned(), value.trim().to_owned()));
        }
        let body = match (&args.body, &args.body_file) {
            (Some(text), _) => Some(text.clone().into_bytes()),
            (None, Some(path)) => Some(
                std::fs::read(path)
                    .with_context(|| format!("--body-file {}: cannot read it", path.display()))?,
            ),
            (None, None) => None,
        };
        let (body, body_base64) = match body {
            None => (None, None),
            Some(bytes) => match String::from_utf8(bytes) {
                Ok(text) => (Some(text), None),
                Err(e) => {
                    use base64::Engine as _;
                    (
                        None,
                        Some(base64::engine::general_purpose::STANDARD.encode(e.into_bytes())),
                    )
                }
            },
        };
        Some(CommitBody {
            status,
            headers,
            body,
            body_base64,
        })
    } else {
        None
    };
    let by = args
        .by
        .clone()
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "idemgate keys".to_owned());
    let keys = Keys::of(&args.db).await?;
    let (tenant, hash) = keys.first_found(names).await;
    let body = ResolveBody {
        action: if args.complete {
            Action::Complete
        } else {
            Action::Release
        },
        reason: args.reason.clone(),
        response,
    };
    let view = keys
        .resolve(&tenant, &hash, body, &by)
        .await
        .map_err(|e| hint_seal(e, &args.db))?;
    let by = match &keys {
        Keys::Database(_) => by,
        Keys::Server(_) => view.resolution.as_ref().map_or(by, |r| r.by.clone()),
    };
    if args.db.json {
        return print_json(&view);
    }
    let mut out = std::io::stdout().lock();
    match view.state {
        ShownState::Released => writeln!(
            out,
            "Released: the next request with this key executes. (by {by})"
        )?,
        _ => writeln!(
            out,
            "Completed: every retry with this key replays status {}. (by {by})",
            view.status.unwrap_or_default()
        )?,
    }
    drop(out);
    print_view(&view)
}

/// Every tenant and key hash `key` may name, the likeliest first: one, but
/// for a raw key (or a `--tenant-of` value) under sealing, whose stored
/// names are keyed under the seal key (`sealer`, as `serve` or `proxy` has
/// it) — and, during a window, may be the plain ones.
fn names_of(
    key: &KeyRef,
    sealer: Option<&crate::seal::Sealer>,
) -> anyhow::Result<Vec<(String, String)>> {
    let (tenant, tenant_from_credential) = match (&key.tenant, &key.tenant_of) {
        (Some(tenant), _) => (tenant.clone(), false),
        (None, Some(value)) => {
            use sha2::{Digest, Sha256};
            (hex::encode(Sha256::digest(value.as_bytes())), true)
        }
        (None, None) => bail!(
            "name the key's tenant: TENANT (as `keys list` shows it), or --tenant-of VALUE for \
             the proxy (the tenant header's value)"
        ),
    };
    let plain = match (&key.key_hash, &key.key) {
        (Some(hash), _) if !tenant_from_credential => return Ok(vec![(tenant, hash.clone())]),
        (Some(hash), _) => {
            // The hash as `keys list` shows it: stored already; only the
            // tenant is to be named.
            let plain = [0; 32];
            return Ok(crate::seal::names_of(sealer, &tenant, true, &plain)
                .into_iter()
                .map(|(tenant, _)| (tenant, hash.clone()))
                .collect());
        }
        (None, Some(raw)) => {
            crate::key::parse_value(raw.as_bytes(), &crate::key::KeyPolicy::default())
                .map_err(|e| anyhow::anyhow!("--key: {}", ApiError::from(e)))?
                .hash()
        }
        (None, None) => match &key.model_key {
            Some(raw) => {
                let parsed =
                    crate::key::parse_value(raw.as_bytes(), &crate::key::KeyPolicy::default())
                        .map_err(|e| anyhow::anyhow!("--model-key: {}", ApiError::from(e)))?;
                parsed.in_model_scope().hash()
            }
            None => bail!(
                "name the key: KEY_HASH (as `keys list` shows it), or --key KEY to hash it here \
                 (--model-key KEY for a key a model chose in an MCP tool call)"
            ),
        },
    };
    Ok(
        crate::seal::names_of(sealer, &tenant, tenant_from_credential, &plain)
            .into_iter()
            .map(|(tenant, hash)| (tenant, hex::encode(hash)))
            .collect(),
    )
}

/// `e`, with a word on sealing where a key named by its raw form was not
/// found and this command has no seal key: under sealing the stored names
/// are keyed, and only the seal key names them.
fn hint_seal(e: anyhow::Error, db: &Database) -> anyhow::Error {
    let unsealed = db.seal.seal_key.is_none();
    if unsealed && e.to_string().contains("not-found") {
        e.context(
            "if the server seals its records (IDEMGATE_SEAL_KEY), its key hashes and tenants \
             are keyed: give this command the same --seal-key to name a key by --key or \
             --tenant-of, or name it by the hash `keys list` shows",
        )
    } else {
        e
    }
}

/// An operation's refusal, in its problem's words.
fn refused(e: ApiError) -> anyhow::Error {
    match e {
        ApiError::Internal(why) => anyhow::anyhow!("internal error: {why}"),
        ApiError::StoreUnavailable => crate::server::config::ConfigError {
            setting: "database_url",
            problem: "the database is unavailable (store-unavailable); try again once it answers"
                .into(),
        }
        .into(),
        other => anyhow::anyhow!("{} ({})", other, other.slug()),
    }
}

fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    Ok(())
}

fn print_view(view: &KeyView) -> anyhow::Result<()> {
    let now = Utc::now();
    let mut out = std::io::stdout().lock();
    let when =
        |t: DateTime<Utc>| format!("{} ({})", t.format("%Y-%m-%d %H:%M:%S UTC"), ago(now, t));
    writeln!(out, "tenant          {}", view.tenant)?;
    writeln!(out, "key hash        {}", view.key_hash)?;
    writeln!(out, "state           {}", state_word(view.state))?;
    if let Some(request) = &view.request {
        writeln!(out, "request         {} {}", request.method, request.path)?;
    }
    if let Some(label) = &view.label {
        writeln!(out, "label           {label}")?;
    }
    if let Some(trace_id) = &view.trace_id {
        writeln!(out, "trace id        {trace_id}")?;
    }
    writeln!(out, "attempt         {}", view.attempt)?;
    writeln!(out, "reservation id  {}", view.reservation_id)?;
    writeln!(
        out,
        "on lease expiry {}",
        match view.on_lease_expiry {
            crate::server::views::LeaseExpiry::Hold => "hold",
            crate::server::views::LeaseExpiry::Takeover => "takeover",
        }
    )?;
    writeln!(out, "created         {}", when(view.created_at))?;
    if let Some(lease) = view.lease_expires_at {
        writeln!(out, "lease ends      {}", when(lease))?;
    }
    if let Some(done) = view.completed_at {
        writeln!(out, "completed       {}", when(done))?;
    }
    writeln!(out, "expires         {}", when(view.expires_at))?;
    if let Some(recovery) = &view.recovery {
        writeln!(out, "recovery point  {}", recovery.recovery_point)?;
        if let Some(data) = &recovery.data {
            writeln!(out, "recovery data   {data}")?;
        }
    }
    if let Some(status) = view.status {
        writeln!(out, "stored status   {status}")?;
    }
    if let Some(r) = &view.resolution {
        writeln!(
            out,
            "resolved        {} by {}, {}: {}",
            match r.action {
                Action::Release => "released",
                Action::Complete => "completed",
            },
            r.by,
            ago(now, r.at),
            r.reason
        )?;
    }
    Ok(())
}

fn state_word(state: ShownState) -> &'static str {
    match state {
        ShownState::InFlight => "in_flight",
        ShownState::Completed => "completed",
        ShownState::Unknown => "unknown",
        ShownState::Released => "released",
    }
}

fn short(tenant: &str) -> String {
    if tenant.chars().count() <= 14 {
        tenant.to_owned()
    } else {
        format!("{}…", tenant.chars().take(13).collect::<String>())
    }
}

/// What the key was for, as `METHOD /path · label` (either alone where the
/// other is not known), cut to `width` characters; `-` where neither is.
fn request_words(key: &KeyView, width: usize) -> String {
    let request = key
        .request
        .as_ref()
        .map(|r| format!("{} {}", r.method, r.path));
    let text = match (request, &key.label) {
        (Some(request), Some(label)) => format!("{request} · {label}"),
        (Some(request), None) => request,
        (None, Some(label)) => label.clone(),
        (None, None) => return "-".into(),
    };
    if text.chars().count() <= width {
        text
    } else {
        format!("{}…", text.chars().take(width - 1).collect::<String>())
    }
}

fn lease_words(key: &KeyView, now: DateTime<Utc>) -> String {
    match (key.state, key.lease_expires_at) {
        (ShownState::Completed | ShownState::Released, _) | (_, None) => "-".into(),
        (_, Some(end)) if end <= now => format!("ended {} ago", words(now - end)),
        (_, Some(end)) => format!("ends in {}", words(end - now)),
    }
}

fn detail(key: &KeyView) -> String {
    if let Some(r) = &key.resolution {
        return format!("resolved by {}: {}", r.by, r.reason);
    }
    match (key.status, &key.recovery) {
        (Some(status), _) => format!("status {status}"),
        (None, Some(recovery)) => format!("recovery point {}", recovery.recovery_point),
        (None, None) => String::new(),
    }
}

fn ago(now: DateTime<Utc>, then: DateTime<Utc>) -> String {
    if then <= now {
        format!("{} ago", words(now - then))
    } else {
        format!("in {}", words(then - now))
    }
}

/// A span in words a person reads at a glance: "12 seconds", "3 minutes",
/// "5 hours", "2 days".
pub fn words(span: chrono::TimeDelta) -> String {
    let secs = span.num_seconds().max(0);
    let (n, unit) = match secs {
        0..60 => (secs, "second"),
        60..3_600 => (secs / 60, "minute"),
        3_600..86_400 => (secs / 3_600, "hour"),
        _ => (secs / 86_400, "day"),
    };
    format!("{n} {unit}{}", if n == 1 { "" } else { "s" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_to_ask_instead_keeps_the_words_and_drops_the_database() {
        let args = |line: &str| line.split(' ').map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(
            command_with_server(
                args("keys list --state stuck --database-url sqlite://a.db").into_iter(),
                "http://127.0.0.1:9090"
            ),
            "idemgate keys list --state stuck --server http://127.0.0.1:9090"
        );
        assert_eq!(
            command_with_server(
                vec![
                    "keys".into(),
                    "resolve".into(),
                    "--database-url=sqlite://a.db".into(),
                    "--reason".into(),
                    "it's done".into(),
                ]
                .into_iter(),
                "http://h:1"
            ),
            "idemgate keys resolve --reason 'it'\\''s done' --server http://h:1"
        );
    }

    #[test]
    fn spans_in_words() {
        let s = chrono::TimeDelta::seconds;
        assert_eq!(words(s(0)), "0 seconds");
        assert_eq!(words(s(1)), "1 second");
        assert_eq!(words(s(59)), "59 seconds");
        assert_eq!(words(s(60)), "1 minute");
        assert_eq!(words(s(7_200)), "2 hours");
        assert_eq!(words(s(86_400 * 3 + 5)), "3 days");
        assert_eq!(words(s(-5)), "0 seconds");
    }
}
