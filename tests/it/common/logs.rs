//! In-memory log capture, so tests can prove that no secret is ever logged.
//!
//! [`init`] installs (once per process) a global `tracing` subscriber with the fixed filter
//! `idemgate=trace,sqlx=debug,tower_http=trace,info` that writes plain-text lines (no ANSI,
//! span creation and close included, so span fields are captured even without events inside)
//! into a process-wide buffer; with `TEST_LOG` set it also writes them to stdout. The buffer is
//! shared by every test of the process, so [`assert_absent`] checks all of them together.

use std::io;
use std::sync::{Mutex, MutexGuard, OnceLock};

use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, fmt};

/// The filter of the capture: everything of the crate, and enough of its dependencies.
pub const FILTER: &str = "idemgate=trace,sqlx=debug,tower_http=trace,info";

static BUFFER: Mutex<Vec<u8>> = Mutex::new(Vec::new());
static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

fn buffer() -> MutexGuard<'static, Vec<u8>> {
    // A test that panicked mid-write must not make every later assertion panic too.
    BUFFER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct Capture;

impl io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        buffer().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Installs the capturing subscriber (idempotent). Panics if another global subscriber was
/// installed first: the capture would then silently see nothing.
pub fn init() {
    let installed = INSTALLED.get_or_init(|| {
        let capture = fmt::layer()
            .with_writer(|| Capture)
            .with_ansi(false)
            .with_span_events(FmtSpan::NEW | FmtSpan::CLOSE);
        let stdout = std::env::var_os("TEST_LOG").map(|_| {
            fmt::layer()
                .with_writer(io::stdout)
                .with_span_events(FmtSpan::NEW | FmtSpan::CLOSE)
        });
        tracing_subscriber::registry()
            .with(EnvFilter::new(FILTER))
            .with(capture)
            .with(stdout)
            .try_init()
            .map_err(|e| e.to_string())
    });
    if let Err(e) = installed {
        panic!(
            "logs::init: could not install the capturing tracing subscriber ({e}); another \
             global subscriber was installed first in this test process"
        );
    }
}

/// Everything captured so far in this process, as a String (lossy UTF-8).
pub fn captured() -> String {
    String::from_utf8_lossy(&buffer()).into_owned()
}

/// Panics if any of `secrets` appears in the captured log text. The message names the secret by
/// its index in `secrets` and its length, gives where it occurs (byte offset, line number,
/// count) and shows the offending line with every secret replaced by `[REDACTED #i]`; it never
/// contains a secret. Panics too if [`init`] was not called (an empty capture proves nothing)
/// or if a secret is empty (it would match everywhere).
#[track_caller]
pub fn assert_absent(secrets: &[&str]) {
    assert!(
        matches!(INSTALLED.get(), Some(Ok(()))),
        "logs::assert_absent: call logs::init() before the code under test runs, otherwise \
         nothing is captured and the assertion proves nothing"
    );
    for (i, secret) in secrets.iter().enumerate() {
        assert!(
            !secret.is_empty(),
            "logs::assert_absent: secret #{i} is empty"
        );
    }
    let text = captured();
    let mut findings = Vec::new();
    for (i, secret) in secrets.iter().enumerate() {
        let Some(offset) = text.find(secret) else {
            continue;
        };
        let count = text.matches(secret).count();
        let line_no = text[..offset].matches('\n').count() + 1;
        let line_start = text[..offset].rfind('\n').map_or(0, |p| p + 1);
        let line_end = text[offset..].find('\n').map_or(text.len(), |p| offset + p);
        let line = redact(&text[line_start..line_end], secrets);
        findings.push(format!(
            "  secret #{i} ({} bytes) found {count} time(s), first at byte {offset} (line \
             {line_no}): {line}",
            secret.len()
        ));
    }
    if !findings.is_empty() {
        panic!(
            "a secret appears in the captured logs:\n{}",
            findings.join("\n")
        );
    }
}

/// `line` with every secret replaced (longest first); withheld if anything is left over.
fn redact(line: &str, secrets: &[&str]) -> String {
    let mut order: Vec<usize> = (0..secrets.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(secrets[i].len()));
    let mut out = line.to_owned();
    for i in order {
        out = out.replace(secrets[i], &format!("[REDACTED #{i}]"));
    }
    if secrets.iter().any(|s| out.contains(s)) {
        "<line withheld: redaction incomplete>".to_owned()
    } else {
        out
    }
}
