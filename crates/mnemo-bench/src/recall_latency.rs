//! Recall latency at scale: N rows in one tenant among several, built from LoCoMo turns, then
//! LoCoMo questions asked twice: the search alone (query vector given, through `mnemo-recall`)
//! and end to end over HTTP with the local embedder. Also reports index build times, table
//! sizes, and how many of the exact nearest neighbours the HNSW half finds.
//!
//! Embedding a million texts takes hours here, so rows are pairs of turns ("turn a turn b") and
//! their vectors the normalised sum of the two turns' model vectors. Rows are bulk-loaded with
//! SQL (a load, not a measurement), then the full-text and vector indexes are built.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use mnemo_api::{AppState, app};
use mnemo_config::{Env, RecallSettings, ServerSettings, vars};
use mnemo_core::{AgentId, Principal, RecallClass, RecallRequest, Scope, SessionId, SourceKind, TenantId, UserId};
use mnemo_recall::{Recall, RecallOptions};
use mnemo_store::{SearchScope, Store};
use pgvector::Vector;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::embedding::{fresh, local_embedder};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rows in the tenant that is queried.
    #[arg(long, default_value_t = 100_000)]
    items: usize,
    /// Other tenants, each with a twentieth as many rows.
    #[arg(long, default_value_t = 4)]
    other_tenants: usize,
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
const SESSION_ROWS: usize = 1000;
const FACT_ROWS: usize = 200;
const LOAD_BATCH: usize = 5000;

/// Turns and questions of a LoCoMo file.
fn locomo(path: &PathBuf) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let raw = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let samples: Vec<Value> = serde_json::from_str(&raw).context("LoCoMo JSON")?;
    let (mut turns, mut questions) = (Vec::new(), Vec::new());
    for sample in &samples {
        for (key, session) in sample["conversation"].as_object().into_iter().flatten() {
            if key.starts_with("session_") {
                for turn in session.as_array().into_iter().flatten() {
                    if let (Some(speaker), Some(text)) = (turn["speaker"].as_str(), turn["text"].as_str()) {
                        turns.push(format!("{speaker}: {text}"));
                    }
                }
            }
        }
        for qa in sample["qa"].as_array().into_iter().flatten() {
            questions.extend(qa["question"].as_str().map(str::to_owned));
        }
    }
    anyhow::ensure!(!turns.is_empty() && !questions.is_empty(), "no turns or questions in {}", path.display());
    Ok((turns, questions))
}

fn unit(v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.into_iter().map(|x| x / norm).collect()
}

/// One row to load: its tenant, class and identity, text and vector.
struct Row {
    tenant: String,
    scope: &'static str,
    kind: &'static str,
    identity: Option<&'static str>,
    source_ref: String,
    content: String,
    vector: Vector,
}

async fn load(store: &Store, model: &str, rows: Vec<Row>) -> anyhow::Result<()> {
    let column = |f: &dyn Fn(&Row) -> Option<String>| rows.iter().map(f).collect::<Vec<_>>();
    let ids: Vec<Uuid> = rows.iter().map(|_| Uuid::now_v7()).collect();
    let tenants = column(&|r| Some(r.tenant.clone()));
    let scopes = column(&|r| Some(r.scope.to_owned()));
    let kinds = column(&|r| Some(r.kind.to_owned()));
    let sessions = column(&|r| (r.scope == "session").then(|| r.identity.unwrap_or_default().to_owned()));
    let users = column(&|r| (r.scope == "user").then(|| r.identity.unwrap_or_default().to_owned()));
    let agents = column(&|r| (r.scope == "agent").then(|| r.identity.unwrap_or_default().to_owned()));
    let refs = column(&|r| Some(r.source_ref.clone()));
    let contents = column(&|r| Some(r.content.clone()));
    let vectors: Vec<Vector> = rows.into_iter().map(|r| r.vector).collect();
    let mut tx = store.pool().begin().await?;
    sqlx::query(
        "INSERT INTO memory_items (id, tenant_id, scope, session_id, user_id, agent_id, source_kind, source_ref,
                                   content, content_sha256, event_time, embedded_model)
         SELECT id, tenant, scope, session, usr, agent, kind, ref, content, sha256(convert_to(content, 'UTF8')), now(), $10
         FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::text[])
              AS r(id, tenant, scope, session, usr, agent, kind, ref, content)",
    )
    .bind(&ids)
    .bind(&tenants)
    .bind(&scopes)
    .bind(&sessions)
    .bind(&users)
    .bind(&agents)
    .bind(&kinds)
    .bind(&refs)
    .bind(&contents)
    .bind(model)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO memory_embeddings (tenant_id, item_id, model, embedding, content_sha256)
         SELECT m.tenant_id, m.id, $3, v.embedding, m.content_sha256
         FROM unnest($1::uuid[], $2::vector[]) AS v(id, embedding) JOIN memory_items m ON m.id = v.id",
    )
    .bind(&ids)
    .bind(&vectors)
    .bind(model)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

fn quantiles(h: &Histogram<u64>) -> Value {
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    json!({ "p50_ms": ms(0.5), "p95_ms": ms(0.95), "p99_ms": ms(0.99), "max_ms": h.max() as f64 / 1000.0, "queries": h.len() })
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let env = Env::from_process();
    let (turns, questions) = locomo(&args.data)?;
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
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM memory_items").fetch_one(store.pool()).await?;

    let size = |sql: &'static str| {
        let store = store.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(store.pool()).await }
    };
    let mib = |bytes: i64| bytes as f64 / (1 << 20) as f64;
    let sizes = json!({
        "memory_items_mib": mib(size("SELECT pg_total_relation_size('memory_items')").await?),
        "memory_embeddings_mib": mib(size("SELECT pg_total_relation_size('memory_embeddings')").await?),
        "fulltext_index_mib": mib(size("SELECT pg_relation_size('memory_items_tsv_idx')").await?),
        "hnsw_index_mib": mib(size(
            "SELECT pg_relation_size(c.oid)::bigint FROM pg_class c WHERE c.relname LIKE 'memory_embeddings_hnsw_%' LIMIT 1"
        ).await?),
    });

    let settings = RecallSettings::from_env(&env)?;
    let recall = Recall::new(store.clone(), embedder.clone(), None, settings);
    let who = Principal {
        tenant: TenantId::parse(MAIN)?,
        user: Some(UserId::parse(MAIN)?),
        agent: Some(AgentId::parse(MAIN)?),
        session: Some(SessionId::parse(MAIN)?),
    };
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

    // End to end: HTTP, authentication, the query embedded by the local model.
    let secret = format!("bench-{}", Uuid::new_v4().simple());
    let server_env = env.clone().with(vars::DATABASE_URL, url.as_str()).with(vars::JWT_SECRET, secret.as_str());
    let server_settings = ServerSettings::from_env(&server_env)?;
    let state = AppState::new(store.clone(), &server_settings, embedder.clone()).map_err(anyhow::Error::msg)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}/v1/recall", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app(state)).await });
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
    };
    let mut overlap = Vec::new();
    for v in question_vectors.iter().take(100) {
        let approximate = recall.search().vector(&scope, v, 10).await?;
        let approximate: HashSet<Uuid> = approximate.get(&Scope::Tenant).into_iter().flatten().copied().collect();
        let exact: Vec<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT m.id FROM memory_embeddings e JOIN memory_items m ON m.id = e.item_id
             WHERE e.model = $1 AND e.tenant_id = $2 AND m.scope = 'tenant'
             ORDER BY (e.embedding::vector({dims}) <=> $3::vector({dims})) + 0 LIMIT 10"
        )))
        .bind(&model)
        .bind(MAIN)
        .bind(Vector::from(v.clone()))
        .fetch_all(store.pool())
        .await?;
        overlap.push(exact.iter().filter(|id| approximate.contains(id)).count() as f64 / exact.len().max(1) as f64);
    }
    let hnsw_recall = overlap.iter().sum::<f64>() / overlap.len().max(1) as f64;

    let report = json!({
        "scenario": "recall-latency",
        "items": args.items,
        "rows_total": total,
        "build": build,
        "top_k": args.top_k,
        "mean_items_returned": returned as f64 / questions.len().max(1) as f64,
        "sizes": sizes,
        "search_alone": quantiles(&search),
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
    sqlx::raw_sql(
        "DO $$ BEGIN
            EXECUTE format('ALTER DATABASE %I SET maintenance_work_mem = ''2GB''', current_database());
        END $$",
    )
    .execute(store.pool())
    .await?;
    // Built after the load: one build is far faster than a million inserts into it.
    sqlx::query("DROP INDEX memory_items_tsv_idx").execute(store.pool()).await?;

    let mut rng = StdRng::seed_from_u64(42);
    let mut tenants = vec![(MAIN.to_owned(), args.items)];
    tenants.extend((1..=args.other_tenants).map(|i| (format!("other-{i}"), args.items / 20)));
    let total: usize = tenants.iter().map(|(_, n)| n).sum();
    let started = Instant::now();
    let mut loaded = 0;
    for (tenant, rows) in &tenants {
        let mut batch = Vec::with_capacity(LOAD_BATCH);
        for i in 0..*rows {
            let (a, b) = (rng.random_range(0..turns.len()), rng.random_range(0..turns.len()));
            let vector: Vec<f32> = turn_vectors[a].iter().zip(&turn_vectors[b]).map(|(x, y)| x + y).collect();
            // The queried tenant also has a session, a user's facts and an agent's facts.
            let (scope, kind, identity) = match i {
                i if tenant == MAIN && i < SESSION_ROWS => ("session", "chat_message", Some(MAIN)),
                i if tenant == MAIN && i < SESSION_ROWS + FACT_ROWS => ("user", "fact", Some(MAIN)),
                i if tenant == MAIN && i < SESSION_ROWS + 2 * FACT_ROWS => ("agent", "fact", Some(MAIN)),
                _ => ("tenant", "document_chunk", None),
            };
            batch.push(Row {
                tenant: tenant.clone(),
                scope,
                kind,
                identity,
                source_ref: format!("r{i}"),
                content: format!("{} {}", turns[a], turns[b]),
                vector: Vector::from(unit(vector)),
            });
            if batch.len() == LOAD_BATCH || i + 1 == *rows {
                loaded += batch.len();
                load(&store, model, std::mem::take(&mut batch)).await?;
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
    sqlx::query(
        "CREATE INDEX memory_items_tsv_idx ON memory_items USING rum (tsv rum_tsvector_ops)
         WHERE deleted_at IS NULL AND anonymized_at IS NULL",
    )
    .execute(store.pool())
    .await?;
    let rum_s = t.elapsed().as_secs_f64();
    eprintln!("full-text index: {rum_s:.0} s; building the HNSW index…");
    let t = Instant::now();
    store.ensure_vector_index(model, dims).await?;
    let hnsw_s = t.elapsed().as_secs_f64();
    eprintln!("HNSW index: {hnsw_s:.0} s");
    sqlx::query("VACUUM ANALYZE memory_items").execute(store.pool()).await?;
    sqlx::query("VACUUM ANALYZE memory_embeddings").execute(store.pool()).await?;
    let report = json!({ "load_s": load_s, "fulltext_index_build_s": rum_s, "hnsw_index_build_s": hnsw_s, "tenants": tenants.len() });
    Ok((url, store, report))
}
