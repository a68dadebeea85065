//! The migrations are embedded at compile time (`sqlx::migrate!`), which
//! does not tell Cargo to watch their folder: without this, a new migration
//! file would not be built in until something else changed.
//!
//! It also names the schema version each store's migrations end at, for
//! `idemgate --version` (`IDEMGATE_SCHEMA`): the newest migration's version;
//! and, for a pre-release (a version with `-`, such as `0.4.0-dev`: a build
//! with a migration no release has), the commit it was built from, so that
//! two builds of one pre-release tell themselves apart: the whole line
//! `idemgate --version` prints after the name is `IDEMGATE_LONG_VERSION`. The commit is `IDEMGATE_COMMIT` where
//! the builder sets it (a container build, which has no `.git`), else what
//! `git rev-parse` says of the checkout, else `unknown`.
use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    let mut parts = Vec::new();
    for (feature, dir, store) in [
        (
            "CARGO_FEATURE_POSTGRES",
            "migrations/postgres",
            "PostgreSQL",
        ),
        ("CARGO_FEATURE_SQLITE", "migrations/sqlite", "SQLite"),
    ] {
        if std::env::var_os(feature).is_none() {
            continue;
        }
        let root = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default();
        if let Some(version) = newest(&Path::new(&root).join(dir)) {
            parts.push((store, version));
        }
    }
    let line = match parts.as_slice() {
        [] => "no store".to_owned(),
        [(_, version)] => format!("schema {version}"),
        [(_, a), (_, b)] if a == b => format!("schema {a}"),
        many => format!(
            "schema {}",
            many.iter()
                .map(|(store, version)| format!("{version} on {store}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    println!("cargo:rustc-env=IDEMGATE_SCHEMA={line}");
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let long = if version.contains('-') {
        format!("{version} (commit {}, {line})", commit())
    } else {
        format!("{version} ({line})")
    };
    println!("cargo:rustc-env=IDEMGATE_LONG_VERSION={long}");
}

/// The commit this tree was checked out at: 12 hex digits, or `unknown`.
fn commit() -> String {
    println!("cargo:rerun-if-env-changed=IDEMGATE_COMMIT");
    if let Ok(given) = std::env::var("IDEMGATE_COMMIT")
        && !given.trim().is_empty()
    {
        return given.trim().chars().take(12).collect();
    }
    let git = |args: &[&str]| {
        let out = Command::new("git")
            .args(args)
            .current_dir(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    // A new commit or checkout moves HEAD's log: build again then.
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/logs/HEAD");
    }
    git(&["rev-parse", "--short=12", "HEAD"])
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The version (the digits before `_`) of the newest migration in `dir`.
fn newest(dir: &Path) -> Option<u64> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.strip_suffix(".sql")?
                .split('_')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .max()
}
