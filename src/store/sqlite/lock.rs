//! The lock that keeps a second process off an SQLite file: an exclusive
//! `flock` on a lock file beside the database (`FILE.lock`), taken when the
//! store opens the file and held for the store's life.
//!
//! * **A file of its own.** SQLite locks the database file with POSIX record
//!   locks, which belong to the process rather than to a descriptor: closing
//!   any descriptor of the file drops every one of them. A lock of ours on
//!   the database file itself would be tangled with SQLite's; on a file
//!   beside it, the two never meet.
//! * **A kernel lock.** `flock` belongs to the open file and ends with the
//!   process, however it ends (a crash, SIGKILL): a lock file left behind
//!   never keeps the next server out, so it is never deleted (deleting it
//!   would let two processes lock two different files of the same name).
//!   Its content, the holder's pid, only serves to name the holder in the
//!   refusal; the kernel's lock table names it first where it can be read.
//! * **One hold per process.** The contract is one idemgate process per
//!   file, and two stores in one process are one process: they share the
//!   hold, released when the last of them is dropped. (Two `flock`s of one
//!   file from one process would refuse each other, since each open file is
//!   locked on its own.)

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::StoreError;

/// The lock files this process holds, by canonical path, with how many
/// stores share each.
static HELD: Mutex<BTreeMap<PathBuf, Held>> = Mutex::new(BTreeMap::new());

struct Held {
    /// Open while the lock lasts: closing it releases the lock.
    file: File,
    users: usize,
}

/// This process's hold on an SQLite database file; released when the last
/// store holding it is dropped.
#[derive(Debug)]
pub(crate) struct FileLock {
    /// The key in [`HELD`].
    key: PathBuf,
}

impl FileLock {
    /// Takes the lock of `database` (the file's path as SQLite opens it), or
    /// says which process holds it.
    pub(crate) fn acquire(database: &Path) -> Result<FileLock, StoreError> {
        // Beside the file itself, however the path names it (relative, or
        // through a symbolic link): every process then finds the same lock.
        let database = &real_path(database);
        let path = lock_path(database);
        // Held across the open and the lock, so that two stores of this
        // process opening the file at once agree on one hold.
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        let (file, writable) = open(&path).map_err(|e| {
            StoreError::unavailable(format!(
                "cannot open the lock file {} (kept beside the database, so that one \
                 process at a time uses it): {e}",
                path.display()
            ))
            .because(e)
        })?;
        let key = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
        if let Some(h) = held.get_mut(&key) {
            h.users += 1;
            return Ok(FileLock { key });
        }
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(StoreError::unavailable(in_use(database, &path, &file)));
            }
            Err(TryLockError::Error(e)) => {
                return Err(StoreError::unavailable(format!(
                    "cannot lock {} (so that one process at a time uses {}): {e}",
                    path.display(),
                    database.display()
                ))
                .because(e));
            }
        }
        if writable && let Err(e) = name_holder(&file) {
            // Only the refusal of a second process reads it, and the kernel's
            // lock table names the holder first.
            tracing::debug!(lock = %path.display(), error = %e, "cannot write the pid into the lock file");
        }
        held.insert(key.clone(), Held { file, users: 1 });
        Ok(FileLock { key })
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = held.get_mut(&self.key) {
            h.users -= 1;
            if h.users == 0 {
                // Closing the file releases the lock.
                held.remove(&self.key);
            }
        }
    }
}

/// `path` with its symbolic links and relative parts resolved, as far as
/// they exist: the file may not be created yet, its directory must.
fn real_path(path: &Path) -> PathBuf {
    if let Ok(real) = std::fs::canonicalize(path) {
        return real;
    }
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    match (std::fs::canonicalize(dir), path.file_name()) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => path.to_owned(),
    }
}

/// `FILE.lock` beside `FILE`.
fn lock_path(database: &Path) -> PathBuf {
    let mut name = OsString::from(database.as_os_str());
    name.push(".lock");
    PathBuf::from(name)
}

/// Opens (creating it if missing) the lock file for writing, or, where it
/// exists but cannot be written (a read-only directory or file), for reading:
/// `flock` needs no write access. Whether it can be written.
fn open(path: &Path) -> std::io::Result<(File, bool)> {
    match OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
    {
        Ok(file) => Ok((file, true)),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem
            ) =>
        {
            File::open(path).map(|f| (f, false)).map_err(|_| e)
        }
        Err(e) => Err(e),
    }
}

/// Writes this process's pid into the lock file it holds.
fn name_holder(mut file: &File) -> std::io::Result<()> {
    file.set_len(0)?;
    file.write_all(format!("{}\n", std::process::id()).as_bytes())
}

/// Says in the lock file of `database`, where this process holds it, the
/// URL at which it answers the operators' endpoints (`serve`'s listener, the
/// proxy's admin listener), so that a second process refused the file (`idemgate
/// keys`) can say where to ask instead. Nothing where this process holds no
/// such lock (another store, an in-memory database).
pub(crate) fn announce_admin(database: &Path, admin_url: &str) -> std::io::Result<()> {
    let key = std::fs::canonicalize(lock_path(&real_path(database)))?;
    let held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    let Some(h) = held.get(&key) else {
        return Ok(());
    };
    let mut file = &h.file;
    file.set_len(0)?;
    std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0))?;
    file.write_all(format!("{}\n{admin_url}\n", std::process::id()).as_bytes())
}

/// Where the holder of `lock` answers the operators' endpoints, as it
/// announced it in the lock file.
pub(crate) fn holder_admin_url(lock: &Path) -> Option<String> {
    let content = std::fs::read_to_string(lock).ok()?;
    let url = content.lines().nth(1)?.trim();
    (url.starts_with("http://") || url.starts_with("https://")).then(|| url.to_owned())
}

/// The refusal: which file, which process holds it, and what to do.
fn in_use(database: &Path, lock: &Path, file: &File) -> String {
    let holder = match holder_pid(lock, file) {
        Some(pid) => match command_line(pid) {
            Some(cmd) => format!("process {pid} ({cmd})"),
            None => format!("process {pid}"),
        },
        None => "another process".to_owned(),
    };
    let ask = match holder_admin_url(lock) {
        Some(url) => format!(" It answers the operators' endpoints at {url}."),
        None => String::new(),
    };
    format!(
        "{} is in use: {holder} holds its lock file {}.{ask} One idemgate process per SQLite \
         file: stop that one first (a running serve or proxy applies the migrations at its \
         start and prunes by itself), give this one a file of its own \
         (DATABASE_URL=sqlite://other.db), or use PostgreSQL, which any number of processes \
         can share",
        database.display(),
        lock.display()
    )
}

/// The pid of the process that holds the lock: from the kernel's lock table
/// where it can be read, else from the lock file's content (which an older
/// holder may have written, when the current one could not write it).
fn holder_pid(lock: &Path, file: &File) -> Option<u32> {
    lock_table_owner(file).or_else(|| {
        std::fs::read_to_string(lock)
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    })
}

/// The pid that `/proc/locks` gives for the `flock` on `file`.
#[cfg(target_os = "linux")]
fn lock_table_owner(file: &File) -> Option<u32> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = file.metadata().ok()?;
    let (dev, ino) = (meta.dev(), meta.ino());
    // glibc's major()/minor() of a userspace dev_t; the table prints them in
    // hex, then the inode in decimal.
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let want = format!("{major:02x}:{minor:02x}:{ino}");
    let table = std::fs::read_to_string("/proc/locks").ok()?;
    // "1: FLOCK  ADVISORY  WRITE 4149 fd:01:1234 0 EOF"; a waiter's line
    // reads "1: -> FLOCK …" and is skipped.
    table.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            [_, "FLOCK", _, _, pid, id, ..] if *id == want => pid.parse().ok(),
            _ => None,
        }
    })
}

#[cfg(not(target_os = "linux"))]
fn lock_table_owner(_file: &File) -> Option<u32> {
    None
}

/// Process `pid`'s command line, where `/proc` shows it, with the values of
/// secrets left out.
fn command_line(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    if args.is_empty() {
        return None;
    }
    Some(redacted(&args))
}

/// The longest command line a refusal quotes.
const MAX_COMMAND_LINE: usize = 300;

/// `args` joined by spaces, with the value of every flag that may carry a
/// secret (tokens, seal keys, passwords) replaced by `***`, and the password
/// of any URL too: the refusal is printed, and logged, where anyone may read it.
fn redacted(args: &[String]) -> String {
    let secret_flag = |flag: &str| {
        let name = flag.trim_start_matches('-').to_ascii_lowercase();
        ["token", "secret", "password", "seal-key", "seal_key"]
            .iter()
            .any(|s| name.contains(s))
    };
    let mut out = Vec::with_capacity(args.len());
    let mut hide_next = false;
    for arg in args {
        if hide_next {
            out.push("***".to_owned());
            hide_next = false;
            continue;
        }
        if arg.starts_with("--") {
            match arg.split_once('=') {
                Some((flag, _)) if secret_flag(flag) => {
                    out.push(format!("{flag}=***"));
                    continue;
                }
                None if secret_flag(arg) => hide_next = true,
                _ => {}
            }
        }
        out.push(without_url_password(arg));
    }
    let mut line = out.join(" ");
    if line.len() > MAX_COMMAND_LINE {
        let mut end = MAX_COMMAND_LINE;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push('…');
    }
    line
}

/// `arg` with the password of a `scheme://user:password@host` URL in it
/// replaced by `***`.
fn without_url_password(arg: &str) -> String {
    let Some(scheme_end) = arg.find("://").map(|i| i + 3) else {
        return arg.to_owned();
    };
    let rest = &arg[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return arg.to_owned();
    };
    match rest[..at].find(':') {
        Some(colon) => format!(
            "{}{}:***{}",
            &arg[..scheme_end],
            &rest[..colon],
            &rest[at..]
        ),
        None => arg.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split(' ').map(str::to_owned).collect()
    }

    #[test]
    fn secrets_are_left_out_of_a_quoted_command_line() {
        let line = redacted(&args(
            "idemgate serve --tokens acme:s3cret --seal-key=AAAA --seal-key-previous BBBB \
             --database-url postgres://u:hunter2@db:5432/x --listen 127.0.0.1:8080 \
             --upstream http://user:pw@origin:3000/base --key-header X-Key",
        ));
        for secret in ["s3cret", "AAAA", "BBBB", "hunter2", ":pw@"] {
            assert!(!line.contains(secret), "{secret} in {line}");
        }
        assert_eq!(
            line,
            "idemgate serve --tokens *** --seal-key=*** --seal-key-previous *** \
             --database-url postgres://u:***@db:5432/x --listen 127.0.0.1:8080 \
             --upstream http://user:***@origin:3000/base --key-header X-Key"
        );
    }

    #[test]
    fn urls_without_a_password_stay_as_they_are() {
        for url in [
            "postgres://u@db/x",
            "sqlite://idemgate.db",
            "http://origin:3000/a@b",
        ] {
            assert_eq!(without_url_password(url), url);
        }
    }

    #[test]
    fn stores_of_one_process_share_the_hold_and_the_last_releases_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("x.db");
        let first = FileLock::acquire(&db).expect("first");
        // Another spelling of the same file is the same hold, and so is a
        // symbolic link to it: the lock lies beside the file itself.
        let second = FileLock::acquire(&dir.path().join(".").join("x.db")).expect("second");
        std::fs::write(&db, b"").unwrap();
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(&db, dir.path().join("link.db")).unwrap();
            drop(FileLock::acquire(&dir.path().join("link.db")).expect("through a link"));
            assert!(!dir.path().join("link.db.lock").exists());
        }
        let lock = lock_path(&real_path(&db));
        assert_eq!(
            std::fs::read_to_string(&lock).unwrap().trim(),
            std::process::id().to_string(),
            "the lock file names its holder"
        );
        // Another open file of the lock is refused, as another process's would be.
        let other = File::open(&lock).unwrap();
        assert!(matches!(other.try_lock(), Err(TryLockError::WouldBlock)));
        #[cfg(target_os = "linux")]
        assert_eq!(lock_table_owner(&other), Some(std::process::id()));
        let refusal = in_use(&db, &lock, &other);
        assert!(
            refusal.contains(&format!("process {}", std::process::id())),
            "{refusal}"
        );
        drop(first);
        assert!(matches!(other.try_lock(), Err(TryLockError::WouldBlock)));
        drop(second);
        other.try_lock().expect("released with the last hold");
    }
}
