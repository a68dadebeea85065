//! A network namespace per proxy, with two links to the host: one for the
//! database, one for clients and the origin. Cutting the database link
//! partitions exactly that proxy from PostgreSQL while clients still reach
//! it and it still reaches the origin.
//!
//! Names carry the campaign's prefix and process id (`igc-<pid>-<i>`,
//! `igc<pid>d<i>`), so a rerun removes what a killed run left behind and
//! never what a live one is using. Addresses are `10.<o>.<2i>.0/24` (the
//! database link) and `10.<o>.<2i+1>.0/24` (the other), host `.1`, proxy
//! `.2`, with `<o>` chosen so that no address of the host is in `10.<o>/16`.

use std::net::Ipv4Addr;
use std::process::Command;

use anyhow::{Context as _, bail};

/// Every name this campaign gives starts with it.
pub const PREFIX: &str = "igc";

/// The namespaces and links of one run; removed on drop.
pub struct Net {
    pid: u32,
    octet: u8,
    count: usize,
}

impl Net {
    /// Whether namespaces can be made here; the reason if not.
    pub fn available() -> Result<(), String> {
        if !super::running_as_root() {
            return Err("not running as root, so no network namespaces".into());
        }
        let probe = format!("{PREFIX}-{}-probe", std::process::id());
        ip(&["netns", "add", &probe]).map_err(|e| format!("`ip netns add` failed: {e:#}"))?;
        let _ = ip(&["netns", "del", &probe]);
        Ok(())
    }

    /// Makes `count` namespaces with their two links each.
    pub fn setup(count: usize) -> anyhow::Result<Net> {
        let pid = std::process::id();
        let mut net = Net {
            pid,
            octet: free_octet()?,
            count: 0,
        };
        for i in 0..count {
            // Counted first: a half-made namespace is removed on drop too.
            net.count = i + 1;
            net.make(i)
                .with_context(|| format!("making network namespace {}", net.ns(i)))?;
        }
        Ok(net)
    }

    fn make(&self, i: usize) -> anyhow::Result<()> {
        let ns = self.ns(i);
        ip(&["netns", "add", &ns])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        for (link, inside, host, proxy) in [
            (self.db_link(i), "db", self.db_host(i), self.db_ns(i)),
            (self.app_link(i), "app", self.app_host(i), self.app_ns(i)),
        ] {
            let peer = format!("{link}p");
            ip(&[
                "link", "add", &link, "type", "veth", "peer", "name", &peer, "netns", &ns,
            ])?;
            ip(&["-n", &ns, "link", "set", &peer, "name", inside])?;
            ip(&["addr", "add", &format!("{host}/24"), "dev", &link])?;
            ip(&["link", "set", &link, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{proxy}/24"),
                "dev",
                inside,
            ])?;
            ip(&["-n", &ns, "link", "set", inside, "up"])?;
        }
        Ok(())
    }

    pub fn ns(&self, i: usize) -> String {
        format!("{PREFIX}-{}-{i}", self.pid)
    }

    /// The host's end of proxy `i`'s database link.
    pub fn db_link(&self, i: usize) -> String {
        format!("{}d{i}", self.link_prefix())
    }

    fn app_link(&self, i: usize) -> String {
        format!("{}a{i}", self.link_prefix())
    }

    /// Where PostgreSQL listens for proxy `i`.
    pub fn db_host(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.octet, (2 * i) as u8, 1)
    }

    fn db_ns(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.octet, (2 * i) as u8, 2)
    }

    /// Where proxy `i` reaches the origin.
    pub fn app_host(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.octet, (2 * i + 1) as u8, 1)
    }

    /// Where clients reach proxy `i`.
    pub fn app_ns(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.octet, (2 * i + 1) as u8, 2)
    }

    /// The subnet PostgreSQL trusts: every proxy's database link.
    pub fn subnet(&self) -> String {
        format!("10.{}.0.0/16", self.octet)
    }

    /// What the host's ends of the links are named after (`igc<pid>`), for
    /// the watchdog.
    pub fn link_prefix(&self) -> String {
        format!("{PREFIX}{}", self.pid)
    }

    /// The namespaces' names, for the watchdog.
    pub fn names(&self) -> Vec<String> {
        (0..self.count).map(|i| self.ns(i)).collect()
    }

    /// Cuts (`up` false) or heals proxy `i`'s database link. The host's end
    /// goes down: packets from the proxy are dropped silently, as in a real
    /// partition, rather than refused at once.
    pub async fn set_db_link(&self, i: usize, up: bool) -> anyhow::Result<()> {
        let state = if up { "up" } else { "down" };
        let out = tokio::process::Command::new("ip")
            .args(["link", "set", &self.db_link(i), state])
            .output()
            .await?;
        if !out.status.success() {
            bail!(
                "ip link set {state}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..self.count {
            remove_ns(&self.ns(i));
            let _ = ip(&["link", "del", &self.db_link(i)]);
            let _ = ip(&["link", "del", &self.app_link(i)]);
        }
    }
}

/// Removes the namespaces and links a campaign that is no longer running
/// left behind; returns their names.
pub fn sweep_leftovers() -> Vec<String> {
    let mut removed = Vec::new();
    let list = |args: &[&str]| {
        Command::new("ip")
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    for line in list(&["netns", "list"]).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(rest) = name.strip_prefix(&format!("{PREFIX}-")) else {
            continue;
        };
        if let Some(pid) = rest.split('-').next().and_then(|p| p.parse().ok())
            && !alive(pid)
        {
            remove_ns(name);
            removed.push(name.to_owned());
        }
    }
    for line in list(&["-o", "link", "show"]).lines() {
        // `7: igc1234d0@if6: <…>`
        let Some(name) = line.split(": ").nth(1).and_then(|n| n.split('@').next()) else {
            continue;
        };
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if let Ok(pid) = digits.parse()
            && !digits.is_empty()
            && !alive(pid)
        {
            let _ = ip(&["link", "del", name]);
            removed.push(name.to_owned());
        }
    }
    removed
}

/// Whether process `pid` is a running campaign.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .is_ok_and(|comm| comm.trim().starts_with("idemgate-campa"))
}

/// Kills what still runs in namespace `ns`, then removes it.
fn remove_ns(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
    let _ = ip(&["netns", "del", ns]);
}

/// A second octet no address of the host's falls under.
fn free_octet() -> anyhow::Result<u8> {
    let out = Command::new("ip")
        .args(["-o", "-4", "addr", "show"])
        .output()?;
    let taken = String::from_utf8_lossy(&out.stdout).into_owned();
    let start = std::process::id() % 100;
    (0..100)
        .map(|n| (100 + (start + n) % 100) as u8)
        .find(|o| !taken.contains(&format!(" 10.{o}.")))
        .context("no free 10.x.0.0/16 subnet for the namespaces")
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip(8)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
