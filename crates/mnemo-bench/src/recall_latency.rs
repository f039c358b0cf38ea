//! Recall latency at scale: N rows in one tenant among several, built from LoCoMo turns, then
//! LoCoMo questions asked three ways: the search alone (query vector given, through
//! `mnemo-recall`), the same with a period named in each question, and end to end over HTTP with
//! the local embedder. Also reports index build times, table sizes, and how many of the exact
//! nearest neighbours the HNSW half finds.
//!
//! Embedding a million texts takes hours here, so rows are pairs of turns ("turn a turn b") and
//! their vectors the normalised sum of the two turns' model vectors. Rows are bulk-loaded with
//! `Store::bulk_load` (a load, not a measurement), then the full-text and vector indexes are built.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use mnemo_api::{AppState, ConnectionLimits, app};
use mnemo_config::{Env, RecallSettings, ServerSettings, vars};
use mnemo_core::{
    AgentId, MemoryText, Principal, RecallClass, RecallRequest, Scope, SessionId, SourceKind, SourceRef, TenantId,
    UserId,
};
use mnemo_recall::{PackRequest, PackTopK, Recall, RecallOptions, build_pack};
use mnemo_store::{BulkRow, SearchScope, Store};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::embedding::{fresh, local_embedder};
use crate::locomo;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rows in the tenant that is queried.
    #[arg(long, default_value_t = 100_000)]
    items: usize,
    /// Other tenants, each with a twentieth as many rows.
    #[arg(long, default_value_t = 4)]
    other_tenants: usize,
    /// Rows of one more tenant, a neighbour whose words the queried tenant's questions share
    /// (document chunks made the same way): what another tenant's size costs this one's recall.
    #[arg(long, default_value_t = 0)]
    neighbour_rows: usize,
    /// Rows of the queried tenant in the one session that is searched (the rest of the tenant's
    /// rows are documents, facts of a user and of an agent).
    #[arg(long, default_value_t = 1000)]
    session_rows: usize,
    /// Questions asked in each mode.
    #[arg(long, default_value_t = 300)]
    queries: usize,
    #[arg(long, default_value_t = 10)]
    top_k: usize,
    /// LoCoMo-format data: its turns make the rows, its questions the queries.
    #[arg(long, default_value = "../shared/bench/locomo/locomo-dev5.json")]
    data: PathBuf,
    /// Measure a database an earlier run loaded (its URL is printed) instead of loading anew.
    #[arg(long)]
    database_url: Option<String>,
    #[arg(long)]
    json: bool,
}

const MAIN: &str = "main";
const FACT_ROWS: usize = 200;
const LOAD_BATCH: usize = 5000;

/// Turns and questions of a LoCoMo file.
fn turns_and_questions(path: &Path) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let (mut turns, mut questions) = (Vec::new(), Vec::new());
    for sample in locomo::read(path)? {
        turns.extend(sample.turns().map(locomo::Turn::line));
        questions.extend(sample.qa.into_iter().filter_map(|qa| qa.question));
    }
    anyhow::ensure!(!turns.is_empty() && !questions.is_empty(), "no turns or questions in {}", path.display());
    Ok((turns, questions))
}

/// The queried tenant, with the session, user and agent whose rows it holds.
fn main_principal() -> anyhow::Result<Principal> {
    Ok(Principal {
        tenant: TenantId::parse(MAIN)?,
        user: Some(UserId::parse(MAIN)?),
        agent: Some(AgentId::parse(MAIN)?),
        session: Some(SessionId::parse(MAIN)?),
        roles: Vec::new(),
    })
}

fn unit(v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.into_iter().map(|x| x / norm).collect()
}

fn quantiles(h: &Histogram<u64>) -> Value {
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    json!({ "p50_ms": ms(0.5), "p95_ms": ms(0.95), "p99_ms": ms(0.99), "max_ms": h.max() as f64 / 1000.0, "queries": h.len() })
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let env = Env::from_process()?;
    let (turns, questions) = turns_and_questions(&args.data)?;
    let (_, embedder) = local_embedder(&env)?;
    let model = embedder.model().to_owned();
    let dims = embedder.dimensions();

    eprintln!("embedding {} turns and {} questions…", turns.len(), args.queries.min(questions.len()));
    let mut turn_vectors = Vec::with_capacity(turns.len());
    for chunk in turns.chunks(32) {
        turn_vectors.extend(embedder.embed(chunk).await.map_err(|e| anyhow::anyhow!("{e}"))?);
    }
    let questions: Vec<String> = questions.into_iter().take(args.queries).collect();
    let mut question_vectors = Vec::with_capacity(questions.len());
    for chunk in questions.chunks(32) {
        question_vectors.extend(embedder.embed(chunk).await.map_err(|e| anyhow::anyhow!("{e}"))?);
    }

    let (url, store, build) = match &args.database_url {
        Some(url) => (url.clone(), Store::connect(url, 8).await?, Value::Null),
        None => build(&args, &env, &turns, &turn_vectors, &model, dims).await?,
    };
    let footprint = store.footprint(&model, dims).await?;
    let total = footprint.memory_rows;
    let mib = |bytes: i64| bytes as f64 / (1 << 20) as f64;
    let sizes = json!({
        "memory_items_mib": mib(footprint.memory_items_bytes),
        "memory_embeddings_mib": mib(footprint.memory_embeddings_bytes),
        "fulltext_index_mib": mib(footprint.fulltext_index_bytes),
        "hnsw_index_mib": mib(footprint.vector_index_bytes.context("no HNSW index for the model")?),
    });

    let settings = RecallSettings::from_env(&env)?;
    let recall = Recall::new(store.clone(), embedder.clone(), None, settings);
    let who = main_principal()?;
    let request = |q: &str| -> anyhow::Result<RecallRequest> { Ok(RecallRequest::new(q)?.top_k(args.top_k)?) };

    // The search alone: query vectors given.
    // One pass over every question first: the figures are for a warm cache (the tables and
    // indexes fit in this machine's memory; a cold first pass reads them from disk).
    for (q, v) in questions.iter().zip(&question_vectors) {
        let options = RecallOptions { query_vector: Some(v.clone()), ..RecallOptions::default() };
        recall.recall_with(&who, &request(q)?, options).await?;
    }
    let mut search = Histogram::<u64>::new(3)?;
    let mut returned = 0;
    for (q, v) in questions.iter().zip(&question_vectors) {
        let options = RecallOptions { query_vector: Some(v.clone()), ..RecallOptions::default() };
        let t = Instant::now();
        returned += recall.recall_with(&who, &request(q)?, options).await?.items.len();
        search.record(t.elapsed().as_micros() as u64)?;
    }
    eprintln!("search alone: p50 {:.1} ms", search.value_at_quantile(0.5) as f64 / 1000.0);

    // The same questions naming this year: every class's newest rows of the period (here, all
    // of its rows) are ranked exactly as a third list, the most a named period costs.
    let year = chrono::Utc::now().format("%Y");
    let mut dated = Histogram::<u64>::new(3)?;
    for (q, v) in questions.iter().zip(&question_vectors) {
        let options = RecallOptions { query_vector: Some(v.clone()), ..RecallOptions::default() };
        let q = format!("{} (in {year})", q.trim_end_matches('?'));
        let t = Instant::now();
        recall.recall_with(&who, &request(&q)?, options).await?;
        dated.record(t.elapsed().as_micros() as u64)?;
    }
    eprintln!("search alone, a period named: p95 {:.1} ms", dated.value_at_quantile(0.95) as f64 / 1000.0);

    // A memory pack with golemcore's budgets and limits, query vectors given: the search with
    // its larger candidate window, the per-layer cut, token counting and rendering.
    let counter = mnemo_models::Tokenizer::new(mnemo_config::ContextSettings::from_env(&env)?.tokenizer);
    let mut pack = Histogram::<u64>::new(3)?;
    let mut packed_tokens = 0u64;
    for (q, v) in questions.iter().zip(&question_vectors) {
        let request = PackRequest {
            query: q.clone(),
            soft_budget_tokens: PackRequest::DEFAULT_SOFT_BUDGET,
            max_budget_tokens: PackRequest::DEFAULT_MAX_BUDGET,
            top_k: PackTopK::default(),
            placed_notes: None,
        };
        let options = RecallOptions { query_vector: Some(v.clone()), ..RecallOptions::default() };
        let t = Instant::now();
        packed_tokens += u64::from(build_pack(&recall, &counter, &who, &request, &options).await?.tokens);
        pack.record(t.elapsed().as_micros() as u64)?;
    }
    eprintln!("memory pack: p95 {:.1} ms", pack.value_at_quantile(0.95) as f64 / 1000.0);

    // End to end: HTTP, authentication, the query embedded by the local model.
    let secret = format!("bench-{}", Uuid::new_v4().simple());
    let server_env = env.clone().with(vars::DATABASE_URL, url.as_str()).with(vars::JWT_SECRET, secret.as_str());
    let server_settings = ServerSettings::from_env(&server_env)?;
    let state = AppState::new(store.clone(), &server_settings, embedder.clone()).map_err(anyhow::Error::msg)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}/v1/recall", listener.local_addr()?);
    tokio::spawn(mnemo_api::serve(
        listener,
        app(state),
        ConnectionLimits::of(&server_settings),
        std::future::pending(),
    ));
    let token =
        mnemo_api::auth::sign_hs256(secret.as_bytes(), &who, Duration::from_secs(3600)).map_err(anyhow::Error::msg)?;
    let http = reqwest::Client::new();
    let mut end_to_end = Histogram::<u64>::new(3)?;
    for (i, q) in questions.iter().enumerate() {
        let t = Instant::now();
        let response =
            http.post(&endpoint).bearer_auth(&token).json(&json!({ "query": q, "top_k": args.top_k })).send().await?;
        anyhow::ensure!(response.status().is_success(), "recall answered {}", response.status());
        response.bytes().await?;
        if i >= 20 {
            end_to_end.record(t.elapsed().as_micros() as u64)?;
        }
    }
    eprintln!("end to end: p50 {:.1} ms", end_to_end.value_at_quantile(0.5) as f64 / 1000.0);

    // How much of the exact top 10 of the tenant class the HNSW half finds.
    let classes = [RecallClass::Tenant];
    let scope = SearchScope {
        tenant: &who.tenant,
        classes: &classes,
        kinds: &[SourceKind::DocumentChunk],
        include_superseded: false,
        roles: &[],
        user: None,
    };
    let mut overlap = Vec::new();
    for v in question_vectors.iter().take(100) {
        let approximate = recall.search().vector(&scope, v, 10).await?;
        let approximate: HashSet<Uuid> = approximate.get(&Scope::Tenant).into_iter().flatten().copied().collect();
        let exact = recall.search().exact_tenant(&scope, v, 10).await?;
        overlap.push(exact.iter().filter(|id| approximate.contains(id)).count() as f64 / exact.len().max(1) as f64);
    }
    let hnsw_recall = overlap.iter().sum::<f64>() / overlap.len().max(1) as f64;

    let report = json!({
        "scenario": "recall-latency",
        "items": args.items,
        "session_rows": args.session_rows,
        "neighbour_rows": args.neighbour_rows,
        "rows_total": total,
        "build": build,
        "top_k": args.top_k,
        "mean_items_returned": returned as f64 / questions.len().max(1) as f64,
        "sizes": sizes,
        "search_alone": quantiles(&search),
        "search_alone_period_named": quantiles(&dated),
        "memory_pack_alone": quantiles(&pack),
        "memory_pack_mean_tokens": packed_tokens as f64 / questions.len().max(1) as f64,
        "end_to_end_http": quantiles(&end_to_end),
        "hnsw_recall_at_10_vs_exact": hnsw_recall,
    });
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// A fresh database with the rows loaded and every index built; returns its URL, a store on it
/// and the load and build times.
async fn build(
    args: &Args,
    env: &Env,
    turns: &[String],
    turn_vectors: &[Vec<f32>],
    model: &str,
    dims: usize,
) -> anyhow::Result<(String, Store, Value)> {
    let (url, store) = fresh(env).await?;
    // The HNSW build wants about 2 GB for a million vectors to stay in memory.
    store.set_maintenance_work_mem(2048).await?;
    // Built after the load: one build is far faster than a million inserts into it.
    let fulltext = store.drop_fulltext_index().await?;

    let mut rng = StdRng::seed_from_u64(42);
    let main = main_principal()?;
    let mut tenants = vec![(main.tenant.clone(), args.items)];
    for i in 1..=args.other_tenants {
        tenants.push((TenantId::parse(&format!("other-{i}"))?, args.items / 20));
    }
    if args.neighbour_rows > 0 {
        tenants.push((TenantId::parse("neighbour")?, args.neighbour_rows));
    }
    let total: usize = tenants.iter().map(|(_, n)| n).sum();
    let started = Instant::now();
    let mut loaded = 0;
    for (tenant, rows) in &tenants {
        let is_main = *tenant == main.tenant;
        let mut batch = Vec::with_capacity(LOAD_BATCH);
        for i in 0..*rows {
            let (a, b) = (rng.random_range(0..turns.len()), rng.random_range(0..turns.len()));
            let vector: Vec<f32> = turn_vectors[a].iter().zip(&turn_vectors[b]).map(|(x, y)| x + y).collect();
            // The queried tenant also has a session, a user's facts and an agent's facts.
            let (scope, kind) = match i {
                i if is_main && i < args.session_rows => (Scope::Session, SourceKind::ChatMessage),
                i if is_main && i < args.session_rows + FACT_ROWS => (Scope::User, SourceKind::Fact),
                i if is_main && i < args.session_rows + 2 * FACT_ROWS => (Scope::Agent, SourceKind::Fact),
                _ => (Scope::Tenant, SourceKind::DocumentChunk),
            };
            batch.push(BulkRow {
                id: Uuid::now_v7(),
                tenant: tenant.clone(),
                scope,
                session: main.session.clone().filter(|_| scope == Scope::Session),
                user: main.user.clone().filter(|_| scope == Scope::User),
                agent: main.agent.clone().filter(|_| scope == Scope::Agent),
                kind,
                source_ref: SourceRef::parse(&format!("r{i}"))?,
                content: MemoryText::parse(&format!("{} {}", turns[a], turns[b]))?,
                created_at: None,
                deleted_at: None,
                vector: Some(unit(vector)),
            });
            if batch.len() == LOAD_BATCH || i + 1 == *rows {
                loaded += batch.len();
                store.bulk_load(model, &std::mem::take(&mut batch)).await?;
                if loaded % 100_000 < LOAD_BATCH {
                    eprintln!("loaded {loaded}/{total} rows ({:.0} s)", started.elapsed().as_secs_f64());
                }
            }
        }
    }
    let load_s = started.elapsed().as_secs_f64();

    // Fresh connections pick up the database's maintenance_work_mem.
    let store = Store::connect(&url, 8).await?;
    eprintln!("building the full-text index…");
    let t = Instant::now();
    store.rebuild_index(fulltext).await?;
    let rum_s = t.elapsed().as_secs_f64();
    eprintln!("full-text index: {rum_s:.0} s; building the HNSW index…");
    let t = Instant::now();
    store.ensure_vector_index(model, dims).await?;
    let hnsw_s = t.elapsed().as_secs_f64();
    eprintln!("HNSW index: {hnsw_s:.0} s");
    store.count_lexemes().await?;
    store.vacuum_analyze_memories().await?;
    let report = json!({ "load_s": load_s, "fulltext_index_build_s": rum_s, "hnsw_index_build_s": hnsw_s, "tenants": tenants.len() });
    Ok((url, store, report))
}
