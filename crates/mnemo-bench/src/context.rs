//! Context windows: how long `POST /v1/sessions/{sid}/context` takes for sessions of 100, 1,000
//! and 10,000 messages never compacted (over HTTP, to the API in this process, the answer parsed
//! by the client; no model involved), at a budget
//! that holds everything for the small sessions and at a tight one; what a compaction job costs
//! beyond its model calls, against the scripted model with a fixed delay; and how fast each
//! tokenizer counts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mnemo_api::{AppState, ConnectionLimits, app};
use mnemo_config::{ContextSettings, DatabaseSettings, Env, ServerSettings, TokenizerName, vars};
use mnemo_core::{CompactionOutcome, CompactionTrigger, Principal, SessionId, TenantId, TokenCounter};
use mnemo_jobs::{CompactPolicy, CompactReport, Compactor};
use mnemo_store::queue::CompactJob;
use mnemo_store::{Store, with_database};
use mnemo_testkit::ScriptedChat;
use serde_json::{Value, json};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Session sizes, in messages.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000")]
    sessions: Vec<usize>,
    /// Context calls timed per session and budget.
    #[arg(long, default_value_t = 200)]
    calls: usize,
    /// Compaction jobs timed against the scripted model, per delay.
    #[arg(long, default_value_t = 20)]
    compactions: usize,
    /// The scripted model's fixed delays, in milliseconds.
    #[arg(long, value_delimiter = ',', default_value = "0,200")]
    model_delays_ms: Vec<u64>,
    #[arg(long)]
    json: bool,
}

/// Sentences a session's messages are made of (a conversation's usual length per turn).
const SENTENCES: [&str; 6] = [
    "I finally booked the flight to Lisbon for the conference in May.",
    "Can you remind me what the vet said about the cat's diet last week?",
    "The quarterly report is due on Friday, and the numbers still don't add up.",
    "We moved the database migration to Sunday night so nobody notices the downtime.",
    "My sister's birthday dinner is at the Italian place on Elm Street at seven.",
    "Sure, I pulled the numbers: 1,284 orders last week, up 12% on the week before.",
];

fn text(i: usize) -> String {
    (0..1 + i % 4).map(|k| SENTENCES[(i + k) % SENTENCES.len()]).collect::<Vec<_>>().join(" ")
}

/// Message `i` of session `s`: user and assistant turns, and every tenth turn an assistant's tool
/// call followed by its result. Source refs name the session: they are unique per tenant.
fn message(s: usize, i: usize) -> Value {
    let (kind, source_ref, role) = match i % 10 {
        8 => ("chat_message", format!("s{s}-m{i}"), "assistant"),
        9 => ("tool_output", format!("s{s}-call-{}", i - 1), "tool"),
        n if n % 2 == 0 => ("chat_message", format!("s{s}-m{i}"), "user"),
        _ => ("chat_message", format!("s{s}-m{i}"), "assistant"),
    };
    let mut body = json!({ "source_kind": kind, "source_ref": source_ref, "role": role, "content": text(i) });
    if i % 10 == 8 {
        body["tool_call_id"] = json!(format!("s{s}-call-{i}"));
        body["name"] = json!("search");
        body["content"] = json!("{\"query\": \"orders\"}");
    }
    body
}

/// The API served in this process on a fresh database, and a client for it.
pub(crate) struct LocalApi {
    /// `http://127.0.0.1:PORT/v1`.
    pub base: String,
    /// The fresh database's URL.
    pub url: String,
    pub store: Store,
    pub settings: ServerSettings,
    pub http: reqwest::Client,
    secret: String,
}

impl LocalApi {
    pub async fn start(env: &Env) -> anyhow::Result<Self> {
        let database = DatabaseSettings::from_env(env)?;
        let db = crate::bench_database(&database).await?;
        let secret = format!("bench-{}", uuid::Uuid::new_v4().simple());
        let mut server_env =
            env.clone().with(vars::DATABASE_URL, db.url.as_str()).with(vars::JWT_SECRET, secret.as_str());
        if let Some(replica) = &database.read_url {
            // A replica's URL names a database; the bench's own has a fresh name.
            server_env = server_env.with(vars::READ_DATABASE_URL, with_database(replica.expose(), &db.name));
        }
        let settings = ServerSettings::from_env(&server_env)?;
        let store = Store::connect(&db.url, 20).await?;
        let embedder = mnemo_models::embedder(&settings.embed)?;
        let state = AppState::new(store.clone(), &settings, embedder).map_err(anyhow::Error::msg)?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}/v1", listener.local_addr()?);
        tokio::spawn(mnemo_api::serve(listener, app(state), ConnectionLimits::of(&settings), std::future::pending()));
        let http = reqwest::Client::builder().pool_max_idle_per_host(16).build()?;
        Ok(Self { base, url: db.url, store, settings, http, secret })
    }

    /// A token for `principal`, valid for an hour.
    pub fn token(&self, principal: &Principal) -> anyhow::Result<String> {
        mnemo_api::auth::sign_hs256(self.secret.as_bytes(), principal, Duration::from_secs(3600))
            .map_err(anyhow::Error::msg)
    }

    /// Posts `body` to `path` (under `/v1`) and checks the status.
    pub async fn post(&self, path: &str, token: &str, body: &Value, expect: u16) -> anyhow::Result<Value> {
        let r = self.http.post(format!("{}{path}", self.base)).bearer_auth(token).json(body).send().await?;
        let status = r.status().as_u16();
        let reply: Value = r.json().await.unwrap_or(Value::Null);
        anyhow::ensure!(status == expect, "{path} answered {status}: {reply}");
        Ok(reply)
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let api = LocalApi::start(&env).await?;
    let (base, store, http) = (&api.base, &api.store, &api.http);

    let mut results = Vec::new();
    for &size in &args.sessions {
        let principal = Principal {
            tenant: TenantId::parse("bench")?,
            user: None,
            agent: None,
            session: Some(SessionId::parse(&format!("session-{size}"))?),
            roles: Vec::new(),
        };
        let token = api.token(&principal)?;
        let started = Instant::now();
        // One at a time, so the session's order is the order written.
        for i in 0..size {
            let r = http.post(format!("{base}/memories")).bearer_auth(&token).json(&message(size, i)).send().await?;
            anyhow::ensure!(r.status().as_u16() == 201, "write {i} answered {}", r.status());
        }
        eprintln!("session of {size} messages written in {:.1} s", started.elapsed().as_secs_f64());
        // As autovacuum would soon after: the visibility map lets the count after a compaction
        // read the index alone.
        store.vacuum_analyze_memories().await?;
        for budget in [128_000u64, 8_000] {
            let url = format!("{base}/sessions/session-{size}/context");
            let body = json!({ "max_input_tokens": budget, "system_prompt": "You are a helpful assistant.",
                               "current_message": "What did we decide about the migration?" });
            let mut histogram = Histogram::<u64>::new(3)?;
            let mut last = Value::Null;
            for call in 0..=args.calls {
                let t = Instant::now();
                let response = http.post(&url).bearer_auth(&token).json(&body).send().await?;
                anyhow::ensure!(response.status().as_u16() == 200, "context answered {}", response.status());
                last = response.json().await?;
                // The first call warms the connection and the caches.
                if call > 0 {
                    histogram.record(t.elapsed().as_micros() as u64)?;
                }
            }
            let d = &last["diagnostics"];
            results.push(json!({
                "messages": size, "max_input_tokens": budget,
                "p50_ms": histogram.value_at_quantile(0.5) as f64 / 1000.0,
                "p95_ms": histogram.value_at_quantile(0.95) as f64 / 1000.0,
                "p99_ms": histogram.value_at_quantile(0.99) as f64 / 1000.0,
                "tokens": d["tokens"]["total"], "kept": d["messages_kept"], "dropped": d["messages_dropped"],
            }));
        }
    }

    let mut compactions = Vec::new();
    for &delay in &args.model_delays_ms {
        let timing = compaction_overhead(&api, &api.settings.context, delay, args.compactions).await?;
        compactions.push(timing);
    }

    // Tokenizer throughput over the same kind of text.
    let corpus: Vec<String> = (0..20_000).map(text).collect();
    let mut tokenizers = Vec::new();
    for name in TokenizerName::ALL {
        let tokenizer = mnemo_models::Tokenizer::new(name);
        tokenizer.count("warm up");
        let t = Instant::now();
        let tokens: u64 = corpus.iter().map(|s| u64::from(tokenizer.count(s))).sum();
        let seconds = t.elapsed().as_secs_f64();
        tokenizers.push(json!({ "tokenizer": name.as_str(), "tokens": tokens, "tokens_per_s": tokens as f64 / seconds,
                                "texts_per_s": corpus.len() as f64 / seconds }));
    }

    if args.json {
        println!(
            "{}",
            json!({ "scenario": "context", "windows": results, "tokenizers": tokenizers, "compactions": compactions })
        );
        return Ok(());
    }
    println!("| messages | max_input_tokens | p50 ms | p95 ms | p99 ms | window tokens | kept | dropped |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &results {
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {} | {} | {} |",
            r["messages"],
            r["max_input_tokens"],
            r["p50_ms"].as_f64().unwrap_or(0.0),
            r["p95_ms"].as_f64().unwrap_or(0.0),
            r["p99_ms"].as_f64().unwrap_or(0.0),
            r["tokens"],
            r["kept"],
            r["dropped"]
        );
    }
    println!();
    println!(
        "| model delay ms | jobs | messages/job | model calls/job | job p50 ms | job p95 ms | overhead p50 ms | overhead p95 ms |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for c in &compactions {
        println!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            c["model_delay_ms"],
            c["jobs"],
            c["messages_per_job"],
            c["model_calls_per_job"],
            c["job_p50_ms"].as_f64().unwrap_or(0.0),
            c["job_p95_ms"].as_f64().unwrap_or(0.0),
            c["overhead_p50_ms"].as_f64().unwrap_or(0.0),
            c["overhead_p95_ms"].as_f64().unwrap_or(0.0)
        );
    }
    println!();
    println!("| tokenizer | tokens/s | texts/s |");
    println!("|---|---:|---:|");
    for t in &tokenizers {
        println!(
            "| {} | {:.0} | {:.0} |",
            t["tokenizer"].as_str().unwrap_or(""),
            t["tokens_per_s"].as_f64().unwrap_or(0.0),
            t["texts_per_s"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}

/// Messages per session a timed compaction covers (it keeps the last two turns).
const COMPACTED_SESSION: usize = 60;

/// Times compaction jobs against the testkit's scripted model answering after `delay_ms`: each
/// job compacts a fresh session of [`COMPACTED_SESSION`] messages. Its overhead is the job's wall
/// time less the model's delay on each of its calls: reading, the pre-pass, writing the summary
/// row and the record.
async fn compaction_overhead(
    api: &LocalApi,
    context: &ContextSettings,
    delay_ms: u64,
    jobs: usize,
) -> anyhow::Result<Value> {
    let chat = ScriptedChat::start().await;
    chat.delay_every_answer(Duration::from_millis(delay_ms));
    let env = Env::from_pairs([
        (vars::LLM_MODEL, "scripted"),
        (vars::LLM_BASE_URL, chat.base_url.as_str()),
        (vars::LLM_API_KEY, "bench"),
    ]);
    let model = ContextSettings::from_env(&env)?;
    let compactor = Compactor {
        store: api.store.clone(),
        summarizer: mnemo_models::summarizer(&model)?,
        counter: Arc::new(mnemo_models::Tokenizer::new(context.tokenizer)),
        policy: CompactPolicy::from_settings(context),
        // Compaction's own cost: its sessions have no agent to extract for.
        extraction: None,
    };
    let (mut job_times, mut overheads) = (Histogram::<u64>::new(3)?, Histogram::<u64>::new(3)?);
    let (mut messages, mut calls) = (0usize, 0usize);
    for j in 0..jobs {
        let sid = format!("compact-{delay_ms}-{j}");
        let principal = Principal {
            tenant: TenantId::parse("bench")?,
            user: None,
            agent: None,
            session: Some(SessionId::parse(&sid)?),
            roles: Vec::new(),
        };
        let token = api.token(&principal)?;
        for i in 0..COMPACTED_SESSION {
            let mut body = message(1_000_000 + j * 1000 + delay_ms as usize * 100_000, i);
            body["session_id"] = json!(sid);
            api.post("/memories", &token, &body, 201).await?;
        }
        let before = chat.requests().len();
        let job = CompactJob {
            tenant_id: principal.tenant.clone(),
            session_id: SessionId::parse(&sid)?,
            trigger: CompactionTrigger::Operator,
            keep: None,
            keep_at_most: None,
            summary_failures: 0,
        };
        let t = Instant::now();
        let report = compactor.run(&job).await?;
        let elapsed = t.elapsed();
        let CompactReport::Compacted { messages: covered, outcome: CompactionOutcome::Summarized, .. } = report else {
            anyhow::bail!("compaction did not summarize: {report:?}");
        };
        let made = chat.requests().len() - before;
        messages += covered;
        calls += made;
        job_times.record(elapsed.as_micros() as u64)?;
        let model_time = Duration::from_millis(delay_ms * made as u64);
        overheads.record(elapsed.saturating_sub(model_time).as_micros() as u64)?;
    }
    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    Ok(json!({
        "model_delay_ms": delay_ms, "jobs": jobs,
        "messages_per_job": messages / jobs.max(1), "model_calls_per_job": calls / jobs.max(1),
        "job_p50_ms": ms(&job_times, 0.5), "job_p95_ms": ms(&job_times, 0.95),
        "overhead_p50_ms": ms(&overheads, 0.5), "overhead_p95_ms": ms(&overheads, 0.95),
    }))
}
