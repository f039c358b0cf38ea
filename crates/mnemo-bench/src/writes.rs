//! Single-row writes over HTTP (`POST /v1/memories`, each a new row with its embed job) at
//! increasing concurrency, beside plain single-row INSERTs of the same PostgreSQL in the same run.
//! Both commit one transaction per row, so the plain rate is the server's fsync bound.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mnemo_api::{AppState, ConnectionLimits, app};
use mnemo_config::{DatabaseSettings, Env, ServerSettings, vars};
use mnemo_core::{Extras, MemoryText, NewMemory, Principal, SessionId, SourceRef, TenantId, UserId};
use mnemo_store::{CommitStats, PlainInserts, Store};
use serde_json::json;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Concurrent writers per level.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    concurrency: Vec<usize>,
    /// How long each level runs, in seconds.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Plain INSERTs and HTTP writes alternate this many times per level, each for `seconds`:
    /// the machine's speed drifts within a run, so each HTTP phase is compared with the plain
    /// phase just before it, and the level reports the median of those ratios and their range.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Also write through `POST /v1/memories/batch`, this many rows per request (0: not).
    #[arg(long, default_value_t = 0)]
    batch: usize,
    /// The API's store connects as the API's role, which row-level security holds
    /// (`MNEMO_APP_DATABASE_URL`'s user), rather than as the tables' owner.
    #[arg(long)]
    as_app_role: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// What one level measured.
#[derive(Debug)]
struct Level {
    rate: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// Latencies and time of one or more phases, pooled.
struct Phases {
    latencies: Histogram<u64>,
    seconds: f64,
}

impl Phases {
    fn new() -> anyhow::Result<Self> {
        Ok(Self { latencies: Histogram::new(3)?, seconds: 0.0 })
    }

    fn add(&mut self, other: &Phases) -> anyhow::Result<()> {
        self.latencies.add(&other.latencies)?;
        self.seconds += other.seconds;
        Ok(())
    }

    fn level(&self) -> Level {
        Level {
            rate: self.latencies.len() as f64 / self.seconds,
            p50_ms: self.latencies.value_at_quantile(0.5) as f64 / 1000.0,
            p99_ms: self.latencies.value_at_quantile(0.99) as f64 / 1000.0,
        }
    }
}

/// HTTP / plain INSERT over the rounds of a level: the median and the range.
#[derive(Debug)]
struct Ratios {
    median: f64,
    min: f64,
    max: f64,
}

impl Ratios {
    fn of(mut ratios: Vec<f64>) -> Self {
        ratios.sort_by(f64::total_cmp);
        let n = ratios.len();
        let median = if n % 2 == 1 { ratios[n / 2] } else { (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0 };
        Self { median, min: ratios[0], max: ratios[n - 1] }
    }
}

/// How group commit served the single-row HTTP writes of one level.
#[derive(Debug)]
struct Commits {
    rows_per_transaction: f64,
    /// Mean time a row waited for a committer.
    queued_ms: f64,
    /// Mean time of one commit (see `CommitStats::in_transaction`).
    transaction_ms: f64,
}

impl From<CommitStats> for Commits {
    fn from(s: CommitStats) -> Self {
        let per = |total: f64, n: u64| if n == 0 { 0.0 } else { total / n as f64 };
        Self {
            rows_per_transaction: per(s.rows as f64, s.transactions),
            queued_ms: per(s.queued.as_secs_f64() * 1000.0, s.rows),
            transaction_ms: per(s.in_transaction.as_secs_f64() * 1000.0, s.transactions),
        }
    }
}

/// Runs `op` from `concurrency` tasks for `duration`; every call's latency is recorded.
async fn measure<F, Fut>(concurrency: usize, duration: Duration, op: F) -> anyhow::Result<Level>
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    Ok(phase(concurrency, duration, op).await?.level())
}

/// [`measure`], keeping the latencies to pool with other phases.
async fn phase<F, Fut>(concurrency: usize, duration: Duration, op: F) -> anyhow::Result<Phases>
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    let op = Arc::new(op);
    let counter = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (op, counter) = (op.clone(), counter.clone());
        tasks.push(tokio::spawn(async move {
            let mut histogram = Histogram::<u64>::new(3)?;
            while Instant::now() < deadline {
                let n = counter.fetch_add(1, Ordering::Relaxed);
                let t = Instant::now();
                op(n).await?;
                histogram.record(t.elapsed().as_micros() as u64)?;
            }
            anyhow::Ok(histogram)
        }));
    }
    let mut latencies = Histogram::<u64>::new(3)?;
    for task in tasks {
        latencies.add(task.await??)?;
    }
    Ok(Phases { latencies, seconds: started.elapsed().as_secs_f64() })
}

const CONTENT: &str = "Sure, I pulled the numbers: 1,284 orders last week, up 12% on the week before, mostly \
    from the spring campaign. Want me to break them down by region or by channel next?";

pub async fn run(args: Args) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let database = DatabaseSettings::from_env(&env)?;
    let max_concurrency = args.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let db = crate::bench_database(&database).await?;
    let url = db.url.clone();

    // The plain-INSERT baseline: same server, same connection kind, one commit per row.
    let plain = PlainInserts::create(&url, max_concurrency as u32).await?;

    // mnemo's API in this process, as a service would run it.
    let secret = format!("bench-{}", uuid::Uuid::new_v4().simple());
    // The server's other settings (MNEMO_WRITE_COMMITTERS, …) come from this process's environment.
    let server_env = env.clone().with(vars::DATABASE_URL, url.as_str()).with(vars::JWT_SECRET, secret.as_str());
    let settings = ServerSettings::from_env(&server_env)?;
    let api_url = if args.as_app_role { mnemo_testkit::grant_app_role(&db.pool, &db.name).await? } else { url.clone() };
    let store = Store::connect(&api_url, max_concurrency as u32 + 4).await?;
    eprintln!("the API's store: {}", if store.walled() { "held by row-level security" } else { "the tables' owner" });
    let direct = store.clone();
    let embedder = mnemo_models::embedder(&settings.embed)?;
    let state = AppState::new(store, &settings, embedder).map_err(anyhow::Error::msg)?;
    let committers = state.writes.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}/v1/memories", listener.local_addr()?);
    tokio::spawn(mnemo_api::serve(listener, app(state), ConnectionLimits::of(&settings), std::future::pending()));

    let principal = Principal {
        tenant: TenantId::parse("bench")?,
        user: Some(UserId::parse("bench-user")?),
        agent: None,
        session: Some(SessionId::parse("bench-session")?),
        roles: Vec::new(),
    };
    let token = mnemo_api::auth::sign_hs256(secret.as_bytes(), &principal, Duration::from_secs(3600))
        .map_err(anyhow::Error::msg)?;
    // The server closes a connection idle for its header timeout; a client must drop it first,
    // or a request sent as the server closes it fails (seen between phases on a starved machine).
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(max_concurrency)
        .pool_idle_timeout(settings.header_timeout / 2)
        .build()?;

    let duration = Duration::from_secs(args.seconds);
    let mut rows = Vec::new();
    for (round, &concurrency) in args.concurrency.iter().enumerate() {
        // The same write without HTTP: what the store costs on its own.
        let (store, who) = (direct.clone(), principal.clone());
        let store_level = measure(concurrency, duration, move |n| {
            let (store, who) = (store.clone(), who.clone());
            async move {
                let memory = NewMemory::chat_message(
                    &who,
                    SourceRef::parse(&format!("s{round}-m{n}"))?,
                    MemoryText::parse(CONTENT)?,
                    None,
                    Extras::default(),
                )?;
                anyhow::ensure!(store.remember(&memory).await?.was_new, "the row existed already");
                Ok(())
            }
        })
        .await?;

        let batch_level = if args.batch > 0 {
            let (http, url, token, size) = (http.clone(), format!("{base}/batch"), token.clone(), args.batch);
            let level = measure(concurrency, duration, move |n| {
                let (http, url, token) = (http.clone(), url.clone(), token.clone());
                async move {
                    let items: Vec<_> = (0..size)
                        .map(|i| json!({ "source_kind": "chat_message", "source_ref": format!("b{round}-{n}-{i}"), "content": CONTENT }))
                        .collect();
                    let response = http.post(&url).bearer_auth(&token).json(&json!({ "items": items })).send().await?;
                    anyhow::ensure!(response.status().as_u16() == 200, "batch answered {}", response.status());
                    let answer: serde_json::Value = response.json().await?;
                    anyhow::ensure!(answer["written"] == json!(size), "a batch wrote {} of {size}", answer["written"]);
                    Ok(())
                }
            })
            .await?;
            // Rows, not requests.
            Some(Level { rate: level.rate * args.batch as f64, ..level })
        } else {
            None
        };

        let (mut plain_phases, mut http_phases, mut ratios, mut commits) =
            (Phases::new()?, Phases::new()?, Vec::new(), CommitStats::default());
        for pass in 0..args.rounds.max(1) {
            let table = plain.clone();
            let plain_phase = phase(concurrency, duration, move |_| {
                let table = table.clone();
                async move { Ok(table.insert(CONTENT).await?) }
            })
            .await?;

            let (http, base, token) = (http.clone(), base.clone(), token.clone());
            let before = committers.stats();
            let http_phase = phase(concurrency, duration, move |n| {
                let (http, base, token) = (http.clone(), base.clone(), token.clone());
                async move {
                    let source_ref = format!("r{round}-{pass}-m{n}");
                    let body = json!({ "source_kind": "chat_message", "source_ref": source_ref, "content": CONTENT });
                    let response = http.post(&base).bearer_auth(&token).json(&body).send().await?;
                    anyhow::ensure!(response.status().as_u16() == 201, "write answered {}", response.status());
                    Ok(())
                }
            })
            .await?;
            commits = commits + (committers.stats() - before);
            ratios.push(http_phase.level().rate / plain_phase.level().rate);
            plain_phases.add(&plain_phase)?;
            http_phases.add(&http_phase)?;
        }
        rows.push((
            concurrency,
            http_phases.level(),
            store_level,
            plain_phases.level(),
            batch_level,
            Commits::from(commits),
            Ratios::of(ratios),
        ));
    }

    if args.json {
        let levels: Vec<_> = rows
            .iter()
            .map(|(c, h, s, p, b, g, r)| {
                json!({
                    "batch_rows_per_s": b.as_ref().map(|b| b.rate), "batch_p50_ms": b.as_ref().map(|b| b.p50_ms),
                    "batch_ratio": b.as_ref().map(|b| b.rate / p.rate),
                    "concurrency": c,
                    "http_writes_per_s": h.rate, "http_p50_ms": h.p50_ms, "http_p99_ms": h.p99_ms,
                    "store_writes_per_s": s.rate, "store_p50_ms": s.p50_ms, "store_p99_ms": s.p99_ms,
                    "plain_inserts_per_s": p.rate, "plain_p50_ms": p.p50_ms, "plain_p99_ms": p.p99_ms,
                    "ratio": r.median, "ratio_min": r.min, "ratio_max": r.max,
                    "group_commit_rows_per_transaction": g.rows_per_transaction,
                    "group_commit_queued_ms": g.queued_ms, "group_commit_transaction_ms": g.transaction_ms,
                })
            })
            .collect();
        println!(
            "{}",
            json!({ "scenario": "writes", "seconds_per_phase": args.seconds, "rounds": args.rounds, "levels": levels })
        );
    } else {
        println!(
            "| concurrency | HTTP writes/s | ack p50 ms | ack p99 ms | store-only writes/s | store p50 ms \
             | plain INSERT/s | INSERT p50 ms | HTTP / plain (median of rounds) | range over rounds \
             | rows per commit | commit wait ms | commit ms \
             | batched rows/s ({} per request) | batch p50 ms | batched / plain |",
            args.batch
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (c, h, s, p, b, g, r) in &rows {
            let batch = b.as_ref().map_or_else(
                || "– | – | –".to_owned(),
                |b| format!("{:.0} | {:.2} | {:.2}", b.rate, b.p50_ms, b.rate / p.rate),
            );
            println!(
                "| {c} | {:.0} | {:.2} | {:.2} | {:.0} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2}–{:.2} | {:.1} | {:.2} | {:.2} | {batch} |",
                h.rate,
                h.p50_ms,
                h.p99_ms,
                s.rate,
                s.p50_ms,
                p.rate,
                p.p50_ms,
                r.median,
                r.min,
                r.max,
                g.rows_per_transaction,
                g.queued_ms,
                g.transaction_ms,
            );
        }
    }
    Ok(())
}
