//! The fault suite: a fault injected again and again under a steady write and recall load, then
//! the checks. The API is the real `mnemo-server` binary and each worker the real `mnemo-worker`
//! (built beside this one), with the local model. Faults:
//! - `worker-kill`: the worker killed with SIGKILL every few seconds, and started again;
//! - `postgres-restart`: PostgreSQL restarted by `--restart-command` (fast or immediate
//!   shutdown); while it is down the API must answer with an error code, never hang past its
//!   timeout, and recover by itself. A worker that exits is started again, as a supervisor would,
//!   and counted;
//! - `embedder-outage`: the embedding endpoint (the testkit's scripted OpenAI-compatible server,
//!   for the API's queries and the worker's rows) answers 500, hangs past the client's timeout,
//!   answers malformed JSON or vectors of the wrong dimension for `--outage` seconds, one after
//!   the other, then recovers; recall must answer (degraded) throughout, writes must not notice,
//!   and the backlog must drain with no row given up;
//! - `chat-outage`: the judge's chat endpoint (the testkit's scripted one) answers 500, hangs
//!   past the judge's timeout, answers malformed JSON or decisions for facts it was never shown,
//!   for `--outage` seconds each. Every fact judged meanwhile must fail open (nothing retired);
//!   afterwards the runbook's re-judge (`mnemo-runbook judge clear --outcome fail_open`) must
//!   judge them all, as an operator would;
//! - `disk-full`: the bench database lives in `--tablespace`, on a small filesystem of its own
//!   (`scripts/faults.sh` mounts one), and a ballast file fills that filesystem for `--outage`
//!   seconds, then is removed. Writes must fail with `507 storage_full` meanwhile, never hang or
//!   lose an acknowledged row, and everything must resume by itself once space returns;
//! - `soak`: no fault, the load alone for `--kills` windows of `--every` seconds; at the end of
//!   each, the server's and the worker's resident memory, the jobs waiting and the window's p99.
//!   Memory must stay flat, the queues bounded and p99 stable.
//!
//! One write in five is a fact of one of many users, each saying where the user lives, so every
//! new fact of a user contradicts the older ones and the workers' judge (the scripted endpoint,
//! which supersedes a fact starting with the same three words) retires them.
//!
//! Afterwards, with one worker left to drain the backlog: no acknowledged write is lost, every
//! row has its vector of the model, the embed and judge queues settle with no job dead, every
//! fact is judged with none left failed open, no fact is superseded twice or by an older fact,
//! the supersede audit rows match the rows, each user is left with one live fact, and no request
//! failed except, under `postgres-restart`, with a 503 and its code, or under `disk-full` with a
//! 507 and its code.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::ValueEnum;
use hdrhistogram::Histogram;
use mnemo_config::{DatabaseSettings, Env, ServerSettings, vars};
use mnemo_core::{Principal, Queue, SessionId, TenantId, UserId};
use mnemo_store::queue::JudgeJob;
use mnemo_store::{Delivery, Store, move_database};
use mnemo_testkit::{Answer, ChatAnswer, ScriptedChat, ScriptedEmbeddings};
use serde_json::json;
use uuid::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Fault {
    WorkerKill,
    PostgresRestart,
    EmbedderOutage,
    ChatOutage,
    DiskFull,
    /// No fault: the load alone, for `--kills` windows of `--every` seconds each.
    Soak,
}

/// What the embedding endpoint does during each `embedder-outage`, in turn.
fn outage_answer(n: u32) -> (&'static str, Answer) {
    match n % 4 {
        0 => ("500", Answer::Status(500)),
        1 => ("hang", Answer::Hang(Duration::from_secs(30))),
        2 => ("malformed JSON", Answer::Malformed),
        _ => ("wrong dimension", Answer::WrongDimension),
    }
}

/// How a write refused for want of disk space is recorded.
const STORAGE_FULL: &str = "507 storage_full";

/// The embedding client's timeout under `embedder-outage`, so a hang costs a request this long.
const OUTAGE_EMBED_TIMEOUT_MS: &str = "2000";

/// What the judge's chat endpoint does during each `chat-outage`, in turn.
fn chat_outage_answer(n: u32) -> (&'static str, ChatAnswer) {
    match n % 4 {
        0 => ("500", ChatAnswer::Status(500)),
        1 => ("hang", ChatAnswer::Hang(Duration::from_secs(30))),
        2 => ("malformed JSON", ChatAnswer::Malformed),
        _ => ("decisions for facts it was never shown", ChatAnswer::InventedIds),
    }
}

/// The judge's model timeout in every fault, so a hang costs a call this long.
const JUDGE_TIMEOUT: Duration = Duration::from_secs(2);

/// The users whose facts contradict each other. With one write in five a fact, each user gets a
/// new fact every 500 writes: the first 100 facts have nothing to contradict, and after that each
/// user gets a few per minute-long outage at the default rate, fewer than the judge's top-k
/// candidates, so one re-judge retires them all.
const RESIDENTS: u64 = 100;
const CITIES: [&str; 12] =
    ["Lyon", "Porto", "Oslo", "Kyoto", "Lima", "Cairo", "Quito", "Perth", "Riga", "Hanoi", "Dakar", "Tunis"];

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long, value_enum, default_value_t = Fault::WorkerKill)]
    fault: Fault,
    /// How many times the fault is injected.
    #[arg(long, default_value_t = 50)]
    kills: u32,
    /// Seconds between the system answering again and the next fault.
    #[arg(long, default_value_t = 3.0)]
    every: f64,
    /// For `postgres-restart`: the shell command that restarts the cluster
    /// (`scripts/faults.sh` passes `pg_ctlcluster <version> <cluster> restart -m fast|immediate`).
    #[arg(long)]
    restart_command: Option<String>,
    /// For `disk-full`: the tablespace the bench database moves into, on a filesystem of its own.
    #[arg(long)]
    tablespace: Option<String>,
    /// For `disk-full`: the file that fills the tablespace's filesystem (on that filesystem).
    #[arg(long)]
    ballast: Option<PathBuf>,
    /// For `embedder-outage`, `chat-outage` and `disk-full`: how long each outage lasts, in
    /// seconds.
    #[arg(long, default_value_t = 60)]
    outage: u64,
    /// Writes per second, spread over the writers (keep it under the embedder's rate, or the
    /// backlog only grows).
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Recalls per second from one client.
    #[arg(long, default_value_t = 5.0)]
    recall_rate: f64,
    /// Seconds the last worker has to drain the backlog.
    #[arg(long, default_value_t = 300)]
    drain_limit: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// A steady load's outcome: the latency of every answer, successes, and failures by what they
/// were (`503 not_ready`, `no answer`, …).
#[derive(Debug)]
struct Load {
    latencies: Histogram<u64>,
    ok: u64,
    failures: BTreeMap<String, u64>,
}

impl Load {
    fn new() -> anyhow::Result<Self> {
        Ok(Self { latencies: Histogram::new(3)?, ok: 0, failures: BTreeMap::new() })
    }

    /// Sends a request and records its outcome in `load`; the answer's body on the expected
    /// status.
    async fn send(
        load: &Mutex<Load>,
        request: reqwest::RequestBuilder,
        expected: u16,
    ) -> anyhow::Result<Option<serde_json::Value>> {
        let started = Instant::now();
        let outcome = match request.send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                let body: serde_json::Value = r.json().await.unwrap_or_default();
                if status == expected {
                    Ok(body)
                } else {
                    Err(format!("{status} {}", body["error"]["code"].as_str().unwrap_or("without a code")))
                }
            }
            Err(e) if e.is_timeout() => Err("no answer within 30 s".to_owned()),
            Err(_) => Err("connection failed".to_owned()),
        };
        let mut load = load.lock().expect("load");
        load.latencies.record(started.elapsed().as_micros() as u64)?;
        Ok(match outcome {
            Ok(body) => {
                load.ok += 1;
                Some(body)
            }
            Err(kind) => {
                *load.failures.entry(kind).or_default() += 1;
                None
            }
        })
    }

    /// What was recorded since the last take.
    fn take(load: &Mutex<Load>) -> anyhow::Result<Load> {
        Ok(std::mem::replace(&mut *load.lock().expect("load"), Load::new()?))
    }

    fn merge(&mut self, other: Load) -> anyhow::Result<()> {
        self.latencies.add(other.latencies)?;
        self.ok += other.ok;
        for (kind, n) in other.failures {
            *self.failures.entry(kind).or_default() += n;
        }
        Ok(())
    }

    /// Failures a fault excuses: none, or while PostgreSQL is down a 503 `not_ready`, or while
    /// its disk is full a 507 `storage_full`.
    fn unexcused(&self, fault: Fault) -> u64 {
        let excused = |kind: &str| {
            (fault == Fault::PostgresRestart && kind == "503 not_ready")
                || (fault == Fault::DiskFull && kind == STORAGE_FULL)
        };
        self.failures.iter().filter(|(kind, _)| !excused(kind)).map(|(_, n)| n).sum()
    }

    fn summary(&self) -> serde_json::Value {
        let ms = |q: f64| self.latencies.value_at_quantile(q) as f64 / 1000.0;
        json!({ "ok": self.ok, "failed": self.failures, "p50_ms": ms(0.5), "p99_ms": ms(0.99),
                "max_ms": self.latencies.max() as f64 / 1000.0 })
    }
}

/// A queue's jobs when the run ends.
#[derive(Debug, Clone, Copy, Default)]
struct Jobs {
    done: i64,
    /// Pending, or failed and due to run again.
    waiting: i64,
    running: i64,
    dead: i64,
}

impl Jobs {
    /// Nothing left to run; whatever is dead stays dead.
    fn idle(&self) -> bool {
        self.waiting == 0 && self.running == 0
    }

    fn settled(&self) -> bool {
        self.idle() && self.dead == 0
    }

    fn summary(&self) -> serde_json::Value {
        json!({ "done": self.done, "waiting": self.waiting, "running": self.running, "dead": self.dead })
    }
}

/// The embed and the judge queue's jobs now.
async fn queue_jobs(store: &Store) -> anyhow::Result<[Jobs; 2]> {
    let status = store.queue_status(true).await?;
    let of = |queue: Queue| {
        status.iter().find(|q| q.queue == queue.as_str()).map_or_else(Jobs::default, |q| Jobs {
            done: q.done.unwrap_or(0),
            waiting: q.pending + q.failed,
            running: q.running,
            dead: q.dead,
        })
    };
    Ok([of(Queue::Embed), of(Queue::Judge)])
}

/// A soak's windows, and the load's latencies over all of them.
struct Soak {
    windows: Vec<Window>,
    totals: (Load, Load),
}

/// One window of a soak: the load over it, and the processes and queues at its end.
struct Window {
    end_s: f64,
    writes: u64,
    write_p99_ms: f64,
    recall_p99_ms: f64,
    server_mib: f64,
    worker_mib: f64,
    waiting_jobs: i64,
}

impl Window {
    fn summary(&self) -> serde_json::Value {
        json!({ "end_s": self.end_s, "writes": self.writes, "write_p99_ms": self.write_p99_ms,
                "recall_p99_ms": self.recall_p99_ms, "server_mib": self.server_mib,
                "worker_mib": self.worker_mib, "waiting_jobs": self.waiting_jobs })
    }
}

impl Soak {
    /// Resident memory flat (the last window within 10% of the end of the first quarter), the
    /// queues bounded (never more than `bound` jobs waiting), and p99 stable (the median window's
    /// p99 over the second half within 1.5 times the first half's): what broke, if anything.
    fn broken(&self, bound: i64) -> Vec<String> {
        let mut broken = Vec::new();
        let (Some(quarter), Some(last)) = (self.windows.get(self.windows.len() / 4), self.windows.last()) else {
            return broken;
        };
        for (name, at_quarter, at_end) in
            [("server", quarter.server_mib, last.server_mib), ("worker", quarter.worker_mib, last.worker_mib)]
        {
            if at_end > at_quarter * 1.1 {
                broken.push(format!("{name} memory grew from {at_quarter:.0} to {at_end:.0} MiB"));
            }
        }
        if let Some(w) = self.windows.iter().find(|w| w.waiting_jobs > bound) {
            broken.push(format!("{} jobs waiting at {:.0} s", w.waiting_jobs, w.end_s));
        }
        type P99 = fn(&Window) -> f64;
        let p99s: [(&str, P99); 2] = [("write", |w| w.write_p99_ms), ("recall", |w| w.recall_p99_ms)];
        let median = |windows: &[Window], p99: P99| {
            let mut all: Vec<f64> = windows.iter().map(p99).collect();
            all.sort_by(f64::total_cmp);
            all.get(all.len() / 2).copied().unwrap_or_default()
        };
        let (early, late) = self.windows.split_at(self.windows.len() / 2);
        for (name, p99) in p99s {
            let (early, late) = (median(early, p99), median(late, p99));
            if late > 1.5 * early {
                broken.push(format!(
                    "{name} p99 drifted from {early:.0} to {late:.0} ms (median window, first half to second)"
                ));
            }
        }
        broken
    }
}

/// Waits until every row acknowledged so far has its vector; fails if one has not `limit_s`
/// seconds after `after` (such as "the outage ended").
async fn every_acked_embedded(
    store: &Store,
    tenant: &TenantId,
    acked: &Mutex<Vec<Uuid>>,
    model: &str,
    limit_s: u64,
    after: &str,
) -> anyhow::Result<()> {
    let ids = acked.lock().expect("ids").clone();
    let delivery = embedded_within(store, tenant, &ids, model, limit_s).await?;
    anyhow::ensure!(
        delivery.unembedded == 0,
        "{} rows still unembedded {limit_s} s after {after} ({} given up)",
        delivery.unembedded,
        delivery.failed
    );
    Ok(())
}

/// Waits up to `limit_s` seconds for every row of `ids` to have its vector of `model`; what was
/// delivered when it stopped waiting.
async fn embedded_within(
    store: &Store,
    tenant: &TenantId,
    ids: &[Uuid],
    model: &str,
    limit_s: u64,
) -> anyhow::Result<Delivery> {
    let started = Instant::now();
    let mut delivery = store.delivery(tenant, ids, model).await?;
    while delivery.unembedded > 0 && started.elapsed() < Duration::from_secs(limit_s) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        delivery = store.delivery(tenant, ids, model).await?;
    }
    Ok(delivery)
}

/// Runs the runbook's re-judge, as an operator would after an outage of the judge's endpoint:
/// clears the judgement of every live fact of `tenant` that failed open since `since`; the ids.
async fn rejudge_failed_open(
    url: &str,
    tenant: &TenantId,
    since: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<Vec<Uuid>> {
    let output = tokio::process::Command::new(crate::sibling_binary("mnemo-runbook")?)
        .args("judge clear --outcome fail_open --json".split(' '))
        .args(["--since", &since.to_rfc3339(), "--tenant", tenant.as_str()])
        .env(vars::DATABASE_URL, url)
        .env(vars::LOG, "error")
        .output()
        .await?;
    anyhow::ensure!(
        output.status.success(),
        "mnemo-runbook judge clear failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let answer: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let ids = answer["ids"].as_array().context("judge clear answered without ids")?;
    ids.iter().map(|id| id.as_str().and_then(|s| s.parse().ok()).context("an id that is not one")).collect()
}

/// Writes zeros to `path` until its filesystem is full; how many bytes it took.
async fn fill(path: &PathBuf) -> anyhow::Result<u64> {
    use tokio::io::AsyncWriteExt;
    let mut file = tokio::fs::File::create(path).await.with_context(|| format!("creating {}", path.display()))?;
    let chunk = vec![0u8; 1 << 20];
    let mut written = 0u64;
    loop {
        match file.write(&chunk).await {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
            Err(e) => return Err(e).with_context(|| format!("filling {}", path.display())),
        }
    }
    // What the last write buffered must reach the filesystem too, or the disk is not full yet.
    match file.sync_all().await {
        Err(e) if e.kind() != std::io::ErrorKind::StorageFull => Err(e.into()),
        _ => Ok(written),
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rate > 0.0 && args.recall_rate > 0.0 && args.every > 0.0,
        "rates and --every must be positive"
    );
    anyhow::ensure!(args.fault != Fault::Soak || args.kills >= 4, "a soak needs at least 4 windows (--kills)");
    let env = Env::from_process()?;
    let database = DatabaseSettings::from_env(&env)?;
    let db = crate::bench_database(&database).await?;
    if args.fault == Fault::DiskFull {
        let tablespace = args.tablespace.as_deref().context("disk-full needs --tablespace")?;
        anyhow::ensure!(args.ballast.is_some(), "disk-full needs --ballast");
        move_database(database.url.expose(), &db, tablespace).await.context("moving the bench database")?;
    }
    let url = db.url;

    // Under `embedder-outage` the API and the workers embed through a scripted endpoint that the
    // loop below breaks and mends; otherwise with the local model.
    let provider = match args.fault {
        Fault::EmbedderOutage => Some(ScriptedEmbeddings::start(64).await),
        _ => None,
    };
    let mut model_env = provider.as_ref().map_or_else(Vec::new, |p| p.env("scripted-bag-of-words"));
    if provider.is_some() {
        model_env.push((vars::EMBED_TIMEOUT_MS, OUTAGE_EMBED_TIMEOUT_MS.to_owned()));
    }
    // The workers judge with the scripted chat endpoint in every fault; `chat-outage` breaks it.
    let chat = ScriptedChat::start().await;
    model_env.extend([
        (vars::JUDGE_MODEL, "scripted-judge".to_owned()),
        (vars::JUDGE_BASE_URL, chat.base_url.clone()),
        (vars::JUDGE_TIMEOUT_MS, JUDGE_TIMEOUT.as_millis().to_string()),
    ]);
    let secret = format!("bench-{}", Uuid::new_v4().simple());
    let mut server_env = env.clone().with(vars::DATABASE_URL, url.as_str()).with(vars::JWT_SECRET, secret.as_str());
    for (name, value) in &model_env {
        server_env = server_env.with(name, value.as_str());
    }
    let model = ServerSettings::from_env(&server_env)?.embed.model;
    let store = Store::connect(&url, 16).await?;
    let mut server_vars = model_env.clone();
    // Its errors while a part is down are the fault's, expected: the checks judge.
    server_vars.extend([
        (vars::DATABASE_URL, url.clone()),
        (vars::JWT_SECRET, secret.clone()),
        (vars::LOG, "off".into()),
    ]);
    let mut server = crate::start_server(&server_vars).await?;
    let base = format!("{}/v1", server.client.base);
    let tenant = TenantId::parse("bench")?;
    let principal = Principal {
        tenant: tenant.clone(),
        user: Some(UserId::parse("bench-user")?),
        agent: None,
        session: Some(SessionId::parse("bench-session")?),
        roles: Vec::new(),
    };
    let sign = |principal: &Principal| {
        mnemo_api::auth::sign_hs256(secret.as_bytes(), principal, Duration::from_secs(86_400))
            .map_err(anyhow::Error::msg)
    };
    let token = sign(&principal)?;
    let residents = (0..RESIDENTS)
        .map(|r| sign(&Principal { user: Some(UserId::parse(&format!("resident-{r}"))?), ..principal.clone() }))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let residents = Arc::new(residents);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;

    let mut worker = crate::start_worker(&url, &model_env).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::<Uuid>::new()));
    let sequence = Arc::new(AtomicU64::new(0));

    // Writers: each paced to its share of the rate; every acknowledged id is kept.
    let writers = 4;
    let mut write_tasks = Vec::new();
    let writes = Arc::new(Mutex::new(Load::new()?));
    let recalls = Arc::new(Mutex::new(Load::new()?));
    for _ in 0..writers {
        let (http, base, token, residents, stop, acked, sequence, writes) = (
            http.clone(),
            base.clone(),
            token.clone(),
            residents.clone(),
            stop.clone(),
            acked.clone(),
            sequence.clone(),
            writes.clone(),
        );
        let interval = Duration::from_secs_f64(writers as f64 / args.rate);
        write_tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let n = sequence.fetch_add(1, Ordering::Relaxed);
                let request = if n % 5 == 4 {
                    let resident = (n / 5) % RESIDENTS;
                    let city = CITIES[(n / 5 / RESIDENTS) as usize % CITIES.len()];
                    let body = json!({ "scope": "user", "content": format!("I live in {city} now, since order {n}") });
                    http.post(format!("{base}/facts")).bearer_auth(&residents[resident as usize]).json(&body)
                } else {
                    let body = json!({ "source_kind": "chat_message", "source_ref": format!("f-{n}"),
                                       "content": format!("Order {n} shipped to the warehouse in Lyon on pallet {}", n % 97) });
                    http.post(format!("{base}/memories")).bearer_auth(&token).json(&body)
                };
                if let Some(written) = Load::send(&writes, request, 201).await? {
                    let id = written["id"].as_str().and_then(|s| s.parse().ok());
                    acked.lock().expect("ids").push(id.context("a write answered without an id")?);
                }
            }
            anyhow::Ok(())
        }));
    }
    let recall_task = {
        let (http, url, token, stop, recalls) =
            (http.clone(), format!("{base}/recall"), token.clone(), stop.clone(), recalls.clone());
        let interval = Duration::from_secs_f64(1.0 / args.recall_rate);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let body = json!({ "query": "which pallet went to Lyon", "top_k": 10 });
                Load::send(&recalls, http.post(&url).bearer_auth(&token).json(&body), 200).await?;
            }
            anyhow::Ok(())
        })
    };

    // The fault, again and again. `recoveries`: from the fault to the part answering again.
    let started = Instant::now();
    let mut recoveries = Histogram::<u64>::new(3)?;
    let mut worker_exits = 0;
    let mut failed_open = 0;
    let mut soak = Soak { windows: Vec::new(), totals: (Load::new()?, Load::new()?) };
    for kill in 1..=args.kills {
        tokio::time::sleep(Duration::from_secs_f64(args.every)).await;
        let mut t = Instant::now();
        match args.fault {
            Fault::WorkerKill => {
                worker.kill().await;
                worker = crate::start_worker(&url, &model_env).await?;
            }
            Fault::PostgresRestart => {
                let command = args.restart_command.as_deref().context("postgres-restart needs --restart-command")?;
                let status = tokio::process::Command::new("sh").arg("-c").arg(command).status().await?;
                anyhow::ensure!(status.success(), "`{command}` failed: {status}");
                while store.queue_status(false).await.is_err() {
                    anyhow::ensure!(
                        t.elapsed() < Duration::from_secs(120),
                        "PostgreSQL did not come back within 120 s"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            Fault::EmbedderOutage => {
                let provider = provider.as_ref().context("the scripted endpoint")?;
                let (what, answer) = outage_answer(kill - 1);
                eprintln!("outage {kill}: the embedding endpoint answers {what} for {} s", args.outage);
                provider.outage(Some(answer));
                tokio::time::sleep(Duration::from_secs(args.outage)).await;
                provider.outage(None);
                // Recovered once every row acknowledged so far has its vector.
                t = Instant::now();
                every_acked_embedded(&store, &tenant, &acked, &model, args.drain_limit, "the outage ended").await?;
            }
            Fault::DiskFull => {
                let ballast = args.ballast.as_ref().context("disk-full needs --ballast")?;
                let refused = |load: &Mutex<Load>| load.lock().expect("load").failures.get(STORAGE_FULL).copied();
                let before = refused(&writes);
                let filled = fill(ballast).await?;
                eprintln!(
                    "fault {kill}: the database's disk is full ({} MiB of ballast) for {} s",
                    filled >> 20,
                    args.outage
                );
                tokio::time::sleep(Duration::from_secs(args.outage)).await;
                tokio::fs::remove_file(ballast).await?;
                anyhow::ensure!(refused(&writes) > before, "the full disk refused no write: the fault did not take");
                // Recovered once a write succeeds again and every row acknowledged so far has its
                // vector.
                t = Instant::now();
                let probe = json!({ "source_kind": "chat_message", "source_ref": format!("probe-{kill}"),
                                    "content": "space is back" });
                let answered = |r: reqwest::Result<reqwest::Response>| r.is_ok_and(|r| r.status().as_u16() == 201);
                while !answered(http.post(format!("{base}/memories")).bearer_auth(&token).json(&probe).send().await) {
                    anyhow::ensure!(
                        t.elapsed() < Duration::from_secs(args.drain_limit),
                        "writes still fail {} s after space returned",
                        args.drain_limit
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                every_acked_embedded(&store, &tenant, &acked, &model, args.drain_limit, "space returned").await?;
            }
            Fault::Soak => {
                let (w, r) = (Load::take(&writes)?, Load::take(&recalls)?);
                let [embed, judge] = queue_jobs(&store).await?;
                let p99 = |load: &Load| load.latencies.value_at_quantile(0.99) as f64 / 1000.0;
                let window = Window {
                    end_s: started.elapsed().as_secs_f64(),
                    writes: w.ok,
                    write_p99_ms: p99(&w),
                    recall_p99_ms: p99(&r),
                    server_mib: crate::resident_kib(server.id().context("server pid")?)? as f64 / 1024.0,
                    worker_mib: crate::resident_kib(worker.id().context("worker pid")?)? as f64 / 1024.0,
                    waiting_jobs: embed.waiting + judge.waiting,
                };
                eprintln!(
                    "{:.0} s: {} writes, p99 write {:.0} / recall {:.0} ms, server {:.0} / worker {:.0} MiB, {} jobs waiting",
                    window.end_s,
                    window.writes,
                    window.write_p99_ms,
                    window.recall_p99_ms,
                    window.server_mib,
                    window.worker_mib,
                    window.waiting_jobs
                );
                soak.windows.push(window);
                soak.totals.0.merge(w)?;
                soak.totals.1.merge(r)?;
            }
            Fault::ChatOutage => {
                let (what, answer) = chat_outage_answer(kill - 1);
                eprintln!("outage {kill}: the chat endpoint answers {what} for {} s", args.outage);
                let since = chrono::Utc::now();
                chat.outage(Some(answer));
                // Calls that started before the outage have ended after the judge's timeout; from
                // then on every call fails, and a failing judge retires nothing.
                let settle = JUDGE_TIMEOUT + Duration::from_secs(1);
                tokio::time::sleep(settle).await;
                let before = store.supersede_integrity(&tenant).await?;
                tokio::time::sleep(Duration::from_secs(args.outage).saturating_sub(settle)).await;
                let during = store.supersede_integrity(&tenant).await?;
                chat.outage(None);
                t = Instant::now();
                anyhow::ensure!(
                    during.superseded == before.superseded,
                    "{} facts were retired while every judge call failed",
                    during.superseded - before.superseded
                );
                // Calls that started during the outage can still fail until the judge's timeout.
                tokio::time::sleep(settle).await;
                // Re-judge until nothing since the outage's start is left failed open: a call still
                // in flight on a busy machine can fail open after a clear.
                let mut cleared = 0;
                loop {
                    let ids = rejudge_failed_open(&url, &tenant, since).await?;
                    if ids.is_empty() {
                        break;
                    }
                    cleared += ids.len();
                    let jobs: Vec<JudgeJob> =
                        ids.iter().map(|&item_id| JudgeJob { tenant_id: tenant.clone(), item_id }).collect();
                    while !store.pending_facts(&jobs).await?.is_empty() {
                        anyhow::ensure!(
                            t.elapsed() < Duration::from_secs(args.drain_limit),
                            "the facts judged again were not all judged {} s after the outage",
                            args.drain_limit
                        );
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                }
                let after = store.supersede_integrity(&tenant).await?;
                eprintln!(
                    "  {cleared} facts failed open and were judged again; {} facts superseded since the outage ended",
                    after.superseded - during.superseded
                );
                failed_open += cleared;
            }
        }
        recoveries.record(t.elapsed().as_millis() as u64)?;
        if worker.try_wait()?.is_some() {
            worker_exits += 1;
            worker = crate::start_worker(&url, &model_env).await?;
        }
        if kill % 10 == 0 || args.fault != Fault::WorkerKill {
            eprintln!("{kill} faults, {} writes acknowledged", acked.lock().expect("ids").len());
        }
    }
    let faulted = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for task in write_tasks {
        task.await??;
    }
    recall_task.await??;
    let (writes, recalls) = {
        let (mut all_writes, mut all_recalls) = std::mem::replace(&mut soak.totals, (Load::new()?, Load::new()?));
        all_writes.merge(Load::take(&writes)?)?;
        all_recalls.merge(Load::take(&recalls)?)?;
        (all_writes, all_recalls)
    };

    // The last worker drains what is left: first every row gets its vector, then the queues
    // settle and every fact is judged (jobs a killed worker held run again once it is found dead,
    // after the orphan timeout, and find their rows embedded or judged).
    let ids = acked.lock().expect("ids").clone();
    let drain = Instant::now();
    let limit = Duration::from_secs(args.drain_limit);
    let delivery = embedded_within(&store, &tenant, &ids, &model, args.drain_limit).await?;
    let drained = drain.elapsed().as_secs_f64();
    let mut jobs = queue_jobs(&store).await?;
    let mut facts = store.supersede_integrity(&tenant).await?;
    while !(jobs.iter().all(Jobs::idle) && facts.unjudged == 0) && drain.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(500)).await;
        jobs = queue_jobs(&store).await?;
        facts = store.supersede_integrity(&tenant).await?;
    }
    let settled = drain.elapsed().as_secs_f64();
    worker.kill().await;
    if let Some(status) = server.try_wait()? {
        bail!("mnemo-server exited during the run: {status}");
    }
    server.kill().await;

    let acked_rows = ids.len() as i64;
    let [embed_jobs, judge_jobs] = jobs;
    // Bounded: never more than a minute of writes waiting.
    let soak_broken = soak.broken((args.rate * 60.0) as i64);
    let result = json!({
        "scenario": "faults", "fault": args.fault.to_possible_value().map(|v| v.get_name().to_owned()),
        "restart_command": args.restart_command, "faults": args.kills, "every_s": args.every, "faulted_s": faulted,
        "recovery_ms": { "p50": recoveries.value_at_quantile(0.5), "max": recoveries.max() },
        "worker_exits": worker_exits,
        "writes": writes.summary(), "recalls": recalls.summary(),
        "acknowledged": acked_rows, "lost": delivery.missing, "unembedded": delivery.unembedded,
        "failed_embedding": delivery.failed, "vectors": delivery.vectors, "drain_s": drained, "settled_s": settled,
        "embed_jobs": embed_jobs.summary(), "judge_jobs": judge_jobs.summary(), "facts": facts, "failed_open_and_judged_again": failed_open,
        "soak": soak.windows.iter().map(Window::summary).collect::<Vec<_>>(), "soak_broken": soak_broken,
    });
    let held = delivery.missing == 0
        && worker_exits == 0
        && delivery.unembedded == 0
        && delivery.failed == 0
        && delivery.vectors == acked_rows
        && writes.unexcused(args.fault) == 0
        && recalls.unexcused(args.fault) == 0
        && embed_jobs.settled()
        && judge_jobs.settled()
        && facts.unjudged == 0
        && facts.failed_open == 0
        && facts.broken().is_empty()
        && facts.buckets_with_several_live == 0
        // An outage that failed no judgement open tested nothing.
        && (args.fault != Fault::ChatOutage || failed_open > 0)
        && soak_broken.is_empty();
    if args.json {
        println!("{result}");
    } else {
        println!("| measure | value |\n|---|---:|");
        println!("| faults (every {} s) | {} in {faulted:.0} s |", args.every, args.kills);
        let recovery = match args.fault {
            Fault::EmbedderOutage => "outage's end to every row embedded",
            Fault::DiskFull => "space's return to every row embedded",
            Fault::ChatOutage => "outage's end to every fact that failed open judged again",
            _ => "fault to answering again",
        };
        if args.fault != Fault::Soak {
            println!("| {recovery}, p50 / max | {} / {} ms |", recoveries.value_at_quantile(0.5), recoveries.max());
        }
        println!("| worker exits after a fault (started again) | {worker_exits} |");
        for (name, load) in [("writes", &writes), ("recalls", &recalls)] {
            let s = load.summary();
            println!(
                "| {name}: ok, failed, p50 / p99 / max ms | {}, {}, {} / {} / {} |",
                s["ok"], s["failed"], s["p50_ms"], s["p99_ms"], s["max_ms"]
            );
        }
        println!("| writes acknowledged (facts among them) | {acked_rows} ({}) |", facts.facts);
        println!(
            "| lost / unembedded / failed embedding | {} / {} / {} |",
            delivery.missing, delivery.unembedded, delivery.failed
        );
        println!("| vectors of {model} (one per row) | {} |", delivery.vectors);
        println!(
            "| facts superseded / failed open and judged again / unjudged / failed open left | {} / {failed_open} / {} / {} |",
            facts.superseded, facts.unjudged, facts.failed_open
        );
        println!(
            "| superseded twice / without their audit row / audit rows without their row / by an older fact | {} / {} / {} / {} |",
            facts.superseded_twice, facts.unaudited, facts.audit_without_row, facts.retired_wrongly
        );
        println!("| users left with more than one live fact | {} |", facts.buckets_with_several_live);
        println!("| after the last fault: every row embedded / the queues settled | {drained:.1} / {settled:.1} s |");
        for (queue, j) in [(Queue::Embed, embed_jobs), (Queue::Judge, judge_jobs)] {
            println!(
                "| {} jobs done / waiting / running / dead | {} / {} / {} / {} |",
                queue.as_str(),
                j.done,
                j.waiting,
                j.running,
                j.dead
            );
        }
        if !soak.windows.is_empty() {
            println!(
                "| soak: memory flat, queues bounded, p99 stable | {} |",
                if soak_broken.is_empty() { "yes".to_owned() } else { soak_broken.join("; ") }
            );
        }
        println!("| **invariants** | **{}** |", if held { "held" } else { "BROKEN" });
        if !soak.windows.is_empty() {
            println!(
                "\n| window end s | writes | write p99 ms | recall p99 ms | server MiB | worker MiB | jobs waiting |"
            );
            println!("|---:|---:|---:|---:|---:|---:|---:|");
            for w in &soak.windows {
                println!(
                    "| {:.0} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
                    w.end_s, w.writes, w.write_p99_ms, w.recall_p99_ms, w.server_mib, w.worker_mib, w.waiting_jobs
                );
            }
        }
    }
    if !held {
        bail!("an invariant broke under the fault: {result}");
    }
    Ok(())
}
