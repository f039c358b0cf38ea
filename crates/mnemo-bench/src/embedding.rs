//! Embedding benchmarks: the raw embedder at several batch sizes, the whole pipeline (write →
//! queue → worker → vector) against the raw embedder in the same run, and write → embedded
//! latency at a steady write rate. Texts are LoCoMo conversation turns: single turns for short
//! texts, runs of turns for long ones.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mnemo_config::{DatabaseSettings, EmbedSettings, Env, WorkerSettings, vars};
use mnemo_core::{Embedder, Extras, Judge, MemoryText, NewMemory, SourceRef};
use mnemo_store::Store;
use serde_json::json;

use crate::locomo;

#[derive(Debug, clap::Args)]
pub struct CorpusArgs {
    /// A LoCoMo-format JSON file whose turns become the texts.
    #[arg(long, default_value = "../shared/bench/locomo/locomo-dev5.json")]
    data: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub struct EmbedderArgs {
    #[command(flatten)]
    corpus: CorpusArgs,
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    batch: Vec<usize>,
    /// Texts per measurement (at least one batch).
    #[arg(long, default_value_t = 256)]
    texts: usize,
}

#[derive(Debug, clap::Args)]
pub struct PipelineArgs {
    #[command(flatten)]
    corpus: CorpusArgs,
    #[arg(long, default_value_t = 10_000)]
    rows: usize,
    #[arg(long, default_value_t = 32)]
    batch: usize,
}

#[derive(Debug, clap::Args)]
pub struct LatencyArgs {
    #[command(flatten)]
    corpus: CorpusArgs,
    /// Write rates as fractions of the raw embedder's batch-32 rate measured in the same run,
    /// one level after the other, each on a fresh database with a fresh worker.
    #[arg(long, value_delimiter = ',', default_value = "0.3,0.6,0.9")]
    load: Vec<f64>,
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Also deletes this many of the level's earlier messages a second while it writes (each
    /// deletion takes the tenant's text-count lock, as a vector's save does, and sends the
    /// message after it to be embedded again), timing each deletion.
    #[arg(long, default_value_t = 0.0)]
    deletes_per_s: f64,
}

/// The texts the embedder benchmark measures.
struct Corpus {
    /// One turn, "speaker: text", of 60–120 characters.
    short: Vec<String>,
    /// Consecutive turns, ~200 tokens.
    long: Vec<String>,
    /// The questions, as recall embeds them: of mixed lengths, as concurrent queries come.
    questions: Vec<String>,
}

fn corpus(path: &Path) -> anyhow::Result<Corpus> {
    let mut turns = Vec::new();
    let mut questions = Vec::new();
    for sample in locomo::read(path)? {
        questions.extend(sample.qa.iter().filter_map(|qa| qa.question.clone()));
        // Sessions in the order they happened, so a long text is a run of consecutive turns.
        let mut sessions: Vec<&locomo::Session> = sample.sessions.iter().collect();
        sessions.sort_by_key(|s| s.number);
        turns.extend(sessions.into_iter().flat_map(|s| &s.turns).map(locomo::Turn::line));
    }
    anyhow::ensure!(!turns.is_empty(), "no turns in {}", path.display());
    // 60–120 characters is ~15–25 tokens: the short texts.
    let short: Vec<String> = turns.iter().filter(|t| (60..=120).contains(&t.len())).cloned().collect();
    // ~1,000 characters is ~200 tokens of conversational English.
    let mut long = Vec::new();
    let mut current = String::new();
    for turn in &turns {
        current.push_str(turn);
        current.push('\n');
        if current.len() >= 1000 {
            long.push(std::mem::take(&mut current));
        }
    }
    Ok(Corpus { short, long, questions })
}

pub(crate) fn local_embedder(env: &Env) -> anyhow::Result<(EmbedSettings, Arc<dyn Embedder>)> {
    let settings = EmbedSettings::from_env(env)?;
    let embedder = mnemo_models::embedder(&settings)?;
    Ok((settings, embedder))
}

/// Rows per second of one embedder call per batch over `texts`.
pub(crate) async fn raw_rate(embedder: &dyn Embedder, texts: &[String], batch: usize) -> anyhow::Result<f64> {
    let started = Instant::now();
    for chunk in texts.chunks(batch.max(1)) {
        embedder.embed(chunk).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(texts.len() as f64 / started.elapsed().as_secs_f64())
}

fn cycle(texts: &[String], n: usize) -> Vec<String> {
    texts.iter().cycle().take(n).cloned().collect()
}

pub async fn embedder(args: EmbedderArgs) -> anyhow::Result<()> {
    let Corpus { short, long, questions } = corpus(&args.corpus.data)?;
    // Only this scenario asks questions: the others take files of turns alone.
    anyhow::ensure!(!questions.is_empty(), "no questions in {}", args.corpus.data.display());
    let (_, embedder) = local_embedder(&Env::from_process()?)?;
    let mut rows = Vec::new();
    for (label, texts) in [("short", &short), ("long", &long), ("questions", &questions)] {
        // Long texts cost ~10× more: measure fewer of them.
        let n = if label == "long" { args.texts / 4 } else { args.texts };
        for &batch in &args.batch {
            let texts = cycle(texts, n.max(batch));
            let rate = raw_rate(embedder.as_ref(), &texts, batch).await?;
            eprintln!("{label} batch {batch}: {rate:.1} rows/s");
            rows.push(json!({ "texts": label, "batch": batch, "rows_per_s": rate }));
        }
    }
    let mean_chars = |t: &[String]| t.iter().map(String::len).sum::<usize>() / t.len().max(1);
    if args.corpus.json {
        println!(
            "{}",
            json!({ "scenario": "embedder", "model": embedder.model(), "mean_chars": { "short": mean_chars(&short), "long": mean_chars(&long), "questions": mean_chars(&questions) }, "results": rows })
        );
    } else {
        println!(
            "model {} (chars on average: short texts {}, long {}, questions {})",
            embedder.model(),
            mean_chars(&short),
            mean_chars(&long),
            mean_chars(&questions)
        );
        println!("| texts | batch | rows/s |\n|---|---:|---:|");
        for r in &rows {
            println!(
                "| {} | {} | {:.1} |",
                r["texts"].as_str().unwrap_or(""),
                r["batch"],
                r["rows_per_s"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

/// A fresh database and a store on it.
pub(crate) async fn fresh(env: &Env) -> anyhow::Result<(String, Store)> {
    let database = DatabaseSettings::from_env(env)?;
    let db = crate::bench_database(&database).await?;
    let store = Store::connect(&db.url, 16).await?;
    Ok((db.url, store))
}

fn chat(i: usize, text: &str) -> anyhow::Result<NewMemory> {
    let who = mnemo_core::Principal {
        tenant: mnemo_core::TenantId::parse("bench")?,
        user: None,
        agent: None,
        session: Some(mnemo_core::SessionId::parse("bench-session")?),
        roles: Vec::new(),
    };
    Ok(NewMemory::chat_message(
        &who,
        SourceRef::parse(&format!("m{i}"))?,
        MemoryText::parse(text)?,
        None,
        Extras::default(),
    )?)
}

/// Whether the in-process worker serves the judge queue, and with which judge (`None`: the
/// model step disabled).
pub(crate) enum JudgeQueue {
    Off,
    Serve(Option<Arc<dyn Judge>>),
}

/// The worker pool in this process, as `mnemo-worker` runs it.
pub(crate) fn start_worker(
    env: &Env,
    url: &str,
    batch: usize,
    embedder: Arc<dyn Embedder>,
    judge: JudgeQueue,
) -> anyhow::Result<tokio::sync::oneshot::Sender<()>> {
    let (queues, judge) = match judge {
        JudgeQueue::Serve(judge) => (format!("embed={},judge=40", batch * 4), judge),
        JudgeQueue::Off => (format!("embed={}", batch * 4), None),
    };
    let env = env
        .clone()
        .with(vars::DATABASE_URL, url)
        .with(vars::EMBED_BATCH_SIZE, batch.to_string())
        .with(vars::WORKER_QUEUES, queues)
        .with(vars::WORKER_LISTEN, "127.0.0.1:0")
        // Benchmark conversations are dated in the past: maintenance must not retire them.
        .with(vars::SESSION_RETENTION_DAYS, "0")
        .with(vars::DAILY_NOTE_RETENTION_DAYS, "0");
    let settings = WorkerSettings::from_env(&env)?;
    let models = mnemo_jobs::Models {
        embedder,
        judge,
        summarizer: None,
        extractor: None,
        consolidator: None,
        counter: std::sync::Arc::new(mnemo_models::Tokenizer::new(settings.context.tokenizer)),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        if let Err(e) = mnemo_jobs::run_worker(settings, models, async move {
            let _ = stopped.await;
        })
        .await
        {
            eprintln!("worker: {e}");
        }
    });
    Ok(stop)
}

pub(crate) async fn wait_embedded(
    store: &Store,
    model: &str,
    rows: usize,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        let backlog = store.embed_backlog(model).await?;
        if backlog.pending == 0 && backlog.failed == 0 {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(backlog.failed == 0, "{} rows failed to embed", backlog.failed);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    anyhow::bail!("{rows} rows not embedded within {limit:?}")
}

pub async fn pipeline(args: PipelineArgs) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let short = corpus(&args.corpus.data)?.short;
    let texts = cycle(&short, args.rows);
    let (_, embedder) = local_embedder(&env)?;
    let (url, store) = fresh(&env).await?;

    // The raw embedder on the same texts as the worker embeds them, at the same batch size, in
    // this run.
    let previous_turn = WorkerSettings::from_env(&env)?.embed_previous_turn;
    let sample = as_embedded(&texts[..texts.len().min(2048)], previous_turn);
    let raw = raw_rate(embedder.as_ref(), &sample, args.batch).await?;
    eprintln!("raw embedder: {raw:.1} rows/s as embedded at batch {}", args.batch);

    // All rows written (with their jobs) before the worker starts: the pipeline then drains them.
    let rows: Vec<NewMemory> = texts.iter().enumerate().map(|(i, t)| chat(i, t)).collect::<anyhow::Result<_>>()?;
    for chunk in rows.chunks(500) {
        store.remember_many(chunk).await?;
    }
    let started = Instant::now();
    let stop = start_worker(&env, &url, args.batch, embedder.clone(), JudgeQueue::Off)?;
    wait_embedded(&store, embedder.model(), args.rows, Duration::from_secs(3600)).await?;
    let elapsed = started.elapsed();
    let _ = stop.send(());
    let rate = args.rows as f64 / elapsed.as_secs_f64();
    let (rows_embedded, calls, _) = batch_rows();
    let mean_batch = rows_embedded / calls.max(1.0);
    eprintln!("mean rows per model call in the pipeline: {mean_batch:.1}");
    let report = json!({ "scenario": "pipeline", "rows": args.rows, "batch": args.batch, "seconds": elapsed.as_secs_f64(),
        "pipeline_rows_per_s": rate, "raw_rows_per_s": raw, "ratio": rate / raw, "mean_batch_rows": mean_batch });
    if args.corpus.json {
        println!("{report}");
    } else {
        println!("| rows | batch | pipeline rows/s | raw embedder rows/s | ratio |\n|---:|---:|---:|---:|---:|");
        println!("| {} | {} | {rate:.1} | {raw:.1} | {:.2} |", args.rows, args.batch, rate / raw);
    }
    Ok(())
}

/// `texts` as the worker embeds them when they are written in order into one session: each
/// with the one before it, when the worker reads a chat message's `previous_turn`.
fn as_embedded(texts: &[String], previous_turn: bool) -> Vec<String> {
    (0..texts.len())
        .map(|i| {
            let previous = (previous_turn && i > 0).then(|| texts[i - 1].as_str());
            mnemo_core::embedding_text(&texts[i], previous)
        })
        .collect()
}

/// The value of an unlabelled series in Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse::<f64>().ok())).unwrap_or(0.0)
}

pub async fn latency(args: LatencyArgs) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let short = corpus(&args.corpus.data)?.short;
    let (_, embedder) = local_embedder(&env)?;
    if let Some(load) = args.load.iter().find(|&&l| !(l > 0.0 && l <= 2.0)) {
        anyhow::bail!("--load takes fractions above 0 (at most 2), got {load}");
    }
    let batch = env.get(vars::EMBED_BATCH_SIZE).and_then(|b| b.parse().ok()).unwrap_or(32);
    // The machine's own speed, so that a load means the same on a faster or slower one: on the
    // texts as the worker will embed them (each row of the one session after the one before).
    let sample = &short[..short.len().min(1024)];
    let alone = raw_rate(embedder.as_ref(), sample, 32).await?;
    let previous_turn = WorkerSettings::from_env(&env)?.embed_previous_turn;
    let raw = if previous_turn { raw_rate(embedder.as_ref(), &as_embedded(sample, true), 32).await? } else { alone };
    let with = if previous_turn { "with the previous turn" } else { "alone" };
    eprintln!("raw embedder: {alone:.1} short texts/s at batch 32 alone, {raw:.1} as embedded ({with})");

    let mut levels = Vec::new();
    for &load in &args.load {
        let rate = load * raw;
        let (url, store) = fresh(&env).await?;
        let stop = start_worker(&env, &url, batch, embedder.clone(), JudgeQueue::Off)?;
        tokio::time::sleep(Duration::from_secs(2)).await; // the worker connects and listens
        let before = batch_rows();
        let started = Instant::now();

        let total = (rate * args.seconds as f64).round() as usize;
        let mut timer = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let writes = mnemo_store::GroupCommit::start(store.clone(), 2, 64, std::time::Duration::from_secs(35));
        let written = Arc::new(std::sync::Mutex::new(Vec::with_capacity(total)));
        let deleting = (args.deletes_per_s > 0.0).then(|| {
            tokio::spawn(delete_while_writing(store.clone(), written.clone(), args.deletes_per_s, args.seconds))
        });
        let mut pending = Vec::with_capacity(total);
        for (i, text) in cycle(&short, total).iter().enumerate() {
            timer.tick().await;
            let (writes, written) = (writes.clone(), written.clone());
            let row = chat(i, text)?;
            pending.push(tokio::spawn(async move {
                let remembered = writes.remember(row).await?;
                written.lock().expect("written").push(remembered.id);
                Ok::<_, mnemo_store::StoreError>(remembered)
            }));
        }
        for p in pending {
            p.await??;
        }
        let deletions = match deleting {
            Some(task) => task.await??,
            None => Histogram::<u64>::new(3)?,
        };
        wait_embedded(&store, embedder.model(), total, Duration::from_secs(600)).await?;
        let _ = stop.send(());
        let after = batch_rows();
        let calls = (after.1 - before.1).max(1.0);
        let mean_batch = (after.0 - before.0) / calls;
        // How long a model call took under this load, and the share of the level's time the
        // model was computing: near 1 the backlog can only grow.
        let model_seconds = after.2 - before.2;
        let model_ms_per_call = model_seconds * 1000.0 / calls;
        let model_busy = model_seconds / started.elapsed().as_secs_f64();

        let lags = store.embed_lag_seconds().await?;
        let mut h = Histogram::<u64>::new(3)?;
        for lag in &lags {
            h.record((lag * 1e6).max(1.0) as u64)?;
        }
        let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        let level = json!({ "load": load, "rate_per_s": rate, "rows": lags.len(), "mean_batch_rows": mean_batch,
            "model_ms_per_call": model_ms_per_call, "model_busy": model_busy,
            "p50_ms": ms(0.5), "p95_ms": ms(0.95), "p99_ms": ms(0.99), "max_ms": h.max() as f64 / 1000.0,
            "deletions": deletions.len(), "delete_p50_ms": deletions.value_at_quantile(0.5) as f64 / 1000.0,
            "delete_p99_ms": deletions.value_at_quantile(0.99) as f64 / 1000.0 });
        eprintln!("{level}");
        levels.push(level);
    }
    let report = json!({ "scenario": "embed-latency", "raw_batch32_per_s": raw, "raw_alone_batch32_per_s": alone,
        "previous_turn": previous_turn, "batch": batch, "levels": levels });
    if args.corpus.json {
        println!("{report}");
    } else {
        println!(
            "raw embedder at batch 32: {raw:.1} rows/s as embedded ({with}), {alone:.1} short texts/s alone; \
             worker batch {batch}\n"
        );
        println!(
            "| load | writes/s | rows | rows per model call | ms per model call | model busy | p50 ms | p95 ms | p99 ms | max ms |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for l in &levels {
            println!(
                "| {:.2} | {:.1} | {} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} |",
                l["load"].as_f64().unwrap_or(0.0),
                l["rate_per_s"].as_f64().unwrap_or(0.0),
                l["rows"],
                l["mean_batch_rows"].as_f64().unwrap_or(0.0),
                l["model_ms_per_call"].as_f64().unwrap_or(0.0),
                l["model_busy"].as_f64().unwrap_or(0.0),
                l["p50_ms"].as_f64().unwrap_or(0.0),
                l["p95_ms"].as_f64().unwrap_or(0.0),
                l["p99_ms"].as_f64().unwrap_or(0.0),
                l["max_ms"].as_f64().unwrap_or(0.0),
            );
        }
        if args.deletes_per_s > 0.0 {
            println!("\n| load | deletions | delete p50 ms | delete p99 ms |\n|---:|---:|---:|---:|");
            for l in &levels {
                println!(
                    "| {:.2} | {} | {:.2} | {:.2} |",
                    l["load"].as_f64().unwrap_or(0.0),
                    l["deletions"],
                    l["delete_p50_ms"].as_f64().unwrap_or(0.0),
                    l["delete_p99_ms"].as_f64().unwrap_or(0.0),
                );
            }
        }
    }
    Ok(())
}

/// Deletes, `per_s` a second for `seconds`, the oldest message written so far and not deleted,
/// once ten newer ones are written (each deleted through the store's `soft_delete`, as the API deletes),
/// and returns the deletions' latencies in microseconds.
async fn delete_while_writing(
    store: Store,
    written: Arc<std::sync::Mutex<Vec<uuid::Uuid>>>,
    per_s: f64,
    seconds: u64,
) -> anyhow::Result<Histogram<u64>> {
    let tenant = mnemo_core::TenantId::parse("bench")?;
    let mut timer = tokio::time::interval(Duration::from_secs_f64(1.0 / per_s));
    let (mut h, mut next) = (Histogram::<u64>::new(3)?, 0);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(seconds) {
        timer.tick().await;
        let id = {
            let written = written.lock().expect("written");
            if written.len() <= next + 10 {
                continue;
            }
            written[next]
        };
        next += 1;
        let t = Instant::now();
        store.soft_delete(&tenant, id, None, None, &[], "bench").await?;
        h.record((t.elapsed().as_micros() as u64).max(1))?;
    }
    Ok(h)
}

/// Rows embedded, model calls made and seconds spent in them so far in this process (the
/// pipeline's own histograms).
fn batch_rows() -> (f64, f64, f64) {
    let text = mnemo_config::metrics_handle().render();
    (
        metric(&text, "mnemo_embed_batch_rows_sum"),
        metric(&text, "mnemo_embed_batch_rows_count"),
        metric(&text, "mnemo_embed_model_seconds_sum"),
    )
}
