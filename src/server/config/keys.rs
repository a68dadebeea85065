//! The arguments of `idemgate keys list | show | resolve`, the operators'
//! work on stuck keys; what the commands do is `crate::server::keys`.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use secrecy::SecretString;

use super::{SealArgs, StoreArgs};

/// Keys a page holds when the operator names no limit: `keys list`'s
/// `--limit`, and the admin endpoint's `limit`, left out.
pub const DEFAULT_LIMIT: u32 = 100;

/// `idemgate keys`: see, and settle, the keys nobody will settle by
/// themselves.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// List keys, oldest first (`--state stuck`: the ones waiting for an
    /// operator).
    List(ListArgs),
    /// Show one key.
    Show(ShowArgs),
    /// Settle a stuck key: --release (nothing happened: the next request
    /// executes) or --complete with the response that really happened
    /// (every retry replays it), and a --reason.
    Resolve(ResolveArgs),
}

/// Where the keys are.
#[derive(Debug, Clone, Args)]
pub struct Database {
    #[command(flatten)]
    pub store: StoreArgs,

    #[command(flatten)]
    pub seal: SealArgs,

    /// Print JSON (the admin endpoints' shapes) instead of a table.
    #[arg(long)]
    pub json: bool,

    /// Ask a running idemgate instead of the database: the URL of `serve`'s
    /// listener (http://127.0.0.1:8080) or of the proxy's admin listener
    /// (http://127.0.0.1:9090), whose admin endpoints answer as this command
    /// does. The way to reach a SQLite file that a running process holds.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,

    /// With --server: an admin token of that server (one of its
    /// IDEMGATE_ADMIN_TOKENS); none where its admin endpoints are open
    /// (loopback, no tokens).
    #[arg(
        long,
        env = "IDEMGATE_ADMIN_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true
    )]
    pub token: Option<SecretString>,
}

/// `keys list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only keys in this state: stuck (waiting for a person: unknown, or in
    /// flight past their lease under either choice), unknown (marked so, or held past their
    /// lease), in_flight, or completed.
    #[arg(long, value_name = "stuck|unknown|in_flight|completed", value_parser = parse_state)]
    pub state: Option<ListState>,

    /// Only this tenant's keys, as stored.
    #[arg(long)]
    pub tenant: Option<String>,

    /// Only keys first reserved at least this many seconds ago.
    #[arg(long, value_name = "SECONDS")]
    pub older_than: Option<u64>,

    /// The most keys to print (1 to 1000) on one page.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_LIMIT)]
    pub limit: u32,

    /// Start after this cursor (the `next` of an earlier page).
    #[arg(long)]
    pub cursor: Option<String>,

    /// Every page, not just the first.
    #[arg(long)]
    pub all: bool,

    #[command(flatten)]
    pub db: Database,
}

/// Which key: `TENANT KEY_HASH`, or `TENANT --key KEY`, or
/// `--tenant-of VALUE --key KEY` for the proxy's tenants.
#[derive(Debug, Clone, Args)]
pub struct KeyRef {
    /// The key's tenant, as stored (the reservation API's tenant name; the
    /// proxy's is the hex SHA-256 of its tenant header, or `anonymous`).
    #[arg(value_name = "TENANT")]
    pub tenant: Option<String>,

    /// The lowercase hex SHA-256 of the key: all 64 digits, or a prefix of
    /// at least 8 that names one key (`keys list` shows 12).
    #[arg(value_name = "KEY_HASH", conflicts_with = "key")]
    pub key_hash: Option<String>,

    /// The raw key, hashed here (never stored or printed).
    #[arg(long, value_name = "KEY")]
    pub key: Option<String>,

    /// A key a model chose (an MCP tool call's idempotency_key argument),
    /// hashed here in the scope of the model's keys, as the MCP door does.
    #[arg(long, value_name = "KEY", conflicts_with_all = ["key", "key_hash"])]
    pub model_key: Option<String>,

    /// The proxy's tenant: the value its tenant header (Authorization by
    /// default) carried, hashed here as the proxy does.
    #[arg(long, value_name = "HEADER_VALUE", conflicts_with = "tenant")]
    pub tenant_of: Option<String>,
}

/// `keys show`.
#[derive(Debug, Args)]
pub struct ShowArgs {
    #[command(flatten)]
    pub key: KeyRef,

    #[command(flatten)]
    pub db: Database,
}

/// `keys resolve`.
#[derive(Debug, Args)]
#[group(id = "action", required = true, multiple = false, args = ["release", "complete"])]
pub struct ResolveArgs {
    #[command(flatten)]
    pub key: KeyRef,

    /// Nothing happened: forget the key, so that the next request with it
    /// executes.
    #[arg(long)]
    pub release: bool,

    /// This is what happened: store the response given by --status,
    /// --header and --body, which every retry then replays.
    #[arg(long)]
    pub complete: bool,

    /// Why (kept with the record and logged).
    #[arg(long, required = true)]
    pub reason: String,

    /// Who settles it (default: $USER).
    #[arg(long)]
    pub by: Option<String>,

    /// With --complete: the status of the response that happened.
    #[arg(long, value_name = "STATUS", requires = "complete")]
    pub status: Option<u16>,

    /// With --complete: a header line of it, `Name: value` (repeatable).
    #[arg(long, value_name = "NAME: VALUE", requires = "complete")]
    pub header: Vec<String>,

    /// With --complete: its body, as text.
    #[arg(
        long,
        value_name = "TEXT",
        requires = "complete",
        conflicts_with = "body_file"
    )]
    pub body: Option<String>,

    /// With --complete: its body, from a file.
    #[arg(long, value_name = "FILE", requires = "complete")]
    pub body_file: Option<PathBuf>,

    #[command(flatten)]
    pub db: Database,
}

/// Which keys `keys list --state` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListState {
    /// Waiting for a person: unknown, or in flight past the lease.
    Stuck,
    /// Unknown: marked so, or held past the lease.
    Unknown,
    /// In flight (not past a held lease).
    InFlight,
    /// Completed.
    Completed,
}

fn parse_state(s: &str) -> Result<ListState, String> {
    match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
        "stuck" => Ok(ListState::Stuck),
        "unknown" => Ok(ListState::Unknown),
        "in_flight" => Ok(ListState::InFlight),
        "completed" => Ok(ListState::Completed),
        _ => Err("expected stuck, unknown, in_flight or completed".into()),
    }
}
