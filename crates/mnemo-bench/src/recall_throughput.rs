//! Recall under concurrency: `POST /v1/recall` (top 10) from 1, 8 and 32 clients at once over
//! HTTP to the API in this process, which embeds each query with the local model as the server
//! does. Every request asks a different LoCoMo question, so no query vector comes from the
//! recent-query cache: the figures are for distinct questions. The session holds 2,000 LoCoMo
//! turns, embedded by an in-process worker, then vacuumed and analyzed before the clients start.
//! With `MNEMO_READ_DATABASE_URL` set, the API reads from that replica (of the bench's database).
//! Before the levels, a warm-up at the largest level's clients (questions no level asks, not
//! counted): a fresh server's pool opens its connections then, and PostgreSQL plans each
//! statement afresh for its first executions on a connection, which a running server has done.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mnemo_core::{Principal, SessionId, TenantId};
use serde_json::{Value, json};

use crate::context::LocalApi;
use crate::embedding::{JudgeQueue, local_embedder, raw_rate, start_worker, wait_embedded};
use crate::locomo;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A LoCoMo-format JSON file: its first turns are stored, its questions asked.
    #[arg(long, default_value = "../shared/bench/locomo/locomo-dev5.json")]
    data: PathBuf,
    /// Turns stored in the session.
    #[arg(long, default_value_t = 2000)]
    turns: usize,
    /// Clients at once, one level after the other.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    clients: Vec<usize>,
    /// Requests per level, each a question no earlier request asked.
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// Warm-up requests before the levels, not counted (0: none).
    #[arg(long, default_value_t = 90)]
    warmup: usize,
    #[arg(long)]
    json: bool,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let env = mnemo_config::Env::from_process()?;
    let samples = locomo::read(&args.data)?;
    let turns: Vec<String> = samples.iter().flat_map(|s| s.turns()).map(|t| t.line()).take(args.turns).collect();
    let mut questions: Vec<String> = samples.iter().flat_map(|s| &s.qa).filter_map(|qa| qa.question.clone()).collect();
    questions.dedup();
    let needed = args.requests * args.clients.len() + args.warmup;
    anyhow::ensure!(questions.len() >= needed, "{needed} distinct questions needed, the file has {}", questions.len());

    let api = LocalApi::start(&env).await?;
    let principal = Principal {
        tenant: TenantId::parse("bench")?,
        user: None,
        agent: None,
        session: Some(SessionId::parse("locomo")?),
        roles: Vec::new(),
    };
    let token = api.token(&principal)?;
    let started = Instant::now();
    for (i, turn) in turns.iter().enumerate() {
        let body = json!({ "source_kind": "chat_message", "source_ref": format!("t{i}"), "content": turn });
        api.post("/memories", &token, &body, 201).await?;
    }
    let (settings, embedder) = local_embedder(&env)?;
    let stop = start_worker(&env, &api.url, 32, embedder, JudgeQueue::Off)?;
    wait_embedded(&api.store, &settings.model, turns.len(), Duration::from_secs(1800)).await?;
    let _ = stop.send(());
    // As autovacuum does within a minute of the load: without fresh statistics the planner takes
    // the just-embedded tables for empty, and the levels measure whichever plans that gave.
    api.store.vacuum_analyze_memories().await?;
    eprintln!("{} turns written and embedded in {:.1} s", turns.len(), started.elapsed().as_secs_f64());

    // The model alone on questions at batch 32, in the same run: machines of one kind differ by a
    // quarter or more, so recall's throughput is also given as a fraction of this rate.
    let (_, model) = local_embedder(&env)?;
    let sample: Vec<String> = questions.iter().rev().take(64).cloned().collect();
    raw_rate(model.as_ref(), &sample[..sample.len().min(32)], 32).await?; // warm-up
    let model_rate = raw_rate(model.as_ref(), &sample, 32).await?;
    drop(model);

    let url = format!("{}/recall", api.base);
    if args.warmup > 0 {
        let clients = args.clients.iter().copied().max().unwrap_or(1);
        let (_, seconds, _) = level(&api, &url, &token, &questions[questions.len() - args.warmup..], clients).await?;
        eprintln!(
            "warm-up, not counted: {} recalls from {clients} clients, {:.1}/s",
            args.warmup,
            args.warmup as f64 / seconds
        );
    }
    let mut results = Vec::new();
    for (at, &clients) in args.clients.iter().enumerate() {
        let asked = &questions[at * args.requests..][..args.requests];
        let (histogram, seconds, degraded) = level(&api, &url, &token, asked, clients).await?;
        let ms = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
        results.push(json!({ "clients": clients, "requests": args.requests, "seconds": seconds,
                             "recalls_per_s": args.requests as f64 / seconds,
                             "of_model_rate": args.requests as f64 / seconds / model_rate,
                             "p50_ms": ms(0.5), "p95_ms": ms(0.95), "p99_ms": ms(0.99), "degraded": degraded }));
        eprintln!("{clients} clients: done");
    }
    if api.settings.database.read_url.is_some() {
        // Where the reads went, from the server's own counters.
        let metrics =
            api.http.get(format!("{}/metrics", api.base.trim_end_matches("/v1"))).send().await?.text().await?;
        for line in metrics.lines().filter(|l| l.starts_with("mnemo_replica_reads_total")) {
            eprintln!("{line}");
        }
    }
    if args.json {
        println!(
            "{}",
            json!({ "scenario": "recall-throughput", "turns": turns.len(), "model_questions_per_s": model_rate,
                    "levels": results })
        );
        return Ok(());
    }
    println!("the model alone: {model_rate:.1} questions/s at batch 32");
    println!("| clients | requests | recalls/s | × the model's rate | p50 ms | p95 ms | p99 ms | degraded |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &results {
        println!(
            "| {} | {} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} | {} |",
            r["clients"],
            r["requests"],
            r["recalls_per_s"].as_f64().unwrap_or(0.0),
            r["of_model_rate"].as_f64().unwrap_or(0.0),
            r["p50_ms"].as_f64().unwrap_or(0.0),
            r["p95_ms"].as_f64().unwrap_or(0.0),
            r["p99_ms"].as_f64().unwrap_or(0.0),
            r["degraded"],
        );
    }
    Ok(())
}

/// `asked` from `clients` at once, each asking the next question not yet asked: the latencies
/// (µs), the seconds the level took, and how many answers were degraded.
async fn level(
    api: &LocalApi,
    url: &str,
    token: &str,
    asked: &[String],
    clients: usize,
) -> anyhow::Result<(Histogram<u64>, f64, u64)> {
    let asked: Arc<Vec<String>> = Arc::new(asked.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (asked, next, http, url, token) =
            (asked.clone(), next.clone(), api.http.clone(), url.to_owned(), token.to_owned());
        tasks.spawn(async move {
            let (mut latencies, mut degraded) = (Vec::new(), 0u64);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(question) = asked.get(i) else { return Ok::<_, anyhow::Error>((latencies, degraded)) };
                let t = Instant::now();
                let response =
                    http.post(&url).bearer_auth(&token).json(&json!({ "query": question, "top_k": 10 })).send().await?;
                anyhow::ensure!(response.status().as_u16() == 200, "recall answered {}", response.status());
                let body: Value = response.json().await?;
                // Every row is embedded: only a replica behind the primary makes a recall degraded.
                degraded += u64::from(body["degraded"] == true);
                latencies.push(t.elapsed().as_micros() as u64);
            }
        });
    }
    let mut histogram = Histogram::<u64>::new(3)?;
    let mut degraded = 0;
    while let Some(done) = tasks.join_next().await {
        let (latencies, degraded_here) = done??;
        for latency in latencies {
            histogram.record(latency)?;
        }
        degraded += degraded_here;
    }
    Ok((histogram, started.elapsed().as_secs_f64(), degraded))
}
