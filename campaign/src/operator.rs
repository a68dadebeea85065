//! The operator's phase, after the final listing: each key left unknown is
//! settled with `idemgate keys resolve` as a person would settle it — with
//! the origin's own answer if the origin acted, released if it never did —
//! and then asked for once more, to show the settlement is what every retry
//! gets from then on.

use std::time::Duration;

use anyhow::Context as _;

use crate::checker::{Listing, key_hash};
use crate::clients::{self, key_name};
use crate::cluster::Cluster;
use crate::history::{Event, Recorder, Resolve};
use crate::origin::Origin;

/// Settles every key of `unknown`, then sends one more request for each
/// through proxy 0; the proxies are stopped before and after.
pub async fn settle(
    cluster: &Cluster,
    origin: &Origin,
    rec: &Recorder,
    unknown: &Listing,
    seed: u64,
    keys: usize,
) -> anyhow::Result<usize> {
    let names: std::collections::HashMap<String, String> = (0..keys)
        .map(|i| {
            let key = key_name(seed, i);
            (key_hash(&key), key)
        })
        .collect();
    let mut settled = Vec::new();
    for listed in &unknown.keys {
        let key = names
            .get(&listed.key_hash)
            .with_context(|| format!("unknown key {} is none of ours", listed.key_hash))?;
        let acted = origin.executions(key).into_iter().find(|e| e.acted);
        let mut args = vec![
            "resolve".to_owned(),
            listed.tenant.clone(),
            listed.key_hash.clone(),
            "--json".to_owned(),
        ];
        let (action, status, body) = match &acted {
            Some(e) => {
                args.extend(
                    [
                        "--complete",
                        "--status",
                        &e.status.to_string(),
                        "--header",
                        "Content-Type: application/json",
                        "--body",
                        &e.body,
                        "--reason",
                        &format!("the origin acted: execution #{}", e.seq),
                    ]
                    .map(str::to_owned),
                );
                ("complete", Some(e.status), Some(e.body.clone()))
            }
            None => {
                args.extend(["--release", "--reason", "the origin never acted"].map(str::to_owned));
                ("release", None, None)
            }
        };
        let at = rec.now();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, output) = match cluster.keys(&args).await {
            Ok(out) => (true, out),
            Err(e) => (false, format!("{e:#}")),
        };
        rec.record(&Event::Resolve(Resolve {
            key: key.clone(),
            action: action.into(),
            status,
            body,
            ok,
            output,
            at,
        }));
        settled.push(key.clone());
    }
    if settled.is_empty() {
        return Ok(0);
    }

    cluster.proxies.spawn(0).await?;
    cluster
        .proxies
        .wait_ready(0, Duration::from_secs(60))
        .await?;
    let http = reqwest::Client::new();
    let base = vec![cluster.proxies.base(0)];
    for key in &settled {
        let i = clients::key_number(key).context("a key of ours has its number")?;
        // A few tries, for a proxy that is just up; the checker reads the
        // last.
        for try_no in 1..=5 {
            let attempt = clients::Attempt {
                key,
                number: i,
                client: "operator",
                proxy: 0,
                try_no,
                no_wait: false,
            };
            let r = clients::send(&http, &base, &attempt, Duration::from_secs(10), rec).await;
            let again = matches!(r.status, None | Some(502..=504));
            rec.record(&Event::Request(r));
            if !again {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    cluster.proxies.stop_all(Duration::from_secs(15)).await;
    Ok(settled.len())
}
