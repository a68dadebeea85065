//! The migrations are embedded at compile time (`sqlx::migrate!`), which
//! does not tell Cargo to watch their folder: without this, a new migration
//! file would not be built in until something else changed.
//!
//! It also names the schema version each store's migrations end at, for
//! `idemgate --version` (`IDEMGATE_SCHEMA`): the newest migration's version.
use std::path::Path;

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
