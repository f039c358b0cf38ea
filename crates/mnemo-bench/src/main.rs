//! `mnemo-bench`: benchmarks that need nothing but `MNEMO_DATABASE_URL`. Each scenario works in a
//! fresh database of its own and starts whatever part of mnemo it measures.

use anyhow::Context;
use clap::{Parser, Subcommand};
use mnemo_config::DatabaseSettings;
use mnemo_store::{FreshDatabase, create_database};

mod context;
mod embedding;
mod faults;
mod judge;
mod locomo;
mod long_prompts;
mod portability;
mod quality;
mod recall_latency;
mod recall_throughput;
mod retention;
mod setting_cost;
mod tenants;
mod workspace;
mod writes;

#[derive(Debug, Parser)]
#[command(name = "mnemo-bench", version, about = "Measure mnemo on this machine.")]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Debug, Subcommand)]
enum Scenario {
    /// One tenant exported and imported again through mnemo-runbook, rows/s both ways.
    Portability(portability::Args),
    /// Single-row writes over HTTP at increasing concurrency, against the plain-INSERT rate of
    /// the same PostgreSQL.
    Writes(writes::Args),
    /// Short writes' latency beside context calls with a long system prompt, whose tokens are
    /// counted in the request.
    LongPrompts(long_prompts::Args),
    /// Raw embedder throughput at several batch sizes: short texts, long texts and LoCoMo's questions.
    Embedder(embedding::EmbedderArgs),
    /// Rows through write → queue → worker → vector, against the raw embedder in the same run.
    Pipeline(embedding::PipelineArgs),
    /// Write → embedded latency at a steady write rate.
    EmbedLatency(embedding::LatencyArgs),
    /// Recall latency with N rows in one tenant among several: the search alone and over HTTP.
    RecallLatency(recall_latency::Args),
    /// Recalls per second and latency from 1, 8 and 32 clients at once, each asking a distinct
    /// LoCoMo question (the local embedder embeds every query).
    RecallThroughput(recall_throughput::Args),
    /// LoCoMo evidence recall@k per question category.
    Locomo(quality::LocomoArgs),
    /// BEAM knowledge updates and contradictions: is the newer message found, and above the older?
    Beam(quality::BeamArgs),
    /// Judge throughput and per-fact overhead against a model endpoint with a fixed delay.
    JudgeThroughput(judge::ThroughputArgs),
    /// Fact consolidation: facts written in order through remember_fact, then for each
    /// single-hop question: is the newest fact found, above the facts it overrides, and are
    /// those superseded?
    Factconsolidation(judge::FactConsolidationArgs),
    /// The fault suite: the worker killed again and again under a steady write and recall load,
    /// then checked (nothing acknowledged lost, one vector per row, no job stuck).
    Faults(faults::Args),
    /// Retention: the safety-floor check on a large tenant and sweep throughput.
    Retention(retention::Args),
    /// Many tenants, one write and one recall each, against the real server: its resident
    /// memory as they add up.
    Tenants(tenants::Args),
    /// What exporting traces costs: the real server under writes and recalls, traces off and on.
    TraceCost(setting_cost::Args),
    /// What row-level security costs: the real server under writes and recalls, connected as the
    /// tables' owner (not held by it) and as the API's role (held by it).
    WallCost(setting_cost::Args),
    /// Context windows: assembly latency by session size, and tokenizer throughput.
    Context(context::Args),
    /// Workspace memory: extraction and consolidation jobs/s against a model with a fixed delay,
    /// and prompt assembly latency with a year of daily notes.
    Workspace(workspace::Args),
    /// Serve the testkit's scripted chat model on a local port until stopped: a predictable
    /// MNEMO_LLM_BASE_URL for trying compaction, extraction and consolidation without a model.
    ScriptedChat {
        #[arg(long, default_value_t = 8090)]
        port: u16,
    },
}

/// A binary built beside this one (`scripts/bench.sh` builds them): the fault suite's workers,
/// the tenants probe's server.
pub(crate) fn sibling_binary(name: &str) -> anyhow::Result<std::path::PathBuf> {
    let path = std::env::current_exe()?.parent().ok_or_else(|| anyhow::anyhow!("no directory"))?.join(name);
    anyhow::ensure!(
        path.exists(),
        "{} is not built: run the scenario through `scripts/bench.sh`, which builds it",
        path.display()
    );
    Ok(path)
}

/// A fresh, migrated database beside `database`'s for one run, named on stderr.
pub(crate) async fn bench_database(database: &DatabaseSettings) -> anyhow::Result<FreshDatabase> {
    let db = create_database(database.url.expose(), "mnemo_bench", 2).await.context("creating the bench database")?;
    eprintln!("bench database: {}", db.name);
    Ok(db)
}

/// Starts the real `mnemo-server` beside this one on a free local port, with `env` over this
/// process's environment, and waits until it answers.
pub(crate) async fn start_server(env: &[(&str, String)]) -> anyhow::Result<mnemo_testkit::ServerProcess> {
    let mut command = tokio::process::Command::new(sibling_binary("mnemo-server")?);
    command.envs(env.iter().map(|(k, v)| (*k, v.as_str()))).stdout(std::process::Stdio::null());
    mnemo_testkit::ServerProcess::spawn(command, mnemo_testkit::free_port()).await
}

/// Starts the real `mnemo-worker` beside this one on `url`, with `env` over this process's
/// environment, and waits until it serves its metrics. Its errors are a fault's, expected: the
/// checks judge.
pub(crate) async fn start_worker(url: &str, env: &[(&str, String)]) -> anyhow::Result<mnemo_testkit::WorkerProcess> {
    let mut command = tokio::process::Command::new(sibling_binary("mnemo-worker")?);
    command
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env(mnemo_config::vars::DATABASE_URL, url)
        .env(mnemo_config::vars::LOG, "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    mnemo_testkit::WorkerProcess::spawn(command).await
}

/// An hour's token, signed with `secret`, for session `s` of `tenant`: what the load against a
/// real server writes and recalls with.
pub(crate) fn session_token(secret: &str, tenant: &str) -> anyhow::Result<String> {
    let principal = mnemo_core::Principal {
        tenant: mnemo_core::TenantId::parse(tenant)?,
        user: None,
        agent: None,
        session: Some(mnemo_core::SessionId::parse("s")?),
        roles: Vec::new(),
    };
    mnemo_api::auth::sign_hs256(secret.as_bytes(), &principal, std::time::Duration::from_secs(3600))
        .map_err(anyhow::Error::msg)
}

/// A process's resident memory in KiB, from `/proc`.
pub(crate) fn resident_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).ok_or_else(|| anyhow::anyhow!("no VmRSS"))?;
    Ok(line.split_whitespace().nth(1).ok_or_else(|| anyhow::anyhow!("no VmRSS value"))?.parse()?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    mnemo_models::keep_elementwise_ops_on_one_thread();
    mnemo_models::install_tls_provider();
    match Cli::parse().scenario {
        Scenario::Writes(args) => writes::run(args).await,
        Scenario::LongPrompts(args) => long_prompts::run(args).await,
        Scenario::Faults(args) => faults::run(args).await,
        Scenario::Portability(args) => portability::run(args).await,
        Scenario::Embedder(args) => embedding::embedder(args).await,
        Scenario::Pipeline(args) => embedding::pipeline(args).await,
        Scenario::EmbedLatency(args) => embedding::latency(args).await,
        Scenario::RecallLatency(args) => recall_latency::run(args).await,
        Scenario::RecallThroughput(args) => recall_throughput::run(args).await,
        Scenario::Locomo(args) => quality::locomo(args).await,
        Scenario::Beam(args) => quality::beam(args).await,
        Scenario::JudgeThroughput(args) => judge::throughput(args).await,
        Scenario::Factconsolidation(args) => judge::fact_consolidation(args).await,
        Scenario::Retention(args) => retention::run(args).await,
        Scenario::Tenants(args) => tenants::run(args).await,
        Scenario::TraceCost(args) => setting_cost::run(args, setting_cost::Setting::Traces).await,
        Scenario::WallCost(args) => setting_cost::run(args, setting_cost::Setting::Wall).await,
        Scenario::Context(args) => context::run(args).await,
        Scenario::Workspace(args) => workspace::run(args).await,
        Scenario::ScriptedChat { port } => {
            let chat = mnemo_testkit::ScriptedChat::start_on(port).await;
            eprintln!("scripted chat model at {} (any model name); Ctrl-C stops it", chat.base_url);
            tokio::signal::ctrl_c().await?;
            Ok(())
        }
    }
}
