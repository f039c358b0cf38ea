//! The fault suite: a fault injected again and again under a steady write and recall load, then
//! the checks. The API runs in this process as a service would; each worker is the real
//! `mnemo-worker` binary (built beside this one) with the local model. Faults:
//! - `worker-kill`: the worker killed with SIGKILL every few seconds, and started again;
//! - `postgres-restart`: PostgreSQL restarted by `--restart-command` (fast or immediate
//!   shutdown); while it is down the API must answer with an error code, never hang past its
//!   timeout, and recover by itself. A worker that exits is started again, as a supervisor would,
//!   and counted;
//! - `embedder-outage`: the embedding endpoint (the testkit's scripted OpenAI-compatible server,
//!   for the API's queries and the worker's rows) answers 500, hangs past the client's timeout,
//!   answers malformed JSON or vectors of the wrong dimension for `--outage` seconds, one after
//!   the other, then recovers; recall must answer (degraded) throughout, writes must not notice,
//!   and the backlog must drain with no row given up.
//!
//! Afterwards, with one worker left to drain the backlog: no acknowledged write is lost, every
//! row has its vector of the model, the embed queue settles with no job dead, and no
//! request failed except, under `postgres-restart`, with a 503 and its code.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::ValueEnum;
use hdrhistogram::Histogram;
use mnemo_api::{AppState, Timeouts, app};
use mnemo_config::{DatabaseSettings, Env, ServerSettings, vars};
use mnemo_core::{Principal, Queue, SessionId, TenantId, UserId};
use mnemo_store::{Delivery, Store, create_database};
use mnemo_testkit::{Answer, ScriptedEmbeddings};
use serde_json::json;
use uuid::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Fault {
    WorkerKill,
    PostgresRestart,
    EmbedderOutage,
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

/// The embedding client's timeout under `embedder-outage`, so a hang costs a request this long.
const OUTAGE_EMBED_TIMEOUT_MS: &str = "2000";

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
    /// For `embedder-outage`: how long each outage lasts, in seconds.
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

    /// Records one request's outcome; `Ok` with the answer's body on the expected status.
    async fn record(
        &mut self,
        started: Instant,
        answer: reqwest::Result<reqwest::Response>,
        expected: u16,
    ) -> anyhow::Result<Option<serde_json::Value>> {
        let outcome = match answer {
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
        self.latencies.record(started.elapsed().as_micros() as u64)?;
        Ok(match outcome {
            Ok(body) => {
                self.ok += 1;
                Some(body)
            }
            Err(kind) => {
                *self.failures.entry(kind).or_default() += 1;
                None
            }
        })
    }

    fn merge(&mut self, other: Load) -> anyhow::Result<()> {
        self.latencies.add(other.latencies)?;
        self.ok += other.ok;
        for (kind, n) in other.failures {
            *self.failures.entry(kind).or_default() += n;
        }
        Ok(())
    }

    /// Failures a fault excuses: none, or while PostgreSQL is down a 503 `not_ready`.
    fn unexcused(&self, fault: Fault) -> u64 {
        let excused = |kind: &str| fault == Fault::PostgresRestart && kind == "503 not_ready";
        self.failures.iter().filter(|(kind, _)| !excused(kind)).map(|(_, n)| n).sum()
    }

    fn summary(&self) -> serde_json::Value {
        let ms = |q: f64| self.latencies.value_at_quantile(q) as f64 / 1000.0;
        json!({ "ok": self.ok, "failed": self.failures, "p50_ms": ms(0.5), "p99_ms": ms(0.99),
                "max_ms": self.latencies.max() as f64 / 1000.0 })
    }
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

/// Starts a worker (this process's environment, the bench database) and waits until it serves
/// its metrics, so a kill lands on a worker that has started.
async fn start_worker(
    binary: &PathBuf,
    url: &str,
    extra_env: &[(&str, String)],
) -> anyhow::Result<tokio::process::Child> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut child = tokio::process::Command::new(binary)
        .envs(extra_env.iter().map(|(k, v)| (*k, v.as_str())))
        .env(vars::DATABASE_URL, url)
        .env(vars::WORKER_LISTEN, format!("127.0.0.1:{port}"))
        .env(vars::LOG, "error")
        // Its errors while PostgreSQL is down are the fault's, expected: the checks judge.
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(60) {
        if let Some(status) = child.try_wait()? {
            bail!("mnemo-worker exited during start-up: {status}");
        }
        if reqwest::get(&metrics).await.is_ok() {
            return Ok(child);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("mnemo-worker did not serve metrics within 60 s")
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rate > 0.0 && args.recall_rate > 0.0 && args.every > 0.0,
        "rates and --every must be positive"
    );
    let binary = crate::sibling_binary("mnemo-worker")?;
    let env = Env::from_process();
    let database = DatabaseSettings::from_env(&env)?;
    let db = create_database(database.url.expose(), "mnemo_bench", 2).await.context("creating the bench database")?;
    eprintln!("bench database: {}", db.name);
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
    let secret = format!("bench-{}", Uuid::new_v4().simple());
    let mut server_env = env.clone().with(vars::DATABASE_URL, url.as_str()).with(vars::JWT_SECRET, secret.as_str());
    for (name, value) in &model_env {
        server_env = server_env.with(name, value.as_str());
    }
    let settings = ServerSettings::from_env(&server_env)?;
    let model = settings.embed.model.clone();
    let store = Store::connect(&url, 16).await?;
    let state = AppState::new(store.clone(), &settings, mnemo_models::embedder(&settings.embed)?)
        .map_err(anyhow::Error::msg)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}/v1", listener.local_addr()?);
    tokio::spawn(mnemo_api::serve(listener, app(state), Timeouts::of(&settings), std::future::pending()));
    let tenant = TenantId::parse("bench")?;
    let principal = Principal {
        tenant: tenant.clone(),
        user: Some(UserId::parse("bench-user")?),
        agent: None,
        session: Some(SessionId::parse("bench-session")?),
        roles: Vec::new(),
    };
    let token = mnemo_api::auth::sign_hs256(secret.as_bytes(), &principal, Duration::from_secs(86_400))
        .map_err(anyhow::Error::msg)?;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;

    let mut worker = start_worker(&binary, &url, &model_env).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::<Uuid>::new()));
    let sequence = Arc::new(AtomicU64::new(0));

    // Writers: each paced to its share of the rate; every acknowledged id is kept.
    let writers = 4;
    let mut write_tasks = Vec::new();
    for _ in 0..writers {
        let (http, url, token, stop, acked, sequence) =
            (http.clone(), format!("{base}/memories"), token.clone(), stop.clone(), acked.clone(), sequence.clone());
        let interval = Duration::from_secs_f64(writers as f64 / args.rate);
        write_tasks.push(tokio::spawn(async move {
            let mut load = Load::new()?;
            let mut tick = tokio::time::interval(interval);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let n = sequence.fetch_add(1, Ordering::Relaxed);
                let body = json!({ "source_kind": "chat_message", "source_ref": format!("f-{n}"),
                                   "content": format!("Order {n} shipped to the warehouse in Lyon on pallet {}", n % 97) });
                let t = Instant::now();
                let answer = http.post(&url).bearer_auth(&token).json(&body).send().await;
                if let Some(written) = load.record(t, answer, 201).await? {
                    let id = written["id"].as_str().and_then(|s| s.parse().ok());
                    acked.lock().expect("ids").push(id.context("a write answered without an id")?);
                }
            }
            anyhow::Ok(load)
        }));
    }
    let recall_task = {
        let (http, url, token, stop) = (http.clone(), format!("{base}/recall"), token.clone(), stop.clone());
        let interval = Duration::from_secs_f64(1.0 / args.recall_rate);
        tokio::spawn(async move {
            let mut load = Load::new()?;
            let mut tick = tokio::time::interval(interval);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let t = Instant::now();
                let body = json!({ "query": "which pallet went to Lyon", "top_k": 10 });
                load.record(t, http.post(&url).bearer_auth(&token).json(&body).send().await, 200).await?;
            }
            anyhow::Ok(load)
        })
    };

    // The fault, again and again. `recoveries`: from the fault to the part answering again.
    let started = Instant::now();
    let mut recoveries = Histogram::<u64>::new(3)?;
    let mut worker_exits = 0;
    for kill in 1..=args.kills {
        tokio::time::sleep(Duration::from_secs_f64(args.every)).await;
        let mut t = Instant::now();
        match args.fault {
            Fault::WorkerKill => {
                worker.kill().await?;
                worker = start_worker(&binary, &url, &model_env).await?;
            }
            Fault::PostgresRestart => {
                let command = args.restart_command.as_deref().context("postgres-restart needs --restart-command")?;
                let status = tokio::process::Command::new("sh").arg("-c").arg(command).status().await?;
                anyhow::ensure!(status.success(), "`{command}` failed: {status}");
                while store.queue_status().await.is_err() {
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
                let ids = acked.lock().expect("ids").clone();
                let delivery = embedded_within(&store, &tenant, &ids, &model, args.drain_limit).await?;
                anyhow::ensure!(
                    delivery.unembedded == 0,
                    "{} rows still unembedded {} s after the outage ended ({} given up)",
                    delivery.unembedded,
                    args.drain_limit,
                    delivery.failed
                );
            }
        }
        recoveries.record(t.elapsed().as_millis() as u64)?;
        if worker.try_wait()?.is_some() {
            worker_exits += 1;
            worker = start_worker(&binary, &url, &model_env).await?;
        }
        if kill % 10 == 0 || args.fault != Fault::WorkerKill {
            eprintln!("{kill} faults, {} writes acknowledged", acked.lock().expect("ids").len());
        }
    }
    let faulted = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut writes = Load::new()?;
    for task in write_tasks {
        writes.merge(task.await??)?;
    }
    let recalls = recall_task.await??;

    // The last worker drains what is left: first every row gets its vector, then the queue
    // settles (jobs a killed worker held run again once it is found dead, after the orphan
    // timeout, and find their rows embedded).
    let ids = acked.lock().expect("ids").clone();
    let drain = Instant::now();
    let limit = Duration::from_secs(args.drain_limit);
    let delivery = embedded_within(&store, &tenant, &ids, &model, args.drain_limit).await?;
    let drained = drain.elapsed().as_secs_f64();
    let embed_queue = || async {
        let queue = store.queue_status().await?.into_iter().find(|q| q.queue == Queue::Embed.as_str());
        anyhow::Ok(queue.map_or((0, 0, 0, 0), |q| (q.pending + q.failed, q.running, q.dead, q.done)))
    };
    let mut jobs = embed_queue().await?;
    while (jobs.0 > 0 || jobs.1 > 0) && drain.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(500)).await;
        jobs = embed_queue().await?;
    }
    let settled = drain.elapsed().as_secs_f64();
    worker.kill().await?;

    let acked_rows = ids.len() as i64;
    let (pending, running, dead, done) = jobs;
    let result = json!({
        "scenario": "faults", "fault": args.fault.to_possible_value().map(|v| v.get_name().to_owned()),
        "restart_command": args.restart_command, "faults": args.kills, "every_s": args.every, "faulted_s": faulted,
        "recovery_ms": { "p50": recoveries.value_at_quantile(0.5), "max": recoveries.max() },
        "worker_exits": worker_exits,
        "writes": writes.summary(), "recalls": recalls.summary(),
        "acknowledged": acked_rows, "lost": delivery.missing, "unembedded": delivery.unembedded,
        "failed_embedding": delivery.failed, "vectors": delivery.vectors, "drain_s": drained, "settled_s": settled,
        "embed_jobs": { "done": done, "pending": pending, "running": running, "dead": dead },
    });
    let held = delivery.missing == 0
        && worker_exits == 0
        && delivery.unembedded == 0
        && delivery.failed == 0
        && delivery.vectors == acked_rows
        && writes.unexcused(args.fault) == 0
        && recalls.unexcused(args.fault) == 0
        && pending == 0
        && running == 0
        && dead == 0;
    if args.json {
        println!("{result}");
    } else {
        println!("| measure | value |\n|---|---:|");
        println!("| faults (every {} s) | {} in {faulted:.0} s |", args.every, args.kills);
        let recovery = match args.fault {
            Fault::EmbedderOutage => "outage's end to every row embedded",
            _ => "fault to answering again",
        };
        println!("| {recovery}, p50 / max | {} / {} ms |", recoveries.value_at_quantile(0.5), recoveries.max());
        println!("| worker exits after a fault (started again) | {worker_exits} |");
        for (name, load) in [("writes", &writes), ("recalls", &recalls)] {
            let s = load.summary();
            println!(
                "| {name}: ok, failed, p50 / p99 / max ms | {}, {}, {} / {} / {} |",
                s["ok"], s["failed"], s["p50_ms"], s["p99_ms"], s["max_ms"]
            );
        }
        println!("| writes acknowledged | {acked_rows} |");
        println!(
            "| lost / unembedded / failed embedding | {} / {} / {} |",
            delivery.missing, delivery.unembedded, delivery.failed
        );
        println!("| vectors of {model} (one per row) | {} |", delivery.vectors);
        println!("| after the last kill: every row embedded / the queue settled | {drained:.1} / {settled:.1} s |");
        println!("| embed jobs done / pending / running / dead | {done} / {pending} / {running} / {dead} |");
        println!("| **invariants** | **{}** |", if held { "held" } else { "BROKEN" });
    }
    if !held {
        bail!("an invariant broke under the fault: {result}");
    }
    Ok(())
}
