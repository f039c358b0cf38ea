//! Agent workspace memory: extraction and consolidation jobs per second against the scripted
//! model answering after a fixed delay, swept over how many jobs run at once (with the overhead
//! per job beyond the model's time, as the judge benchmark reports it), and how long
//! `GET /v1/workspace/prompt` takes for a user with a year of daily notes against one with none.
//!
//! Jobs run in this process, as a worker runs them (the same runners), each (agent, user) with
//! one conversation to extract and then one day's note to consolidate.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mnemo_config::{ContextSettings, Env, WorkspaceSettings, vars};
use mnemo_core::{AgentId, Principal, Queue, SessionId, TenantId, UserId, Workspace, WorkspacePath};
use mnemo_jobs::{ConsolidateReport, ConsolidateRunner, ExtractReport, ExtractRunner};
use mnemo_store::queue::{ConsolidateJob, ExtractJob};
use mnemo_testkit::ScriptedChat;
use serde_json::{Value, json};

use crate::context::LocalApi;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The scripted model's fixed delays, in milliseconds.
    #[arg(long, value_delimiter = ',', default_value = "0,200")]
    model_delays_ms: Vec<u64>,
    /// Jobs run at once (a worker's concurrency).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// (agent, user) pairs per delay and concurrency.
    #[arg(long, default_value_t = 48)]
    pairs: usize,
    /// Daily notes of the user whose prompt is timed.
    #[arg(long, default_value_t = 365)]
    notes: usize,
    /// Prompt calls timed per user.
    #[arg(long, default_value_t = 200)]
    calls: usize,
    #[arg(long)]
    json: bool,
}

const TENANT: &str = "bench";
const AGENT: &str = "helper";

fn who(user: &str, session: Option<&str>) -> anyhow::Result<Principal> {
    Ok(Principal {
        tenant: TenantId::parse(TENANT)?,
        user: Some(UserId::parse(user)?),
        agent: Some(AgentId::parse(AGENT)?),
        session: session.map(SessionId::parse).transpose()?,
        roles: Vec::new(),
    })
}

/// Writes a four-message conversation for `user` (a name and a fact to remember) and completes it.
async fn converse(api: &LocalApi, user: &str) -> anyhow::Result<()> {
    let sid = format!("{user}-s");
    let token = api.token(&who(user, Some(&sid))?)?;
    let lines = [
        ("user", "hello, my name is Ann and I plan a trip to the coast".to_owned()),
        ("assistant", "Nice to meet you, Ann. Where to?".to_owned()),
        ("user", format!("remember home_city: I live in city number {user}")),
        ("assistant", "Noted.".to_owned()),
    ];
    for (i, (role, content)) in lines.iter().enumerate() {
        let body = json!({ "source_kind": "chat_message", "source_ref": format!("{sid}-m{i}"), "role": role, "content": content });
        api.post("/memories", &token, &body, 201).await?;
    }
    let reply =
        api.post(&format!("/sessions/{sid}/complete"), &token, &json!({ "trigger_source": "web" }), 202).await?;
    anyhow::ensure!(reply["queued"] == true, "the conversation was not queued: {reply}");
    Ok(())
}

/// Runs `jobs` with `concurrency` at once; the wall time.
async fn run_all<J, F, Fut>(jobs: Vec<J>, concurrency: usize, run: F) -> anyhow::Result<Duration>
where
    J: Send + 'static,
    F: Fn(J) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    let queue = Arc::new(Mutex::new(jobs));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (queue, run) = (queue.clone(), run.clone());
        tasks.spawn(async move {
            loop {
                let next = queue.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.pop();
                let Some(job) = next else { return Ok::<_, anyhow::Error>(()) };
                run(job).await?;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(started.elapsed())
}

fn throughput(kind: &str, delay_ms: u64, concurrency: usize, jobs: usize, wall: Duration) -> Value {
    let seconds = wall.as_secs_f64();
    // Each job makes one model call; its share of the wall time beyond that call.
    let per_job_ms = seconds * 1000.0 * concurrency as f64 / jobs as f64;
    json!({
        "job": kind, "model_delay_ms": delay_ms, "concurrency": concurrency, "jobs": jobs,
        "jobs_per_s": jobs as f64 / seconds,
        "ideal_jobs_per_s": (delay_ms > 0).then(|| concurrency as f64 * 1000.0 / delay_ms as f64),
        "overhead_ms_per_job": per_job_ms - delay_ms as f64,
    })
}

async fn jobs_per_second(api: &LocalApi, args: &Args) -> anyhow::Result<Vec<Value>> {
    let mut results = Vec::new();
    for &delay in &args.model_delays_ms {
        let chat = ScriptedChat::start().await;
        chat.delay_every_answer(Duration::from_millis(delay));
        let env = Env::from_pairs([
            (vars::LLM_MODEL, "scripted"),
            (vars::LLM_BASE_URL, chat.base_url.as_str()),
            (vars::LLM_API_KEY, "bench"),
        ]);
        let (model, settings) = (ContextSettings::from_env(&env)?, WorkspaceSettings::from_env(&env)?);
        let extract = Arc::new(ExtractRunner {
            store: api.store.clone(),
            extractor: mnemo_models::extractor(&model, settings.max_file_bytes)?,
            worker: "bench".into(),
            settings: settings.extraction.clone(),
            max_file_bytes: settings.max_file_bytes,
            max_memory_tokens: settings.consolidation.max_memory_tokens,
            counter: Arc::new(mnemo_models::Tokenizer::new(model.tokenizer)),
            stale_after: Duration::from_secs(600),
            consolidation_throttle: settings.consolidation.after_extraction(),
        });
        let consolidate = Arc::new(ConsolidateRunner {
            store: api.store.clone(),
            consolidator: mnemo_models::consolidator(&model)?,
            counter: Arc::new(mnemo_models::Tokenizer::new(model.tokenizer)),
            worker: "bench".into(),
            settings: settings.consolidation.clone(),
            stale_after: Duration::from_secs(600),
        });
        for &concurrency in &args.concurrency {
            let users: Vec<String> = (0..args.pairs).map(|i| format!("d{delay}-c{concurrency}-u{i}")).collect();
            for user in &users {
                converse(api, user).await?;
            }
            let pair = |user: &String| -> anyhow::Result<(TenantId, AgentId, UserId)> {
                Ok((TenantId::parse(TENANT)?, AgentId::parse(AGENT)?, UserId::parse(user)?))
            };
            let jobs = users
                .iter()
                .map(|u| pair(u).map(|(tenant_id, agent_id, user_id)| ExtractJob { tenant_id, agent_id, user_id }))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let runner = extract.clone();
            let wall = run_all(jobs, concurrency, move |job| {
                let runner = runner.clone();
                async move {
                    match runner.run(&job).await? {
                        ExtractReport::Applied { .. } => Ok(()),
                        other => anyhow::bail!("extraction did not apply: {other:?}"),
                    }
                }
            })
            .await?;
            results.push(throughput(Queue::Extract.as_str(), delay, concurrency, users.len(), wall));

            let jobs = users
                .iter()
                .map(|u| pair(u).map(|(tenant_id, agent_id, user_id)| ConsolidateJob { tenant_id, agent_id, user_id }))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let runner = consolidate.clone();
            let wall = run_all(jobs, concurrency, move |job| {
                let runner = runner.clone();
                async move {
                    match runner.run(&job).await? {
                        ConsolidateReport::Updated { .. } => Ok(()),
                        other => anyhow::bail!("consolidation did not update: {other:?}"),
                    }
                }
            })
            .await?;
            results.push(throughput(Queue::Consolidate.as_str(), delay, concurrency, users.len(), wall));
            eprintln!("delay {delay} ms, concurrency {concurrency}: done");
        }
    }
    Ok(results)
}

/// Four entries of a day's note.
fn day_note(day: chrono::NaiveDate) -> String {
    let entries = [
        "- Asked about train times to Lyon; prefers the morning departures.",
        "- Booked a table for four at the Italian place for Friday at seven.",
        "- Talked through the quarterly numbers; the report is due next week.",
        "- Mentioned the cat's new diet and the vet visit on Tuesday.",
    ];
    format!("# {day}\n\n{}\n", entries.join("\n"))
}

/// `GET /v1/workspace/prompt` latency for a user with `notes` daily notes (ending today) and a
/// full MEMORY.md, and for a user with only the core files.
async fn prompt_latency(api: &LocalApi, notes: usize, calls: usize) -> anyhow::Result<Vec<Value>> {
    let tenant = TenantId::parse(TENANT)?;
    let (_, today) = api.store.tenant_today(&tenant).await?;
    let mut results = Vec::new();
    for (user, notes) in [("prompt-none", 0), ("prompt-year", notes)] {
        let principal = who(user, None)?;
        let workspace = Workspace::of(&principal)?;
        let token = api.token(&principal)?;
        let started = Instant::now();
        for back in 0..notes {
            let day = today - chrono::Days::new(back as u64);
            let key = workspace.file(WorkspacePath::daily_note(day))?;
            api.store.write_file(&key, &day_note(day), "api", None).await?;
        }
        if notes > 0 {
            let memory = (0..120).map(|i| format!("- Durable fact number {i} about the user's habits and plans.\n"));
            let key = workspace.file(WorkspacePath::parse("MEMORY.md")?)?;
            api.store.write_file(&key, &format!("# MEMORY.md\n\n{}", memory.collect::<String>()), "api", None).await?;
        }
        eprintln!("{user}: {notes} notes written in {:.1} s", started.elapsed().as_secs_f64());
        let url = format!("{}/workspace/prompt", api.base);
        let mut histogram = Histogram::<u64>::new(3)?;
        let mut tokens = Value::Null;
        for call in 0..=calls {
            let t = Instant::now();
            let response = api.http.get(&url).bearer_auth(&token).send().await?;
            anyhow::ensure!(response.status().as_u16() == 200, "prompt answered {}", response.status());
            let body: Value = response.json().await?;
            // The first call creates the core files and warms the connection.
            if call > 0 {
                histogram.record(t.elapsed().as_micros() as u64)?;
            }
            tokens = body["tokens"].clone();
        }
        let ms = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
        results.push(json!({ "daily_notes": notes, "prompt_tokens": tokens,
                             "p50_ms": ms(0.5), "p95_ms": ms(0.95), "p99_ms": ms(0.99) }));
    }
    Ok(results)
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let api = LocalApi::start(&env).await?;
    let jobs = jobs_per_second(&api, &args).await?;
    let prompts = prompt_latency(&api, args.notes, args.calls).await?;
    if args.json {
        println!("{}", json!({ "scenario": "workspace", "jobs": jobs, "prompts": prompts }));
        return Ok(());
    }
    println!("| job | model delay ms | concurrency | jobs | jobs/s | ideal jobs/s | overhead ms/job |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &jobs {
        println!(
            "| {} | {} | {} | {} | {:.1} | {} | {:.1} |",
            r["job"].as_str().unwrap_or(""),
            r["model_delay_ms"],
            r["concurrency"],
            r["jobs"],
            r["jobs_per_s"].as_f64().unwrap_or(0.0),
            r["ideal_jobs_per_s"].as_f64().map_or("-".to_owned(), |v| format!("{v:.1}")),
            r["overhead_ms_per_job"].as_f64().unwrap_or(0.0),
        );
    }
    println!();
    println!("| daily notes | prompt tokens | p50 ms | p95 ms | p99 ms |");
    println!("|---:|---:|---:|---:|---:|");
    for r in &prompts {
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} |",
            r["daily_notes"],
            r["prompt_tokens"],
            r["p50_ms"].as_f64().unwrap_or(0.0),
            r["p95_ms"].as_f64().unwrap_or(0.0),
            r["p99_ms"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(())
}
