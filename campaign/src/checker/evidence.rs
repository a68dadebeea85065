//! How the checker names events in a report: one line per execution or
//! request, with the run's clock in seconds, so a violation can be read
//! against the history and the proxies' logs.

use crate::history::{Execution, Request};

/// Seconds, from the run's milliseconds.
pub fn secs(ms: u64) -> String {
    format!("{}.{:03}s", ms / 1000, ms % 1000)
}

/// One execution, for a report.
pub fn execution(e: &Execution) -> String {
    format!(
        "execution #{} at {} via proxy {}, attempt {}, mode {}, {}: {} {}",
        e.seq,
        secs(e.at),
        e.proxy.map_or_else(|| "?".into(), |p| p.to_string()),
        e.attempt.map_or_else(|| "-".into(), |n| n.to_string()),
        e.mode,
        if e.acted { "acted" } else { "did not act" },
        e.status,
        e.body
    )
}

/// One request and its answer, for a report.
pub fn request(r: &Request) -> String {
    let answer = match (r.status, &r.error) {
        (Some(status), _) => format!(
            "{status}{}{}{}",
            if r.replayed { " replayed" } else { "" },
            r.problem
                .as_deref()
                .map(|p| format!(" {p}"))
                .unwrap_or_default(),
            r.body
                .as_deref()
                .map(|b| format!(" {b}"))
                .unwrap_or_default()
        ),
        (None, Some(e)) => format!("no answer: {e}"),
        (None, None) => "no answer".into(),
    };
    format!(
        "request {} try {} via proxy {} at {}..{}: {answer}",
        r.client,
        r.try_no,
        r.proxy,
        secs(r.start),
        secs(r.end)
    )
}
