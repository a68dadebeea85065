//! A default never contradicts a value the operator chose: each numeric setting
//! of `serve` and `proxy`, set alone to any value of its range with every other
//! setting at its default, starts — or is refused for its own value (a zero
//! that must be at least 1), named as it was set, never for a default. A
//! default that depends on another setting follows it (`IDEMGATE_DEFAULT_WAIT`
//! is `min(10, IDEMGATE_MAX_WAIT)`, docs/configuration.md); only two values the
//! operator set can be at odds, and then both are named.

use crate::common;

use std::time::Duration;

use common::bin::idemgate_at;
use common::proxy::ProxyProcess;
use common::upstream::Upstream;
use idemgate::server::cli::{self, CliError, Command};
use idemgate::server::config::{ConfigError, Sources};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// The commands whose settings are checked, and what each needs to start
/// but for the setting under test.
const COMMANDS: &[(&str, &[&str])] = &[
    ("serve", &[]),
    ("proxy", &["--upstream", "http://127.0.0.1:9"]),
];

/// Values across every range (durations in seconds, counts, sizes): the
/// ends, and each side of every default and bound the settings have.
const VALUES: &[u64] = &[
    0,
    1,
    2,
    4,
    5,
    6,
    9,
    10,
    11,
    16,
    29,
    30,
    31,
    34,
    35,
    36,
    59,
    60,
    61,
    74,
    75,
    76,
    255,
    256,
    299,
    300,
    301,
    3_599,
    3_600,
    3_601,
    4_096,
    86_399,
    86_400,
    86_401,
    604_799,
    604_800,
    604_801,
    1_048_576,
    u32::MAX as u64 - 1,
    u32::MAX as u64,
];

/// The numeric settings of `sub` (durations, counts, sizes): their flags.
fn numeric_settings(sub: &str) -> Vec<String> {
    let cmd = idemgate::server::config::command::built();
    cmd.find_subcommand(sub)
        .unwrap()
        .get_arguments()
        .filter(|arg| {
            arg.get_value_names()
                .unwrap_or_default()
                .iter()
                .any(|n| ["SECONDS", "N", "BYTES"].contains(&n.as_str()))
        })
        .filter_map(|arg| arg.get_long().map(|l| format!("--{l}")))
        .collect()
}

/// What `idemgate SUB BASE… FLAG VALUE` does with its settings, in process:
/// `Ok` if they validate; the refusal's line otherwise, and whether clap
/// refused the value alone (out of the setting's own range).
fn start(sub: &str, base: &[&str], flag: &str, value: u64) -> Result<(), (bool, String)> {
    let value = value.to_string();
    let argv = ["idemgate", sub]
        .iter()
        .copied()
        .chain(base.iter().copied())
        .chain([flag, value.as_str()])
        .map(Into::into)
        .collect();
    let (cli, sources) = match cli::parse(argv) {
        Ok(parsed) => parsed,
        Err(CliError::Config(line)) => return Err((true, line)),
        Err(other) => panic!("{sub} {flag} {value}: {other:?}"),
    };
    let refused = |e: ConfigError, sources: &Sources| (false, sources.render(&e));
    match cli.command {
        Command::Serve(args) => args.validate().map(drop).map_err(|e| refused(e, &sources)),
        Command::Proxy(args) => {
            args.validate().map_err(|e| refused(e, &sources))?;
            // What the proxy builds from them must not panic either.
            let policy = idemgate::server::proxy::layer_policy(&args, Vec::new());
            assert_eq!(
                policy.default_wait,
                Some(args.default_wait()).filter(|w| !w.is_zero())
            );
            let limits = args.limits();
            assert!(args.default_wait() <= limits.max_wait);
            Ok(())
        }
        _ => unreachable!(),
    }
}

/// The property: set alone, a value starts, or its refusal is about that
/// value (named as set: `--flag VALUE`), never about a default.
fn check(sub: &str, base: &[&str], flag: &str, value: u64) -> Result<(), String> {
    match start(sub, base, flag, value) {
        Ok(()) => Ok(()),
        Err((_, line)) if line.contains("the default") => Err(format!(
            "{sub} {flag} {value}: a default contradicts the value set: {line}"
        )),
        Err((_, line)) if !line.starts_with(&format!("{flag} {value}")) => Err(format!(
            "{sub} {flag} {value}: refused for something else than the value set: {line}"
        )),
        // Out of the setting's own range (clap's), or a zero that must be
        // at least 1: the one value a setting may refuse on its own.
        Err((true, _)) => Ok(()),
        Err((false, line)) if value == 0 => {
            assert!(line.contains("at least 1"), "{line}");
            Ok(())
        }
        Err((false, line)) => Err(format!(
            "{sub} {flag} {value}: refused on its own, though not zero: {line}"
        )),
    }
}

#[test]
fn the_numeric_settings_are_all_checked() {
    let serve = numeric_settings("serve");
    let proxy = numeric_settings("proxy");
    for want in ["--max-wait", "--max-lease", "--max-ttl", "--default-lease"] {
        assert!(serve.iter().any(|f| f == want), "{want}: {serve:?}");
    }
    for want in [
        "--default-wait",
        "--upstream-timeout",
        "--upstream-abandon-after",
        "--max-wait",
    ] {
        assert!(proxy.iter().any(|f| f == want), "{want}: {proxy:?}");
    }
}

#[test]
fn every_numeric_setting_set_alone_at_every_edge_starts() {
    let mut failures = Vec::new();
    for (sub, base) in COMMANDS {
        for flag in numeric_settings(sub) {
            for &value in VALUES {
                if let Err(e) = check(sub, base, &flag, value) {
                    failures.push(e);
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn any_numeric_setting_set_alone_to_any_value_starts() {
    let settings: Vec<(&str, &[&str], String)> = COMMANDS
        .iter()
        .flat_map(|(sub, base)| {
            numeric_settings(sub)
                .into_iter()
                .map(move |flag| (*sub, *base, flag))
        })
        .collect();
    let mut runner = TestRunner::new(Config {
        cases: 512,
        ..Config::default()
    });
    runner
        .run(
            &(0..settings.len(), 0..=u64::from(u32::MAX)),
            |(i, value)| {
                let (sub, base, flag) = &settings[i];
                check(sub, base, flag, value).map_err(TestCaseError::fail)
            },
        )
        .unwrap();
}

/// `idemgate SUB ARGS…` parsed and validated in process: its settings.
fn parsed(args: &[&str]) -> Command {
    let argv = std::iter::once("idemgate")
        .chain(args.iter().copied())
        .map(Into::into)
        .collect();
    let (cli, sources) = cli::parse(argv).unwrap_or_else(|e| panic!("{args:?}: {e:?}"));
    let checked = match &cli.command {
        Command::Serve(a) => a.validate().map(drop),
        Command::Proxy(a) => a.validate(),
        _ => Ok(()),
    };
    if let Err(e) = checked {
        panic!("{args:?} refused: {}", sources.render(&e));
    }
    cli.command
}

#[test]
fn a_default_follows_the_bound_the_operator_set() {
    let proxy = ["proxy", "--upstream", "http://127.0.0.1:9"];
    let with = |extra: &[&str]| {
        let mut all = proxy.to_vec();
        all.extend_from_slice(extra);
        match parsed(&all) {
            Command::Proxy(args) => args,
            _ => unreachable!(),
        }
    };
    assert_eq!(
        with(&["--max-wait", "5"]).default_wait(),
        Duration::from_secs(5)
    );
    assert_eq!(with(&["--max-wait", "0"]).default_wait(), Duration::ZERO);
    assert_eq!(with(&[]).default_wait(), Duration::from_secs(10));
    assert_eq!(
        with(&["--max-wait", "60"]).default_wait(),
        Duration::from_secs(10)
    );
    assert_eq!(
        with(&["--max-wait", "5", "--default-wait", "3"]).default_wait(),
        Duration::from_secs(3)
    );
    assert_eq!(
        with(&["--upstream-timeout", "600"]).abandon_after(),
        Duration::from_secs(600)
    );
    assert_eq!(with(&[]).abandon_after(), Duration::from_secs(300));
    let serve = |extra: &[&str]| {
        let mut all = vec!["serve"];
        all.extend_from_slice(extra);
        match parsed(&all) {
            Command::Serve(args) => args.policy.limits(),
            _ => unreachable!(),
        }
    };
    let limits = serve(&["--max-lease", "20", "--max-ttl", "3600"]);
    assert_eq!(limits.default_lease, Duration::from_secs(20));
    assert_eq!(limits.default_ttl, Duration::from_secs(3600));
    let limits = serve(&[]);
    assert_eq!(limits.default_lease, Duration::from_secs(30));
    assert_eq!(limits.default_ttl, Duration::from_secs(86_400));
}

#[test]
fn two_values_the_operator_set_at_odds_are_refused_naming_both() {
    for (args, want) in [
        (
            &[
                "proxy",
                "--upstream",
                "http://127.0.0.1:9",
                "--default-wait",
                "20",
                "--max-wait",
                "5",
            ][..],
            "--default-wait 20: 20 s is longer than the longest wait, --max-wait 5",
        ),
        (
            &[
                "proxy",
                "--upstream",
                "http://127.0.0.1:9",
                "--upstream-timeout",
                "60",
                "--upstream-abandon-after",
                "30",
            ],
            "--upstream-abandon-after 30: 30 s is shorter than --upstream-timeout 60",
        ),
        (
            &["serve", "--default-lease", "60", "--max-lease", "20"],
            "--default-lease 60: exceeds the longest lease a reservation may ask for, --max-lease 20",
        ),
        (
            &["serve", "--default-ttl", "7200", "--max-ttl", "3600"],
            "--default-ttl 7200: exceeds the longest TTL a reservation may ask for, --max-ttl 3600",
        ),
    ] {
        let argv = std::iter::once(&"idemgate")
            .chain(args)
            .map(Into::into)
            .collect();
        let (cli, sources) = cli::parse(argv).unwrap();
        let refused = match cli.command {
            Command::Serve(a) => a.validate().map(drop),
            Command::Proxy(a) => a.validate(),
            _ => unreachable!(),
        }
        .expect_err("at odds");
        let line = sources.render(&refused);
        assert!(line.contains(want), "{args:?}: {line}");
    }
}

/// The real binary: `IDEMGATE_MAX_WAIT=5 idemgate proxy` starts, publishes a
/// default wait of 5, and holds a duplicate of a key in flight that long
/// (then 409 request-in-flight), not the 10 s default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_with_max_wait_5_starts_and_waits_5() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("wait.db").display());
    let upstream = Upstream::start().await;
    let proxy = start_env(&url, &upstream.url(), &[("IDEMGATE_MAX_WAIT", "5")]).await;
    let http = common::http();
    let policy: serde_json::Value = http
        .get(format!("http://127.0.0.1:{}/v1/policy", proxy.admin))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(policy["default_wait_seconds"], 5, "{policy:#}");
    let key = uuid::Uuid::new_v4().to_string();
    let post = || {
        http.post(format!("{}/slow/8000", proxy.base()))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(r#"{"amount":5}"#)
            .send()
    };
    let first = tokio::spawn(post());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sent = std::time::Instant::now();
    let duplicate = post().await.unwrap();
    let held = sent.elapsed();
    assert_eq!(duplicate.status(), 409, "{:?}", duplicate.text().await);
    assert!(
        held >= Duration::from_millis(4_500) && held < Duration::from_millis(7_000),
        "held {held:?}, not the 5 s of IDEMGATE_MAX_WAIT"
    );
    assert_eq!(first.await.unwrap().unwrap().status(), 201);
}

/// `idemgate proxy` over `url` in front of `upstream` with `env` set.
async fn start_env(url: &str, upstream: &str, env: &[(&str, &str)]) -> ProxyProcess {
    let (port, admin) = (common::free_port(), common::free_port());
    let child = idemgate_at(url)
        .env_remove("IDEMGATE_UPSTREAM")
        .env_remove("IDEMGATE_ADMIN_LISTEN")
        .env_remove("IDEMGATE_DEFAULT_WAIT")
        .envs(env.iter().copied())
        .args(["proxy", "--upstream", upstream])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut process = ProxyProcess { child, port, admin };
    let ready = format!("http://127.0.0.1:{admin}/readyz");
    let started = std::time::Instant::now();
    loop {
        if let Ok(res) = reqwest::get(&ready).await
            && res.status() == 200
        {
            return process;
        }
        if let Ok(Some(status)) = process.child.try_wait() {
            panic!("idemgate proxy exited ({status}):\n{}", process.stderr());
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "idemgate proxy did not come up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
