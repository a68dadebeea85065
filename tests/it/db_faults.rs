//! A database that hangs rather than goes away (issue 6, scenario 3): a row
//! lock held by another session, or every connection busy. The statement and
//! acquire timeouts must turn both into a prompt `503 store-unavailable` with
//! `Retry-After`, never a hung client and never a 500, and the server must
//! work again as soon as the database does.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::app::{TestApp, fresh_key};
use common::pg::{TempCluster, TestDb};
use common::proxy::TestProxy;
use common::upstream::Upstream;
use idemgate::store::postgres::PgSettings;
use sha2::{Digest, Sha256};
use sqlx::Connection;

/// Another session that holds every row of `idempotency_keys` locked until
/// it is rolled back.
async fn lock_every_key(url: &str) -> sqlx::PgConnection {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut conn)
        .await
        .expect("begin");
    sqlx::query("SELECT 1 FROM idempotency_keys FOR UPDATE")
        .execute(&mut conn)
        .await
        .expect("lock the rows");
    conn
}

/// A key whose record takes the next claim (reserved, then released), so
/// that the claim must lock its row: a claim of a key whose record refuses
/// it reads the record without a lock and never waits on one.
async fn released_key(app: &TestApp) -> String {
    let key = fresh_key();
    let res = app.reserve(&key, "{}").await;
    assert_eq!(res.status, 201);
    let id = res.reservation_id();
    assert_eq!(app.act(&id, "release", "").await.status, 204);
    key
}

/// A request that hangs fails the test instead of hanging it.
async fn bounded<T>(request: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(15), request)
        .await
        .expect("the request hung: no timeout bounded it")
}

async fn release(mut conn: sqlx::PgConnection) {
    sqlx::query("ROLLBACK")
        .execute(&mut conn)
        .await
        .expect("rollback");
}

#[tokio::test]
async fn a_held_row_lock_gives_a_prompt_503_not_a_hung_client() {
    let db = TestDb::new().await;
    let settings = PgSettings {
        statement_timeout: Duration::from_secs(1),
        ..PgSettings::default()
    };
    let app = TestApp::with_settings(&db.url, &[], settings).await;
    let key = released_key(&app).await;

    let locker = lock_every_key(&db.url).await;
    let started = Instant::now();
    let res = bounded(app.reserve(&key, "{}")).await;
    let waited = started.elapsed();
    res.assert_problem(503, "store-unavailable");
    assert!(res.header("retry-after").parse::<u64>().is_ok(), "{res:#?}");
    assert!(
        waited < Duration::from_secs(5),
        "bounded by the statement timeout, not the lock: waited {waited:?}"
    );
    // Keys the lock does not touch are served meanwhile.
    assert_eq!(app.reserve(&fresh_key(), "{}").await.status, 201);

    release(locker).await;
    // The database answers again: so does the server, with the true state.
    assert_eq!(app.reserve(&key, "{}").await.status, 201);
    app.reserve(&key, "{}")
        .await
        .assert_problem(409, "request-in-flight");
}

#[tokio::test]
async fn every_connection_busy_gives_a_503_after_the_acquire_timeout() {
    let db = TestDb::new().await;
    let settings = PgSettings {
        max_connections: 1,
        acquire_timeout: Duration::from_secs(1),
        statement_timeout: Duration::from_secs(4),
        ..PgSettings::default()
    };
    let app = Arc::new(TestApp::with_settings(&db.url, &[], settings).await);
    let key = released_key(&app).await;

    let locker = lock_every_key(&db.url).await;
    // The one connection waits on the lock…
    let stuck = {
        let app = app.clone();
        let key = key.clone();
        tokio::spawn(async move { bounded(app.reserve(&key, "{}")).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // …so another request waits for a connection, and gives up in time.
    let started = Instant::now();
    let res = bounded(app.reserve(&fresh_key(), "{}")).await;
    let waited = started.elapsed();
    res.assert_problem(503, "store-unavailable");
    assert!(
        waited >= Duration::from_millis(800) && waited < Duration::from_secs(3),
        "bounded by the acquire timeout: waited {waited:?}"
    );
    // The stuck one ends at its statement timeout, also a 503.
    stuck
        .await
        .unwrap()
        .assert_problem(503, "store-unavailable");

    release(locker).await;
    assert_eq!(app.reserve(&fresh_key(), "{}").await.status, 201);
}

/// A TCP relay to the database that can go silent, as a network that drops
/// packets or a frozen host would: while `silent` is set it passes nothing on
/// in either direction, and what it read waits until it speaks again.
struct Relay {
    url: String,
    silent: Arc<AtomicBool>,
}

impl Relay {
    async fn to(db_url: &str) -> Relay {
        let mut url = reqwest::Url::parse(db_url).expect("a database URL");
        let target = format!(
            "{}:{}",
            url.host_str().unwrap_or("127.0.0.1"),
            url.port().unwrap_or(5432)
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        url.set_host(Some("127.0.0.1")).unwrap();
        url.set_port(Some(port)).unwrap();
        let silent = Arc::new(AtomicBool::new(false));
        let flag = silent.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let (client_rx, client_tx) = client.into_split();
                let (server_rx, server_tx) = server.into_split();
                tokio::spawn(Relay::pass(client_rx, server_tx, flag.clone()));
                tokio::spawn(Relay::pass(server_rx, client_tx, flag.clone()));
            }
        });
        Relay {
            url: url.to_string(),
            silent,
        }
    }

    async fn pass(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        silent: Arc<AtomicBool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0; 64 * 1024];
        loop {
            let Ok(n @ 1..) = from.read(&mut buf).await else {
                return;
            };
            while silent.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }
}

/// A database that stops answering without closing anything (the statement
/// timeout cannot help: it is the database's own): the store's own deadline
/// per statement gives a 503 within the statement timeout plus its margin,
/// and the server works again as soon as the database answers.
#[tokio::test]
async fn a_silent_database_gives_a_prompt_503_not_a_hung_client() {
    let db = TestDb::new().await;
    let relay = Relay::to(&db.url).await;
    let settings = PgSettings {
        statement_timeout: Duration::from_secs(1),
        acquire_timeout: Duration::from_secs(1),
        ..PgSettings::default()
    };
    let app = TestApp::with_settings(&relay.url, &[], settings).await;
    let key = fresh_key();
    assert_eq!(app.reserve(&key, "{}").await.status, 201);

    relay.silent.store(true, Ordering::Relaxed);
    for _ in 0..3 {
        let started = Instant::now();
        let res = bounded(app.reserve(&fresh_key(), "{}")).await;
        let waited = started.elapsed();
        res.assert_problem(503, "store-unavailable");
        eprintln!("silent database: 503 after {waited:?}");
        assert!(
            waited < Duration::from_secs(5),
            "bounded by the statement timeout and its margin: waited {waited:?}"
        );
    }

    relay.silent.store(false, Ordering::Relaxed);
    let started = Instant::now();
    loop {
        let res = bounded(app.reserve(&key, "{}")).await;
        if res.status == 409 {
            break;
        }
        res.assert_problem(503, "store-unavailable");
        assert!(started.elapsed() < Duration::from_secs(5), "no recovery");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a worker saw while the database misbehaved.
#[derive(Default)]
struct Tally {
    /// Keys whose commit was answered 200: they must survive anything.
    acknowledged: Vec<String>,
    /// 503 store-unavailable answers.
    unavailable: usize,
    /// Anything else (a 500, a lost reservation's 404, …): must stay empty.
    unexpected: Vec<(u16, String)>,
}

/// Reserve + commit of fresh keys until `stop`, each commit's body naming
/// its key.
async fn load(app: Arc<TestApp>, stop: Arc<AtomicBool>) -> Tally {
    let mut tally = Tally::default();
    while !stop.load(Ordering::Relaxed) {
        let key = fresh_key();
        let res = app.reserve(&key, "").await;
        match res.status.as_u16() {
            201 => {}
            503 => {
                tally.unavailable += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            other => {
                tally
                    .unexpected
                    .push((other, format!("reserve: {:?}", res.body)));
                continue;
            }
        }
        let id = res.reservation_id();
        let body = format!(r#"{{"status":201,"body":"stored {key}"}}"#);
        let done = app.act(&id, "commit", &body).await;
        match done.status.as_u16() {
            200 => tally.acknowledged.push(key),
            // Maybe stored, maybe not: nobody was told it was.
            503 => tally.unavailable += 1,
            other => tally
                .unexpected
                .push((other, format!("commit: {:?}", done.body))),
        }
    }
    tally
}

/// Runs `fault` against `cluster` while sixteen clients reserve and commit
/// (so that claims and commits are written in batches of several: the fault
/// lands in the middle of batches),
/// then checks: no answer but 2xx and 503, recovery within 5 s of the fault's
/// end, and every commit answered 200 replayed from the database afterwards
/// (the replay cache is off, so the replay is read from the database).
async fn under_load<F, Fut>(cluster: &TempCluster, fault: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let settings = PgSettings {
        acquire_timeout: Duration::from_secs(1),
        ..PgSettings::default()
    };
    let app = Arc::new(
        TestApp::with_settings(&cluster.url(), &["--replay-cache-bytes", "0"], settings).await,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..16)
        .map(|_| tokio::spawn(load(app.clone(), stop.clone())))
        .collect();
    tokio::time::sleep(Duration::from_millis(800)).await;
    fault().await;
    let back = Instant::now();
    let recovered = loop {
        if bounded(app.reserve(&fresh_key(), "")).await.status == 201 {
            break back.elapsed();
        }
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "not recovered within 5 s of the fault's end"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(Duration::from_millis(800)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Tally::default();
    for w in workers {
        let t = bounded(w).await.expect("worker");
        all.acknowledged.extend(t.acknowledged);
        all.unavailable += t.unavailable;
        all.unexpected.extend(t.unexpected);
    }
    assert!(
        all.unexpected.is_empty(),
        "answers other than 2xx and 503: {:?}",
        all.unexpected
    );
    assert!(!all.acknowledged.is_empty(), "the load made no progress");
    // Every acknowledged commit is in the database with its response…
    let hashes: Vec<Vec<u8>> = all
        .acknowledged
        .iter()
        .map(|k| Sha256::digest(k.as_bytes()).to_vec())
        .collect();
    let bodies: Vec<Vec<u8>> = all
        .acknowledged
        .iter()
        .map(|k| format!("stored {k}").into_bytes())
        .collect();
    let mut conn = sqlx::PgConnection::connect(&cluster.url())
        .await
        .expect("connect");
    let found: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM unnest($1::bytea[], $2::bytea[]) AS a(key_hash, body)
           JOIN idempotency_keys k ON k.tenant = 'default' AND k.key_hash = a.key_hash
          WHERE k.state = 'completed' AND k.response_body = a.body",
    )
    .bind(&hashes)
    .bind(&bodies)
    .fetch_one(&mut conn)
    .await
    .expect("count");
    assert_eq!(
        usize::try_from(found).unwrap(),
        all.acknowledged.len(),
        "acknowledged commits were lost"
    );
    // …and replays through the API (a sample; the cache is off).
    for key in all
        .acknowledged
        .iter()
        .step_by(all.acknowledged.len() / 20 + 1)
    {
        let replay = app.reserve(key, "").await;
        assert_eq!(
            replay.status, 200,
            "an acknowledged commit was lost: {replay:#?}"
        );
        assert_eq!(replay.body["response"]["body"], format!("stored {key}"));
    }
    let batches = app.state.engine.batch_stats();
    assert!(
        batches.largest >= 2,
        "sixteen clients and no batch of two writes: {batches:?}"
    );
    println!(
        "{} commits acknowledged and all found after the fault; {} answers 503; recovered \
         {recovered:?} after it; {batches:?}",
        all.acknowledged.len(),
        all.unavailable
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_under_load_loses_no_acknowledged_commit() {
    let cluster = TempCluster::start().await.expect("a private PostgreSQL");
    under_load(&cluster, || async {
        cluster.stop().await.expect("stop");
        tokio::time::sleep(Duration::from_millis(500)).await;
        cluster.restart().await.expect("restart");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_connections_under_load_lose_no_acknowledged_commit() {
    let cluster = TempCluster::start().await.expect("a private PostgreSQL");
    let url = cluster.url();
    under_load(&cluster, || async move {
        let mut admin = sqlx::PgConnection::connect(&url).await.expect("connect");
        for _ in 0..3 {
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                  WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .execute(&mut admin)
            .await
            .expect("terminate");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_under_a_restart_forwards_nothing_it_could_not_record() {
    let cluster = TempCluster::start().await.expect("a private PostgreSQL");
    let upstream = Upstream::start().await;
    let proxy = Arc::new(
        TestProxy::start(
            &cluster.url(),
            &upstream.url(),
            &["--db-acquire-timeout", "1", "--replay-cache-bytes", "0"],
            vec![],
        )
        .await,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let (proxy, stop) = (proxy.clone(), stop.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let key = fresh_key();
                    let res = proxy.post("/ok", &key, r#"{"amount":1}"#).await;
                    if res.status == 503 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    answers.push((key, res.status.as_u16()));
                }
                answers
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.stop().await.expect("stop");
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.restart().await.expect("restart");
    let back = Instant::now();
    while !bounded(proxy.post("/ok", &fresh_key(), "{}"))
        .await
        .status
        .is_success()
    {
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "not recovered within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut answers = Vec::new();
    for w in workers {
        answers.extend(bounded(w).await.expect("worker"));
    }
    let (mut forwarded, mut refused) = (Vec::new(), 0usize);
    for (key, status) in answers {
        match status {
            // Refused: the key could not be recorded, so it went nowhere.
            503 => {
                assert_eq!(
                    upstream.started(&key),
                    0,
                    "forwarded a request it could not record"
                );
                refused += 1;
            }
            s if (200..300).contains(&s) => {
                assert_eq!(upstream.started(&key), 1, "executed {s} more than once");
                forwarded.push(key);
            }
            other => panic!("answered {other}: only the origin's answer or 503 may come back"),
        }
    }
    assert!(
        refused > 0,
        "the outage was not felt: the test proves nothing"
    );
    // Every forwarded request's response is (or becomes, once a commit
    // deferred by the outage lands) the replay: nothing runs twice.
    for key in &forwarded {
        let res = proxy
            .send(
                "POST",
                "/ok",
                &[
                    ("idempotency-key", key.as_str()),
                    ("content-type", "application/json"),
                    ("prefer", "wait=10"),
                ],
                Some(r#"{"amount":1}"#),
            )
            .await;
        assert!(
            res.status.is_success(),
            "retry of a forwarded key: {res:#?}"
        );
        assert_eq!(res.headers["idempotent-replayed"], "true");
        assert_eq!(upstream.started(key), 1, "a retry ran the request again");
    }
    println!(
        "{} requests forwarded and replayed after the restart, {refused} refused with 503 and never forwarded",
        forwarded.len()
    );
}

/// A commit retried in the background and a shutdown together (docs/proxy.md):
/// the origin answered while the store was away, so the proxy returned the
/// response and retries its commit in the background; a SIGTERM then must not
/// drop that commit. The process waits (within its grace) for the store to come
/// back, stores the response, and exits 0; a retry afterwards is the replay,
/// not a second execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_waits_for_commits_deferred_by_an_outage() {
    use common::bin::{drain_stderr, free_port, idemgate_at, signal, wait_exit};

    let cluster = TempCluster::start().await.expect("a private PostgreSQL");
    let upstream = Upstream::start().await;
    let (port, admin) = (free_port(), free_port());
    let mut child = idemgate_at(&cluster.url())
        .args(["proxy", "--upstream", &upstream.url()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(["--shutdown-grace", "15", "--db-acquire-timeout", "1"])
        .args(["--replay-cache-bytes", "0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("idemgate proxy");
    let log = drain_stderr(&mut child);
    let http = common::http();
    let ready = format!("http://127.0.0.1:{admin}/readyz");
    let started = Instant::now();
    while !http
        .get(&ready)
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
    {
        assert!(started.elapsed() < Duration::from_secs(20), "never ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The origin takes 1.5 s; the store goes away meanwhile.
    let key = fresh_key();
    let request = {
        let (http, key) = (http.clone(), key.clone());
        tokio::spawn(async move {
            http.post(format!("http://127.0.0.1:{port}/slow/1500"))
                .header("idempotency-key", key)
                .body("{}")
                .send()
                .await
                .expect("the proxy answers")
        })
    };
    while upstream.started(&key) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "never forwarded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cluster.stop().await.expect("stop");
    let res = bounded(request).await.expect("request task");
    assert_eq!(res.status(), 201, "the origin's answer reaches the client");

    // Stop the proxy while its commit waits; bring the store back later.
    signal(child.id(), "TERM");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        child.try_wait().expect("try_wait").is_none(),
        "exited with a commit still deferred:\n{}",
        log.lock().unwrap()
    );
    cluster.restart().await.expect("restart");
    let back = Instant::now();
    let status = wait_exit(&mut child, Duration::from_secs(15))
        .await
        .expect("exits once the commit lands");
    let took = back.elapsed();
    assert!(status.success(), "exit {status}:\n{}", log.lock().unwrap());

    let mut conn = sqlx::PgConnection::connect(&cluster.url())
        .await
        .expect("connect");
    let state: String = sqlx::query_scalar("SELECT state FROM idempotency_keys")
        .fetch_one(&mut conn)
        .await
        .expect("one key");
    assert_eq!(
        state, "completed",
        "the deferred commit was lost at shutdown"
    );
    eprintln!("the deferred commit landed and the proxy exited {took:?} after the store came back");

    // Another process replays it; the origin ran once.
    let proxy = TestProxy::start(&cluster.url(), &upstream.url(), &[], vec![]).await;
    let replay = proxy
        .send(
            "POST",
            "/slow/1500",
            &[("idempotency-key", key.as_str())],
            Some("{}"),
        )
        .await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), "true");
    assert_eq!(upstream.started(&key), 1);
    let logs = log.lock().unwrap().clone();
    assert!(
        logs.contains("commits deferred while the store was away"),
        "the wait is logged:\n{logs}"
    );
    assert!(!logs.contains(&key), "a raw key in the log");
}
