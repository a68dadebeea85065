//! Embeds the migrations: for each store the build has, the list of its
//! migration files (`migrations/<store>`, sorted by version) as
//! `$OUT_DIR/migrations_<store>.rs`, each file's text by `include_str!`,
//! which [`crate::store::embedded_migrator`] turns into sqlx's `Migrator`.
//! This does what `sqlx::migrate!` did without sqlx's procedural macros,
//! which compiled a second copy of both database drivers (and SQLite's C
//! source) for the build machine. `rerun-if-changed` on `migrations` (cargo
//! watches a folder's files and subfolders) builds a new migration file in.
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
    let root = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default();
    let out = std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR");
    let mut parts = Vec::new();
    for (feature, name, store) in [
        ("CARGO_FEATURE_POSTGRES", "postgres", "PostgreSQL"),
        ("CARGO_FEATURE_SQLITE", "sqlite", "SQLite"),
    ] {
        if std::env::var_os(feature).is_none() {
            continue;
        }
        let dir = Path::new(&root).join("migrations").join(name);
        let files = migrations(&dir);
        if let Some((version, _, _)) = files.last() {
            parts.push((store, *version));
        }
        let list: String = files
            .iter()
            .map(|(version, description, path)| {
                format!("    ({version}, {description:?}, include_str!({path:?})),\n")
            })
            .collect();
        let generated = Path::new(&out).join(format!("migrations_{name}.rs"));
        std::fs::write(&generated, format!("&[\n{list}]\n"))
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", generated.display()));
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

/// The migrations in `dir`, as sqlx reads a folder of them: each
/// `<VERSION>_<DESCRIPTION>.sql` file, with its version, its description
/// (the name's `_`s as spaces) and its path, sorted by version. Other files
/// are not migrations; a `.sql` file whose name does not start with a
/// version, or a reversible (`.up.sql`/`.down.sql`) one, stops the build:
/// idemgate's migrations only go forward.
fn migrations(dir: &Path) -> Vec<(i64, String, String)> {
    let entries = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read the migrations in {}: {e}", dir.display()));
    let mut found = Vec::new();
    for entry in entries {
        let path = entry.expect("a readable migrations folder").path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some((version, rest)) = name.split_once('_') else {
            continue;
        };
        let Some(description) = rest.strip_suffix(".sql") else {
            continue;
        };
        let version: i64 = version.parse().unwrap_or_else(|_| {
            panic!("migration {name}: expected `<VERSION>_<DESCRIPTION>.sql`, with a number for VERSION")
        });
        assert!(
            !description.ends_with(".up") && !description.ends_with(".down"),
            "migration {name}: reversible migrations are not supported; write a new forward migration"
        );
        let path = path
            .canonicalize()
            .unwrap_or_else(|e| panic!("migration {name}: {e}"));
        let path = path
            .to_str()
            .unwrap_or_else(|| panic!("migration {name}: the path is not UTF-8"))
            .to_owned();
        found.push((version, description.replace('_', " "), path));
    }
    found.sort();
    found
}
