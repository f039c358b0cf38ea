//! Reads from a real streaming replica (`scripts/setup-replica.sh`): recall, tool-output reads and
//! exports go there once it has replayed every acknowledged write; while it is behind (its replay
//! paused here), recall answers from it and says `degraded`, and tool outputs and exports come
//! from the primary; while it is stopped, the primary serves every read.
//!
//! One test, because pausing or stopping the replica affects every database on it.

use std::process::Command;
use std::time::Duration;

use mnemo_config::vars;
use mnemo_core::Principal;
use mnemo_testkit::{ScriptedEmbeddings, TestApp, binary, embed_like_the_provider, principal, token, wait_until};
use serde_json::json;
use sqlx::PgPool;

const MODEL: &str = "replica-test-model";
const DIMS: usize = 8;

struct Fixture {
    app: TestApp,
    _provider: ScriptedEmbeddings,
    replica_url: String,
    replica: PgPool,
}

impl Fixture {
    async fn start() -> Self {
        let provider = ScriptedEmbeddings::start(DIMS).await;
        let mut env = provider.env(MODEL);
        // Long enough for the replica to replay what the test that runs beside this one writes.
        env.push((vars::READ_REPLICA_WAIT_MS, "1000".to_owned()));
        // The test database is made just before the server starts: the replica URL names it.
        let app = TestApp::spawn_with_db(|db| {
            env.push((vars::READ_DATABASE_URL, db.replica_url()));
            env
        })
        .await;
        let replica_url = app.db.replica_url();
        // The replica connects lazily: wait until it has the new database before the first read,
        // so that read does not find the replica unreachable.
        let started = std::time::Instant::now();
        let replica = loop {
            match PgPool::connect(&replica_url).await {
                Ok(pool) => break pool,
                Err(e) if started.elapsed() > Duration::from_secs(20) => panic!("no test database on the replica: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        Self { app, _provider: provider, replica_url, replica }
    }

    async fn write(&self, who: &Principal, kind: &str, source_ref: &str, content: &str) {
        let body = json!({ "source_kind": kind, "source_ref": source_ref, "content": content });
        let reply = self.app.client.post("/v1/memories", Some(&token(who)), &body).await;
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        embed_like_the_provider(&self.app.db.store(), MODEL, DIMS).await;
    }

    /// Waits until the replica has replayed everything the primary has flushed: a loaded machine
    /// can lag past the API's wait, and this part of the test is about a replica that has not.
    async fn replayed(&self) {
        let flushed: i64 = sqlx::query_scalar("SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::bigint")
            .fetch_one(&self.app.db.pool)
            .await
            .expect("primary LSN");
        let replayed = wait_until(Duration::from_secs(20), || async {
            let at: Option<i64> = sqlx::query_scalar("SELECT (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::bigint")
                .fetch_one(&self.replica)
                .await
                .expect("replica LSN");
            at.is_some_and(|at| at >= flushed)
        })
        .await;
        assert!(replayed, "the replica replays the primary's writes");
    }

    /// The refs recall returns for `query`, and whether it said `degraded`.
    async fn recall(&self, who: &Principal, query: &str) -> (Vec<String>, bool) {
        let reply = self.app.client.post("/v1/recall", Some(&token(who)), &json!({ "query": query })).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let mut refs: Vec<String> = reply.body["items"]
            .as_array()
            .expect("items")
            .iter()
            .map(|i| i["source_ref"].as_str().expect("ref").to_owned())
            .collect();
        refs.sort();
        (refs, reply.body["degraded"].as_bool().expect("degraded"))
    }

    async fn tool_output_status(&self, who: &Principal, source_ref: &str) -> u16 {
        let key: String = sqlx::query_scalar("SELECT tool_output_key FROM memory_items WHERE source_ref = $1")
            .bind(source_ref)
            .fetch_one(&self.app.db.pool)
            .await
            .expect("key");
        self.app.client.get(&format!("/v1/tool-outputs/{key}"), Some(&token(who))).await.status
    }

    /// How many reads so far found the replica caught up, lagging, unreachable.
    async fn routes(&self) -> [u64; 3] {
        let text = self.app.client.get("/metrics", None).await.body;
        let text = text.as_str().map(str::to_owned).unwrap_or_else(|| text.to_string());
        ["caught_up", "lagging", "unreachable"].map(|state| {
            let series = format!("mnemo_replica_reads_total{{replica=\"{state}\"}} ");
            text.lines().find_map(|l| l.strip_prefix(&series)).map_or(0, |v| v.trim().parse().expect("count"))
        })
    }

    /// Runs `mnemo-runbook export` with the replica configured; its stderr.
    async fn export(&self, tenant: &str) -> String {
        let (succeeded, stderr) = self.export_from(tenant, &self.replica_url).await;
        assert!(succeeded, "{stderr}");
        stderr
    }

    /// Whether an export of `tenant` reading from `replica_url` succeeded, and its stderr.
    async fn export_from(&self, tenant: &str, replica_url: &str) -> (bool, String) {
        let output = tokio::process::Command::new(binary("mnemo-runbook").expect("mnemo-runbook is built"))
            .env_clear()
            .env(vars::DATABASE_URL, &self.app.db.url)
            .env(vars::READ_DATABASE_URL, replica_url)
            // Long enough for the replica to replay what the whole test suite writes meanwhile
            // (the lag it waits out is the cluster's), and paid in full only while it is paused.
            .env(vars::READ_REPLICA_WAIT_MS, "3000")
            .env("MNEMO_LOG", "warn")
            .args(["export", "--tenant", tenant])
            .stdout(std::process::Stdio::piped())
            .output()
            .await
            .expect("runbook runs");
        (output.status.success(), String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

/// Resumes the replica's replay when dropped, so a failing test leaves it streaming.
struct Paused(String);

impl Paused {
    async fn pause(replica: &PgPool, url: &str) -> Self {
        sqlx::query("SELECT pg_wal_replay_pause()").execute(replica).await.expect("pause replay");
        Paused(url.to_owned())
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = Command::new("psql").args(["-X", "-q", "-d", &self.0, "-c", "SELECT pg_wal_replay_resume()"]).status();
    }
}

/// `pg_ctlcluster <version> <cluster>` for the cluster listening on the replica's port, as root
/// or through sudo, as `scripts/faults.sh` restarts the primary.
fn replica_ctl(action: &str, port: u16) {
    let clusters = Command::new("pg_lsclusters").arg("-h").output().expect("pg_lsclusters");
    let clusters = String::from_utf8_lossy(&clusters.stdout);
    let (version, cluster) = clusters
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.get(2) == Some(&port.to_string().as_str()))
        .map(|f| (f[0].to_owned(), f[1].to_owned()))
        .expect("a cluster on the replica's port");
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    let mut command = if root { Command::new("pg_ctlcluster") } else { Command::new("sudo") };
    if !root {
        command.args(["-n", "pg_ctlcluster"]);
    }
    let status = command.args([version.as_str(), cluster.as_str(), action]).status().expect("pg_ctlcluster");
    assert!(status.success(), "pg_ctlcluster {action} failed");
}

/// Starts the replica again when dropped.
struct Stopped(u16);

impl Drop for Stopped {
    fn drop(&mut self) {
        replica_ctl("start", self.0);
    }
}

/// A tool output long enough to be kept whole behind a key.
fn long(head: &str) -> String {
    format!("{head} {}", "line of output ".repeat(4000))
}

fn port_of(url: &str) -> u16 {
    let authority = url.split("://").nth(1).expect("url").split(['/', '?']).next().expect("authority");
    authority.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port in the replica URL")
}

#[tokio::test]
async fn reads_go_to_the_replica_and_never_silently_miss_an_acknowledged_write() {
    let f = Fixture::start().await;
    let me = principal("acme", Some("ann"), None, Some("s1"));

    // Caught up: recall and tool outputs come from the replica.
    f.write(&me, "chat_message", "m1", "the deploy key rotates monthly").await;
    f.write(&me, "tool_output", "t1", &long("deploy key rotation log")).await;
    f.replayed().await;
    let before = f.routes().await;
    assert_eq!(f.recall(&me, "deploy key").await, (vec!["m1".to_owned(), "t1".to_owned()], false));
    assert_eq!(f.tool_output_status(&me, "t1").await, 200);
    let after = f.routes().await;
    assert_eq!([after[0] - before[0], after[1] - before[1], after[2] - before[2]], [2, 0, 0], "{after:?}");
    assert!(f.export("acme").await.contains("exporting from the replica"));
    // The replica as the API's role would export nothing: refused, as the primary is.
    let user_info =
        |url: &str| url.split("://").nth(1).and_then(|rest| rest.split('@').next()).expect("user").to_owned();
    let walled = f.replica_url.replacen(&user_info(&f.replica_url), &user_info(&f.app.db.app_url), 1);
    let (succeeded, stderr) = f.export_from("acme", &walled).await;
    assert!(!succeeded && stderr.contains("held by row-level security"), "{stderr}");

    // Behind: the replica has not replayed m2 and t2. Recall still reads it and says degraded; a
    // tool output, which cannot say so, comes from the primary, and so does an export.
    let paused = Paused::pause(&f.replica, &f.replica_url).await;
    f.write(&me, "chat_message", "m2", "the deploy key moved to the vault").await;
    f.write(&me, "tool_output", "t2", &long("deploy key audit trail")).await;
    let before = f.routes().await;
    assert_eq!(f.recall(&me, "deploy key").await, (vec!["m1".to_owned(), "t1".to_owned()], true));
    assert_eq!(f.tool_output_status(&me, "t2").await, 200, "read from the primary");
    let after = f.routes().await;
    assert_eq!([after[1] - before[1], after[0] - before[0]], [2, 0], "{after:?}");
    assert!(f.export("acme").await.contains("exporting from the primary"));
    // A row deleted on the primary leaves recall at once, though the replica still holds it live.
    let m1: uuid::Uuid = sqlx::query_scalar("SELECT id FROM memory_items WHERE source_ref = 'm1'")
        .fetch_one(&f.app.db.pool)
        .await
        .expect("m1");
    let deleted = f.app.client.delete(&format!("/v1/memories/{m1}"), Some(&token(&me))).await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    assert_eq!(f.recall(&me, "deploy key").await, (vec!["t1".to_owned()], true));

    drop(paused);
    let caught_up = wait_until(Duration::from_secs(10), || async {
        f.recall(&me, "deploy key").await == (vec!["m2".into(), "t1".into(), "t2".into()], false)
    })
    .await;
    assert!(caught_up, "once replay resumes, recall finds every row and is not degraded");

    // Stopped: the primary serves every read, without waiting long, and recall is complete.
    let port = port_of(&f.replica_url);
    replica_ctl("stop", port);
    let stopped = Stopped(port);
    f.write(&me, "chat_message", "m3", "the deploy key expired").await;
    let before = f.routes().await;
    let started = std::time::Instant::now();
    let everything: Vec<String> = ["m2", "m3", "t1", "t2"].map(String::from).into();
    assert_eq!(f.recall(&me, "deploy key").await, (everything.clone(), false));
    assert_eq!(f.tool_output_status(&me, "t2").await, 200);
    assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
    let after = f.routes().await;
    assert_eq!(after[2] - before[2], 2, "{after:?}");

    // Started again: once the skip interval has passed, reads return to the replica.
    drop(stopped);
    let back = wait_until(Duration::from_secs(30), || async {
        let before = f.routes().await[0];
        f.recall(&me, "deploy key").await == (everything.clone(), false) && f.routes().await[0] > before
    })
    .await;
    assert!(back, "reads return to the replica once it is up again");
}
