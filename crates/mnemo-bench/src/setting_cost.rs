//! What a setting of the API costs: the real `mnemo-server` (the release binary beside this one)
//! under the same write-and-recall load with the setting off and on, alternating off, on, on,
//! off. Each run writes into a tenant of its own, so every run recalls over a tenant as large as
//! the others' were. Reports each run's rates and latencies and on/off ratios.
//! - `trace-cost`: traces exported (to the testkit's OTLP receiver in this process) or not.
//! - `wall-cost`: the server connected as the API's role, which row-level security holds, or as
//!   the tables' owner, which it does not hold.
//!
//! Workers are not run: the rows' embed jobs wait, so recall is full text and the query's
//! embedding.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mnemo_config::{DatabaseSettings, Env, vars};
use mnemo_testkit::OtlpReceiver;
use serde_json::json;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Seconds of load per run.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Clients at once; each writes a message, then recalls.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Pairs of runs (off then on, then on then off, and so on).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Writes only, no recalls: the write path's cost alone, at a higher rate.
    #[arg(long)]
    writes_only: bool,
    /// Tenants the clients are spread over (client i writes as the i-th, round robin), so that
    /// a group commit mixes tenants and the wall names them again for every batch.
    #[arg(long, default_value_t = 1)]
    tenants: usize,
    #[arg(long)]
    json: bool,
}

/// The setting a scenario turns on and off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    Traces,
    Wall,
}

impl Setting {
    fn scenario(self) -> &'static str {
        match self {
            Setting::Traces => "trace-cost",
            Setting::Wall => "wall-cost",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Setting::Traces => "traces",
            Setting::Wall => "row-level security",
        }
    }
}

/// One run's figures.
#[derive(Debug)]
struct Run {
    on: bool,
    writes_per_s: f64,
    recalls_per_s: f64,
    write_p50_ms: f64,
    write_p99_ms: f64,
    recall_p50_ms: f64,
    recall_p99_ms: f64,
    spans: usize,
}

const QUESTIONS: &[&str] = &[
    "where are the invoices",
    "what did the customer order",
    "when is the next delivery",
    "who approved the refund",
    "which folder holds the contracts",
    "how much was the last payment",
    "why was the shipment late",
    "what is the support ticket about",
];

pub async fn run(args: Args, setting: Setting) -> anyhow::Result<()> {
    anyhow::ensure!(args.clients > 0 && args.seconds > 0 && args.rounds > 0, "--clients, --seconds, --rounds > 0");
    let env = Env::from_process()?;
    let database = DatabaseSettings::from_env(&env)?;
    let db = crate::bench_database(&database).await?;
    // The API's role (scripts/env.sh names it), granted on this database.
    let app_url = match setting {
        Setting::Wall => mnemo_testkit::grant_app_role(&db.pool, &db.name).await?,
        Setting::Traces => db.url.clone(),
    };
    let otlp = OtlpReceiver::start().await;
    let secret = format!("bench-{}", uuid::Uuid::new_v4().simple());
    let written = Arc::new(AtomicUsize::new(0));
    let mut runs = Vec::new();
    for round in 0..args.rounds {
        // Off first in odd rounds, on first in even ones: the database grows run by run, and
        // a later run is slower for that alone.
        for on in if round % 2 == 0 { [false, true] } else { [true, false] } {
            let tenant = format!("{}-{}", setting.scenario(), runs.len());
            let mut env = vec![
                (vars::DATABASE_URL, if on { app_url.clone() } else { db.url.clone() }),
                (vars::OTEL_SDK_DISABLED, (!(on && setting == Setting::Traces)).to_string()),
            ];
            if on && setting == Setting::Traces {
                env.push((vars::OTEL_ENDPOINT, otlp.endpoint.clone()));
            }
            let run = load(&args, env, &secret, &tenant, &otlp, on, &written).await?;
            eprintln!(
                "round {} {} {}: {:.0} writes/s, {:.0} recalls/s",
                round + 1,
                setting.name(),
                if on { "on" } else { "off" },
                run.writes_per_s,
                run.recalls_per_s
            );
            runs.push(run);
        }
    }

    let ratio = |f: fn(&Run) -> f64| -> Vec<f64> {
        runs.chunks(2)
            .map(|p| {
                let (on, off) = if p[0].on { (&p[0], &p[1]) } else { (&p[1], &p[0]) };
                f(on) / f(off).max(1e-9)
            })
            .collect()
    };
    let (writes, recalls) = (ratio(|r| r.writes_per_s), ratio(|r| r.recalls_per_s));
    if args.json {
        let list: Vec<_> = runs
            .iter()
            .map(|r| {
                json!({ "on": r.on, "writes_per_s": r.writes_per_s, "recalls_per_s": r.recalls_per_s,
                        "write_p50_ms": r.write_p50_ms, "write_p99_ms": r.write_p99_ms,
                        "recall_p50_ms": r.recall_p50_ms, "recall_p99_ms": r.recall_p99_ms, "spans": r.spans })
            })
            .collect();
        println!(
            "{}",
            json!({ "scenario": setting.scenario(), "clients": args.clients, "seconds": args.seconds, "runs": list,
                    "write_ratio_on_off": writes, "recall_ratio_on_off": recalls })
        );
        return Ok(());
    }
    println!(
        "| run | {} | writes/s | write p50 / p99 ms | recalls/s | recall p50 / p99 ms | spans received |\n|---:|---|---:|---:|---:|---:|---:|",
        setting.name()
    );
    for (i, r) in runs.iter().enumerate() {
        println!(
            "| {} | {} | {:.0} | {:.1} / {:.1} | {:.0} | {:.1} / {:.1} | {} |",
            i + 1,
            if r.on { "on" } else { "off" },
            r.writes_per_s,
            r.write_p50_ms,
            r.write_p99_ms,
            r.recalls_per_s,
            r.recall_p50_ms,
            r.recall_p99_ms,
            r.spans
        );
    }
    let shown = |v: &[f64]| v.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(", ");
    let recalls = if args.writes_only { String::new() } else { format!(", recalls {}", shown(&recalls)) };
    println!(
        "\n{} clients, {} s per run. {} on / off, per round: writes {}{recalls}",
        args.clients,
        args.seconds,
        setting.name(),
        shown(&writes),
    );
    Ok(())
}

/// One run: a fresh server with `env` besides, `args.clients` clients for `args.seconds`, then
/// the server stopped.
async fn load(
    args: &Args,
    mut env: Vec<(&str, String)>,
    secret: &str,
    tenant: &str,
    otlp: &OtlpReceiver,
    on: bool,
    written: &Arc<AtomicUsize>,
) -> anyhow::Result<Run> {
    env.extend([(vars::JWT_SECRET, secret.to_owned()), (vars::LOG, "warn".to_owned())]);
    let server = crate::start_server(&env).await?;
    let spans_before = otlp.spans().len();
    let base = server.client.base.clone();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
    let tokens = (0..args.tenants.max(1))
        .map(|t| {
            crate::session_token(secret, &if args.tenants > 1 { format!("{tenant}-{t}") } else { tenant.to_owned() })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let mut tasks = tokio::task::JoinSet::new();
    let writes_only = args.writes_only;
    for client in 0..args.clients {
        let token = tokens[client % tokens.len()].clone();
        let (http, base, written) = (http.clone(), base.clone(), written.clone());
        tasks.spawn(async move {
            let mut writes = Histogram::<u64>::new(3)?;
            let mut recalls = Histogram::<u64>::new(3)?;
            while Instant::now() < deadline {
                let n = written.fetch_add(1, Ordering::Relaxed);
                let body = json!({ "source_kind": "chat_message", "source_ref": format!("m{n}"),
                                   "content": format!("note {n}: the invoices for order {} are in folder {}", n * 7, n % 13) });
                let started = Instant::now();
                let r = http.post(format!("{base}/v1/memories")).bearer_auth(&token).json(&body).send().await?;
                anyhow::ensure!(r.status().as_u16() == 201, "write answered {}", r.status());
                writes.record(started.elapsed().as_micros() as u64)?;
                if writes_only {
                    continue;
                }
                let body = json!({ "query": QUESTIONS[n % QUESTIONS.len()], "top_k": 10 });
                let started = Instant::now();
                let r = http.post(format!("{base}/v1/recall")).bearer_auth(&token).json(&body).send().await?;
                anyhow::ensure!(r.status().as_u16() == 200, "recall answered {}", r.status());
                recalls.record(started.elapsed().as_micros() as u64)?;
            }
            anyhow::Ok((writes, recalls))
        });
    }
    let started = Instant::now();
    let (mut writes, mut recalls) = (Histogram::<u64>::new(3)?, Histogram::<u64>::new(3)?);
    while let Some(done) = tasks.join_next().await {
        let (w, r) = done??;
        writes.add(w)?;
        recalls.add(r)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    server.kill().await;
    // Spans still buffered when the server was killed are lost; what arrived shows export worked.
    let ms = |h: &Histogram<u64>, q: f64| if h.is_empty() { 0.0 } else { h.value_at_quantile(q) as f64 / 1000.0 };
    Ok(Run {
        on,
        writes_per_s: writes.len() as f64 / seconds,
        recalls_per_s: recalls.len() as f64 / seconds,
        write_p50_ms: ms(&writes, 0.5),
        write_p99_ms: ms(&writes, 0.99),
        recall_p50_ms: ms(&recalls, 0.5),
        recall_p99_ms: ms(&recalls, 0.99),
        spans: otlp.spans().len() - spans_before,
    })
}
