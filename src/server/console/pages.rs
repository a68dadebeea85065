//! The console's HTML: the page around the fragments, and each fragment as
//! the operations answer. maud escapes every value it writes.

use chrono::{DateTime, SecondsFormat, Utc};
use maud::{DOCTYPE, Markup, html};

use super::PAGE_SIZE;
use crate::problem::ApiError;
use crate::server::operations::list::StateFilter;
use crate::server::operations::{Counts, KeyList, KeyView, ListQuery, Shown, ShownState};
use crate::server::views::LeaseExpiry;
use crate::store::StoredResponse;

/// htmx's settings: no inline styles (the page's policy allows none), no
/// `eval`, no history snapshots in `localStorage` (they would keep what an
/// operator saw), requests to this origin only.
const HTMX_CONFIG: &str = r#"{"includeIndicatorStyles":false,"allowEval":false,"allowScriptTags":false,"historyCacheSize":0,"refreshOnHistoryMiss":true,"selfRequestsOnly":true}"#;

/// The most of a stored body the page shows.
const BODY_SHOWN: usize = 64 * 1024;

/// What the page's main part shows.
pub enum Main<'a> {
    /// The queue of keys that wait for a person.
    Queue,
    /// One key.
    Key { tenant: &'a str, key_hash: &'a str },
}

/// The page: the token form, the counts, and the queue or one key, each
/// filled in by its fragment; `docs`: the listener serves `/docs` too.
pub fn shell(main: Main<'_>, docs: bool) -> Markup {
    let title = match &main {
        Main::Queue => "Keys that wait for a person · idemgate console".to_owned(),
        Main::Key { key_hash, .. } => format!("Key {} · idemgate console", prefix(key_hash)),
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="color-scheme" content="light dark";
                meta name="htmx-config" content=(HTMX_CONFIG);
                title { (title) }
                link rel="stylesheet" href="/console/assets/console.css";
                link rel="icon" type="image/svg+xml" href="/console/assets/icon.svg";
            }
            body {
                a.skip href="#main" { "Skip to the keys" }
                header {
                    h1 { "idemgate console" }
                    nav aria-label="Console" {
                        a href="/console" { "Queue" }
                        @if docs { a href="/docs" { "API docs" } }
                    }
                }
                main #main {
                    section.panel #token-panel aria-label="Admin token" {
                        form #token-form {
                            div.field {
                                label for="token" { "Admin token" }
                                input #token type="password" name="token" autocomplete="off"
                                    spellcheck="false" aria-describedby="token-hint";
                            }
                            button type="submit" { "Use token" }
                            p.hint #token-hint {
                                "A token of IDEMGATE_ADMIN_TOKENS (a tenant's token is not one). \
                                 Kept for this tab only and sent with each of the page's requests; \
                                 never a cookie. Not needed on a loopback listener of a server \
                                 without any tokens."
                            }
                        }
                        p #token-set hidden {
                            "Token set for this tab. "
                            button.secondary #forget-token type="button" { "Forget token" }
                        }
                    }
                    section.panel #counts aria-label="Counts"
                        hx-get="/console/fragments/counts"
                        hx-trigger="load, every 5s, token-changed from:body, key-settled from:body" {
                        p.muted { "Counting the keys that wait…" }
                    }
                    @match main {
                        Main::Queue => {
                            h2 { "Keys that wait for a person" }
                            p.hint {
                                "Unknown keys (their holder could not say whether the effect \
                                 happened) and keys in flight past their lease, oldest first. \
                                 Settle one by saying what happened."
                            }
                            form.inline #filters aria-label="Filters"
                                hx-get="/console/fragments/queue" hx-target="#queue-section" {
                                div {
                                    label for="filter-tenant" { "Tenant" }
                                    input #filter-tenant type="text" name="tenant" autocomplete="off";
                                }
                                div {
                                    label for="filter-state" { "State" }
                                    select #filter-state name="state" {
                                        option value="stuck" selected { "Waiting for a person" }
                                        option value="unknown" { "Unknown" }
                                        option value="in_flight" { "In flight" }
                                        option value="completed" { "Completed" }
                                        option value="" { "Any" }
                                    }
                                }
                                div {
                                    label for="filter-older" { "Older than (minutes)" }
                                    input #filter-older type="number" name="older_than" min="0"
                                        step="1" inputmode="numeric";
                                }
                                button type="submit" { "Filter" }
                            }
                            form.inline #lookup aria-label="Find a key"
                                hx-post="/console/fragments/lookup" hx-target="#lookup-result"
                                hx-sync="this:replace" {
                                div {
                                    label for="lookup-tenant" { "Its tenant" }
                                    input #lookup-tenant type="text" name="tenant" autocomplete="off"
                                        placeholder="default" required;
                                }
                                div {
                                    label for="lookup-key" { "Key, hash or prefix" }
                                    input #lookup-key type="text" name="key" autocomplete="off"
                                        spellcheck="false" required aria-describedby="lookup-hint";
                                }
                                div {
                                    label for="lookup-kind" { "It is" }
                                    select #lookup-kind name="kind" {
                                        option value="raw" selected { "the key as sent" }
                                        option value="hash" { "its hash or a prefix" }
                                    }
                                }
                                button type="submit" { "Find" }
                                p.hint #lookup-hint {
                                    "The key as the client sent it (hashed by idemgate; never logged or kept), \
                                     or its hash: all 64 hex digits, or the first 8 or more."
                                }
                            }
                            div #lookup-result role="status" aria-live="polite" {}
                            section #queue-section aria-label="Queue" aria-live="polite"
                                hx-get="/console/fragments/queue" hx-include="#filters"
                                hx-trigger="load, refresh, token-changed from:body" {
                                p.muted { "Loading the queue…" }
                            }
                        }
                        Main::Key { tenant, key_hash } => {
                            p { a href="/console" { "← Back to the queue" } }
                            section #key aria-label="Key"
                                hx-get=(format!("/console/fragments/keys/{}/{}", segment(tenant), segment(key_hash)))
                                hx-trigger="load, token-changed from:body" {
                                h2 { "Key " (prefix(key_hash)) }
                                p.muted { "Loading the key…" }
                            }
                        }
                    }
                    noscript {
                        p.problem {
                            "The console needs JavaScript: it sends the admin token as a header, \
                             never as a cookie. Without it, the same operations are "
                            code { "GET /v1/admin/keys" } " and " code { "idemgate keys list" } "."
                        }
                    }
                }
                script src="/console/assets/htmx.min.js" {}
                script src="/console/assets/console.js" {}
            }
        }
    }
}

/// A refusal or failure, where its fragment would go.
pub fn problem(e: &ApiError) -> Markup {
    let problem = e.problem("");
    html! {
        div.problem role="alert" {
            strong { (problem.type_) } " (" (problem.status) " " (problem.title) "): "
            (problem.detail)
        }
    }
}

/// The counts at the top: how many keys wait, since when the oldest, and
/// whether the store answers.
pub fn counts(counts: Result<Counts, ApiError>) -> Markup {
    match counts {
        Ok(c) => html! {
            p data-stuck=(c.stuck) data-up="1" {
                span {
                    span.count { (c.stuck) } " "
                    @if c.stuck == 1 { "key waits for a person" } @else { "keys wait for a person" }
                }
                span {
                    "oldest: "
                    @match c.oldest {
                        Some(at) => { time datetime=(iso(at)) { (age(c.now - at)) } }
                        None => { "none" }
                    }
                }
                span { "store: " span.up { "up" } }
                span.muted { "as of " (c.now.format("%H:%M:%S UTC")) }
            }
        },
        // The queue or the key below says why in full: said once.
        Err(ApiError::StoreUnavailable) => html! {
            p data-stuck="?" data-up="0" role="alert" {
                span { "store: " span.down { "unavailable" } }
                span.muted { "asked again every 5 s" }
            }
        },
        Err(e) => html! { div data-stuck="?" data-up="?" { (problem(&e)) } },
    }
}

/// The counts of a page whose requests are refused (no token, a wrong one,
/// no admin endpoints): the queue or the key below says why, once.
pub fn counts_refused() -> Markup {
    html! { p.muted data-stuck="?" data-up="?" { "No counts without an operator's access: see below." } }
}

/// One page of the queue, with the way to the next.
pub fn queue(page: &KeyList, query: &ListQuery) -> Markup {
    let next = page.next.as_ref().map(|cursor| {
        let mut url = form_urlencoded::Serializer::new(String::from("/console/fragments/queue?"));
        url.append_pair("cursor", cursor);
        url.finish()
    });
    html! {
        @if page.keys.is_empty() {
            table #queue {
                tbody { tr { td { "No keys" @if query.cursor.is_some() { " on this page" } " match." } } }
            }
        } @else {
            table #queue {
                caption.muted {
                    (page.keys.len()) " " @if page.keys.len() == 1 { "key" } @else { "keys" }
                    ", oldest first" @if query.cursor.is_some() { " (a later page)" }
                }
                thead {
                    tr { th scope="col" { "Key" } th scope="col" { "Request" } th scope="col" { "Tenant" } th scope="col" { "State" }
                         th scope="col" { "Attempt" } th scope="col" { "Age" } th scope="col" { "Why it waits" } }
                }
                tbody {
                    @for key in &page.keys {
                        tr {
                            td data-label="Key" {
                                a.hash href=(key_href(key)) title=(key.key_hash) { (prefix(&key.key_hash)) }
                            }
                            td.request data-label="Request" { (request_line(key)) }
                            td.tenant data-label="Tenant" { (key.tenant) }
                            td data-label="State" { (state_badge(key, page.now)) }
                            td data-label="Attempt" { (key.attempt) }
                            td data-label="Age" {
                                time datetime=(iso(key.created_at)) title=(human(key.created_at)) {
                                    (age(page.now - key.created_at))
                                }
                            }
                            td data-label="Why it waits" { (why(key, page.now)) }
                        }
                    }
                }
            }
        }
        div.pager {
            @if query.cursor.is_some() {
                button.secondary type="button" hx-get="/console/fragments/queue"
                    hx-include="#filters" hx-target="#queue-section" { "First page" }
            }
            @if let Some(next) = next {
                button.secondary type="button" hx-get=(next) hx-include="#filters"
                    hx-target="#queue-section" { "Next page" }
            }
            span.muted { (PAGE_SIZE) " keys a page. " (filters_note(query)) }
        }
    }
}

fn filters_note(query: &ListQuery) -> String {
    let state = match query.state {
        Some(StateFilter::Stuck) => "waiting for a person",
        Some(StateFilter::Unknown) => "unknown",
        Some(StateFilter::InFlight) => "in flight",
        Some(StateFilter::Completed) => "completed",
        None => "any state",
    };
    let mut note = format!("Showing: {state}");
    if let Some(tenant) = &query.tenant {
        note.push_str(&format!(", tenant {tenant}"));
    }
    if let Some(secs) = query.older_than {
        note.push_str(&format!(", older than {} min", secs / 60));
    }
    note.push('.');
    note
}

/// How a settle ended, for the key panel's message.
pub enum SettleMessage<'a> {
    /// This request settled it.
    Now,
    /// Someone settled it first: the endpoint's `409` detail.
    Already(&'a str),
}

/// One key: its view, its timeline, its stored response, and the settle
/// form while it waits for a person.
pub fn key(shown: &Shown, settled: Option<SettleMessage<'_>>) -> Markup {
    let key = &shown.view;
    let stuck = is_stuck(key, shown.now);
    let settled_now = settled.is_some();
    html! {
        h2 { "Key " (prefix(&key.key_hash)) }
        div #settle-result role="status" aria-live="polite" {
            @match settled {
                Some(SettleMessage::Now) => {
                    p.settled {
                        "Settled: the key is now " strong { (key.state.as_str()) } ". "
                        (retry_now(shown))
                    }
                }
                Some(SettleMessage::Already(detail)) => {
                    p.problem { (detail) ". " (retry_now(shown)) }
                }
                None => {}
            }
        }
        dl.view {
            dt { "Tenant" } dd { (key.tenant) }
            dt { "Key hash" } dd { code { (key.key_hash) } }
            dt { "Request" } dd #key-request { (request_line(key)) }
            @if let Some(trace_id) = &key.trace_id {
                dt { "Trace id" } dd #key-trace { code { (trace_id) } }
            }
            dt { "State" } dd { (state_badge(key, shown.now)) }
            dt { "Attempt" } dd { (key.attempt) }
            dt { "Reservation id" } dd { code { (key.reservation_id) } }
            dt { "At the lease's end" } dd { (lease_expiry(key)) }
            dt { "Reserved" } dd { (when(key.created_at, shown.now)) }
            @if let Some(end) = key.lease_expires_at {
                dt { @if end <= shown.now { "Lease ended" } @else { "Lease ends" } }
                dd { (when(end, shown.now)) }
            }
            dt { "Expires" } dd { (when(key.expires_at, shown.now)) " (then it is new again)" }
            dt { "Status" } dd { @match key.status { Some(s) => { (s) } None => { "none stored" } } }
            @if let Some(recovery) = &key.recovery {
                dt { "Recovery point" }
                dd #key-recovery {
                    code { (recovery.recovery_point) }
                    @if let Some(data) = &recovery.data {
                        pre { (serde_json::to_string_pretty(data).unwrap_or_default()) }
                    }
                }
            }
        }
        h3 { "Timeline" }
        ol.timeline #timeline { @for (at, timed, what) in timeline(key, shown.now) { li { @if timed { (when(at, shown.now)) ": " } (what) } } }
        @if let Some(response) = &shown.response {
            section #response aria-label="Stored response" {
                h3 { "Stored response" }
                p { "Every retry replays this, with " code { "Idempotent-Replayed: true" } "." }
                (stored(response))
            }
        }
        @if stuck {
            (settle_form(key))
        } @else if !settled_now {
            p.hint { (not_stuck_note(key, shown)) }
        }
    }
}

/// A key someone released first: forgotten, so only the endpoint's `409`
/// detail (by whom, when, why) is left to show.
pub fn released_already(detail: &str) -> Markup {
    html! {
        div #settle-result role="status" aria-live="polite" {
            p.problem {
                (detail) ". A retry now runs the request again: the effect happens anew."
            }
        }
        p { a href="/console" { "Back to the queue" } }
    }
}

/// A key released just now: forgotten, so nothing of it is left to show.
pub fn released(by: &str) -> Markup {
    html! {
        div #settle-result role="status" aria-live="polite" {
            p.settled {
                "Settled: the key is now " strong { "released" } " (by " (by) "): nothing happened, \
                 and it is forgotten. A retry now runs the request again: the effect happens anew."
            }
        }
        p { a href="/console" { "Back to the queue" } }
    }
}

fn settle_form(key: &KeyView) -> Markup {
    let action = format!(
        "/console/fragments/keys/{}/{}/resolve",
        segment(&key.tenant),
        segment(&key.key_hash)
    );
    html! {
        form #settle hx-post=(action) hx-target="#key" hx-swap="innerHTML"
            hx-sync="this:drop" hx-disabled-elt="find button" aria-labelledby="settle-title" {
            h3 #settle-title { "Settle this key" }
            p.hint {
                "Look in the books (the provider's dashboard, the ledger) for what this request did, \
                 then say so. Only one settlement is kept."
            }
            fieldset {
                legend { "What happened?" }
                div.choice {
                    input #action-release type="radio" name="action" value="release"
                        aria-describedby="action-release-note";
                    div {
                        label for="action-release" { "Release: nothing happened" }
                        p.hint #action-release-note {
                            "The key is forgotten. A retry runs the request again: the effect happens anew."
                        }
                    }
                }
                div.choice {
                    input #action-complete type="radio" name="action" value="complete"
                        aria-describedby="action-complete-note";
                    div {
                        label for="action-complete" { "Complete: this is what happened" }
                        p.hint #action-complete-note {
                            "The response below is stored. Every retry gets it as a replay; the effect does not run again."
                        }
                    }
                }
            }
            fieldset #settle-response {
                legend { "The response that happened (Complete only)" }
                div.field {
                    label for="settle-status" { "Status" }
                    input #settle-status type="number" name="status" min="100" max="599"
                        value=(key.status.unwrap_or(200)) inputmode="numeric";
                }
                div.field {
                    label for="settle-headers" { "Headers" }
                    textarea #settle-headers name="headers" rows="3" aria-describedby="settle-headers-hint"
                        spellcheck="false" { "Content-Type: application/json" }
                    span.hint #settle-headers-hint { "One a line: Name: value" }
                }
                div.field {
                    label for="settle-body" { "Body" }
                    textarea #settle-body name="body" rows="4" spellcheck="false" {}
                }
            }
            div.field {
                label for="settle-reason" { "Reason" }
                input #settle-reason type="text" name="reason" required maxlength="1000"
                    aria-describedby="settle-reason-hint" autocomplete="off";
                span.hint #settle-reason-hint { "Why, in your words: kept with the key and logged." }
            }
            button type="submit" { "Settle" }
            span.busy-note.muted { " Settling…" }
        }
    }
}

fn stored(response: &StoredResponse) -> Markup {
    let shown = &response.body[..response.body.len().min(BODY_SHOWN)];
    let text = std::str::from_utf8(shown).ok();
    html! {
        dl.view {
            dt { "Status" } dd { (response.status) }
            dt { "Headers" }
            dd {
                @if response.headers.is_empty() { "none" } @else {
                    pre { @for (name, value) in &response.headers { (name) ": " (value) "\n" } }
                }
            }
            dt { "Body" }
            dd {
                @if response.body.is_empty() { "empty" }
                @else if let Some(text) = text {
                    pre { (text) }
                    @if shown.len() < response.body.len() {
                        p.hint { "The first " (shown.len()) " of " (response.body.len()) " bytes." }
                    }
                } @else {
                    p { (response.body.len()) " bytes, not text." }
                }
            }
        }
    }
}

/// What a retry with the key gets now.
fn retry_now(shown: &Shown) -> Markup {
    match (shown.view.state, &shown.response) {
        (ShownState::Completed, Some(r)) => html! {
            "A retry now replays " strong { (r.status) } " with the stored response below."
        },
        (ShownState::Released, _) => {
            html! { "A retry now runs the request again: the effect happens anew." }
        }
        (ShownState::Unknown, _) => {
            html! { "A retry now gets 409 outcome-unknown until it is settled." }
        }
        _ => html! { "A retry now waits for its holder (409 request-in-flight)." },
    }
}

fn not_stuck_note(key: &KeyView, shown: &Shown) -> Markup {
    html! {
        @match key.state {
            ShownState::Completed => { "Completed: nothing to settle. " (retry_now(shown)) }
            ShownState::Released => { "Released: nothing to settle. " (retry_now(shown)) }
            _ => { "In flight under a live lease: its holder settles it. Once the lease ends without \
                    news it waits here for a person." }
        }
    }
}

/// The key's life, oldest first, from what its record keeps (no history
/// table: a takeover's time is not kept, only that there were some); each
/// event with whether its time is known (shown) or only its place.
fn timeline(key: &KeyView, now: DateTime<Utc>) -> Vec<(DateTime<Utc>, bool, Markup)> {
    let mut events: Vec<(DateTime<Utc>, bool, Markup)> =
        vec![(key.created_at, true, html! { "reserved (attempt 1)" })];
    if key.attempt > 1 {
        events.push((
            key.lease_expires_at.unwrap_or(key.created_at).min(now),
            true,
            html! {
                "taken over: now attempt " (key.attempt) " (" (key.attempt - 1)
                @if key.attempt == 2 { " takeover" } @else { " takeovers" }
                "; the last one's time is not kept, its lease is the current one)"
            },
        ));
    }
    if let Some(recovery) = &key.recovery {
        // A recovery point keeps no time of its own: placed after the
        // reservation, before what follows.
        events.push((
            key.created_at,
            true,
            html! { "recovery point recorded: " code { (recovery.recovery_point) } },
        ));
    }
    if let Some(mark) = &key.marked_unknown {
        events.push((
            mark.at,
            true,
            html! { "marked unknown by its holder: " q { (mark.reason) } },
        ));
    }
    if let Some(end) = key.lease_expires_at
        && end <= now
        && key.completed_at.is_none()
    {
        events.push((
            end,
            true,
            html! { "lease ended without news from its holder" },
        ));
    } else if let Some(r) = &key.resolution
        && key.marked_unknown.is_none()
    {
        // Settled by an operator and never marked unknown: it waited for
        // one because its lease ended without news. The record keeps no
        // lease once settled, so that end has no time of its own: placed
        // just before the settlement.
        events.push((
            r.at,
            false,
            html! { "lease ended without news from its holder (before it was settled; the time is not kept)" },
        ));
    }
    if let Some(done) = key.completed_at
        && key.resolution.is_none()
    {
        events.push((
            done,
            true,
            html! { "completed by its holder" @if let Some(s) = key.status { " (" (s) ")" } },
        ));
    }
    if let Some(r) = &key.resolution {
        events.push((
            r.at,
            true,
            html! {
                @if r.action.as_str() == "release" { "released" } @else { "completed" }
                " by " strong { (r.by) } ": " q { (r.reason) }
            },
        ));
    }
    events.sort_by_key(|(at, _, _)| *at);
    events
}

/// What the key was for: its request's method and path, or a note that the
/// door did not say; and beside it the caller's label, where it gave one.
fn request_line(key: &KeyView) -> Markup {
    html! {
        @match &key.request {
            Some(r) => code { (r.method) " " (r.path) },
            None if key.label.is_some() => {},
            None => {
                span.muted title="claimed through the reservation API without a request, or by an older release" { "not known" }
            }
        }
        @if let Some(label) = &key.label {
            span.caller-label title="the caller's label" { (label) }
        }
    }
}

/// A key the look-up box found: the page goes to it.
pub fn found(href: &str) -> Markup {
    html! { p { "Found: " a href=(href) { "open the key" } "." } }
}

fn state_badge(key: &KeyView, now: DateTime<Utc>) -> Markup {
    let (class, text) = match key.state {
        ShownState::InFlight if is_stuck(key, now) => {
            ("state state-stuck", "in flight past its lease")
        }
        ShownState::InFlight => ("state", "in flight"),
        ShownState::Completed => ("state state-completed", "completed"),
        ShownState::Unknown => ("state state-unknown", "unknown"),
        ShownState::Released => ("state state-released", "released"),
    };
    html! { span class=(class) { (text) } }
}

fn why(key: &KeyView, now: DateTime<Utc>) -> Markup {
    if let Some(mark) = &key.marked_unknown {
        return html! { "marked unknown: " (mark.reason) };
    }
    match key.lease_expires_at {
        Some(end) if end <= now && key.state != ShownState::Completed => {
            html! { "lease ended " (age(now - end)) " ago without news" }
        }
        _ => html! { span.muted { "—" } },
    }
}

fn lease_expiry(key: &KeyView) -> &'static str {
    match key.on_lease_expiry {
        LeaseExpiry::Takeover => "takeover: the next request runs it again",
        LeaseExpiry::Hold => "hold: unknown until settled",
    }
}

/// Stuck: unknown, or in flight past its lease — what an operator settles.
fn is_stuck(key: &KeyView, now: DateTime<Utc>) -> bool {
    match key.state {
        ShownState::Unknown => true,
        ShownState::InFlight => key.lease_expires_at.is_none_or(|end| end <= now),
        ShownState::Completed | ShownState::Released => false,
    }
}

fn key_href(key: &KeyView) -> String {
    format!(
        "/console/keys/{}/{}",
        segment(&key.tenant),
        segment(&key.key_hash)
    )
}

/// `text` as one path segment: everything but the unreserved characters
/// percent-encoded.
pub(super) fn segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The first 12 hex digits, as `keys list` shows a key hash.
fn prefix(key_hash: &str) -> &str {
    key_hash.get(..12).unwrap_or(key_hash)
}

fn iso(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Secs, true)
}

fn human(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// A time, and how far from now it is.
fn when(at: DateTime<Utc>, now: DateTime<Utc>) -> Markup {
    let rel = if at <= now {
        format!("{} ago", age(now - at))
    } else {
        format!("in {}", age(at - now))
    };
    html! { time datetime=(iso(at)) { (human(at)) } " " span.muted { "(" (rel) ")" } }
}

/// A duration as a person reads it: `42 s`, `3 min 10 s`, `2 h 5 min`,
/// `4 d 3 h`.
pub(super) fn age(d: chrono::TimeDelta) -> String {
    let s = d.num_seconds().max(0);
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        3600..86400 => format!("{} h {} min", s / 3600, (s % 3600) / 60),
        _ => format!("{} d {} h", s / 86400, (s % 86400) / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_a_person_says_them() {
        let secs = chrono::TimeDelta::seconds;
        assert_eq!(age(secs(-3)), "0 s");
        assert_eq!(age(secs(42)), "42 s");
        assert_eq!(age(secs(190)), "3 min 10 s");
        assert_eq!(age(secs(7500)), "2 h 5 min");
        assert_eq!(age(secs(4 * 86400 + 3 * 3600 + 5)), "4 d 3 h");
    }

    #[test]
    fn path_segments_keep_only_unreserved_characters() {
        assert_eq!(segment("acme.eu_1-~"), "acme.eu_1-~");
        assert_eq!(segment("a/b c?"), "a%2Fb%20c%3F");
        assert_eq!(segment("é"), "%C3%A9");
    }
}
