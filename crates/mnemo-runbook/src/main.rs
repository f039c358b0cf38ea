//! `mnemo-runbook`: the operator's command line. Each subcommand reads what it needs from the
//! `MNEMO_*` environment and calls the same library code the server uses.

use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use mnemo_config::{
    ContextSettings, DatabaseSettings, EmbedSettings, Env, MIN_JWT_SECRET_BYTES, RecallSettings, RetentionSettings,
    WorkspaceSettings, vars,
};
use mnemo_core::{
    AgentId, AuditEvent, FactScope, Label, MAX_BATCH_SIZE, MAX_TTL_DAYS, POLICY_FIELDS, Principal, RecallRequest,
    RecallScope, SessionId, TenantId, UserId,
};
use mnemo_recall::{Recall, RecallOptions};
use mnemo_store::{MIGRATOR, Reads, Store};

mod judge;
mod memory;
mod portability;
mod retention;
mod session;
mod workspace;

#[derive(Debug, Parser)]
#[command(
    name = "mnemo-runbook",
    version,
    about = "Operate mnemo: migrations, status, tokens, recall, the judge, sessions, workspaces, facts, retention and the audit log."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Who a command acts as: the identities a token would carry.
#[derive(Debug, clap::Args)]
struct Identity {
    #[arg(long, value_parser = TenantId::parse)]
    tenant: TenantId,
    /// The human user (`sub`); needed for user-scope facts and recall.
    #[arg(long, value_parser = UserId::parse)]
    user: Option<UserId>,
    #[arg(long, value_parser = AgentId::parse)]
    agent: Option<AgentId>,
    /// The session (`sid`).
    #[arg(long, value_parser = SessionId::parse)]
    session: Option<SessionId>,
    /// A role (the `roles` claim), which opens memories written with `allowed_roles`; repeatable.
    #[arg(long = "role", value_parser = |raw: &str| Label::parse("roles", raw))]
    roles: Vec<Label>,
}

impl Identity {
    fn principal(&self) -> Principal {
        Principal {
            tenant: self.tenant.clone(),
            user: self.user.clone(),
            agent: self.agent.clone(),
            session: self.session.clone(),
            roles: self.roles.clone(),
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the database schema (mnemo's tables and apalis' job tables). Safe to re-run.
    Migrate {
        /// List the migrations not applied yet, and apply nothing (docs/runbook.md says which
        /// take long on a large database, and what to build before them).
        #[arg(long)]
        dry_run: bool,
    },
    /// Let ROLE, the API server's login (ARCHITECTURE.md, "Two roles"), use mnemo's tables in
    /// this database, now and after later migrations. It must not own the tables, be a superuser
    /// or bypass row-level security. Safe to re-run.
    GrantAppRole { role: String },
    /// Queues (pending, running, failed, dead, oldest age), rows waiting for embeddings, and
    /// worker processes.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Print a signed HS256 development token (uses MNEMO_JWT_SECRET).
    Token {
        #[command(flatten)]
        identity: Identity,
        /// Lifetime such as 90s, 30m, 1h or 7d.
        #[arg(long, default_value = "1h", value_parser = parse_ttl)]
        ttl: Duration,
    },
    /// Write a tenant's data (memories, facts and their chains, tool outputs, workspace files and
    /// their versions, settings) to stdout as gzip-compressed JSON Lines; progress on stderr.
    Export(portability::ExportArgs),
    /// Import an export, all or nothing; running it again changes nothing.
    Import(portability::ImportArgs),
    /// Print the HTTP API's OpenAPI 3.1 document (what `/openapi.json` serves; `make openapi`
    /// writes it to docs/openapi.json).
    Openapi,
    /// Recall as the API does, with the admin option to include superseded facts. Prints
    /// content: it is for operators inspecting a tenant.
    Recall {
        #[command(flatten)]
        identity: Identity,
        query: String,
        #[arg(long, default_value = "any")]
        scope: String,
        #[arg(long, default_value_t = 5)]
        top_k: usize,
        #[arg(long)]
        include_superseded: bool,
        #[arg(long)]
        json: bool,
    },
    /// The contradiction judge: status, fail-open facts, clearing judge_at, batch-size tuning.
    Judge {
        #[command(subcommand)]
        command: judge::JudgeCommand,
    },
    /// Embed again the rows whose embedding was given up (attempts used up in an outage longer
    /// than they last, or a permanent failure): their error and attempts are cleared and each
    /// gets an embed job. `status` counts them as failed for good.
    EmbedRetry {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: Option<TenantId>,
        #[arg(long)]
        json: bool,
    },
    /// A session's conversation: its messages, compactions and pending compaction; compact now.
    Session {
        #[command(subcommand)]
        command: session::SessionCommand,
    },
    /// Extraction and consolidation: state per agent and user, extracting a conversation.
    Memory {
        #[command(subcommand)]
        command: memory::MemoryCommand,
    },
    /// An agent's workspace files: list, print, history, restore.
    Workspace {
        #[command(subcommand)]
        command: workspace::WorkspaceCommand,
    },
    /// The facts of one user or agent with their state and supersede chains (prints content).
    #[command(group(clap::ArgGroup::new("bucket").required(true).args(["user", "agent"])))]
    Facts {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        #[arg(long, value_parser = UserId::parse)]
        user: Option<UserId>,
        #[arg(long, value_parser = AgentId::parse)]
        agent: Option<AgentId>,
        /// Show superseded (and anonymized) facts too.
        #[arg(long)]
        include_superseded: bool,
        /// The facts as they stood at this time (RFC 3339, or an age like 2h).
        #[arg(long, value_parser = judge::parse_time)]
        as_of: Option<chrono::DateTime<chrono::Utc>>,
        #[arg(long)]
        json: bool,
    },
    /// Sweep one tenant's retired rows now under its retention policy, with a progress bar.
    /// Exits non-zero when the safety floor refuses the sweep.
    Anonymize {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        /// Report what would be anonymized (counts by reason, ids) and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Allow this one sweep past the safety floor, if it anonymizes at most N rows (under the
        /// floor, it anonymizes at most N). Audited; not with --dry-run, which anonymizes nothing.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "dry_run")]
        allow_large_sweep: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// A tenant's retention policy: the fields it sets and the policy in force (this shell's
    /// MNEMO_ANONYMIZE_* fill the others, as the workers' do for them), after setting or
    /// removing fields when asked (audited). A tenant may turn dry run on, never lift the
    /// deployment's.
    RetentionPolicy {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        /// Anonymize soft-deleted rows (and redact replaced workspace versions) this many days on.
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=i64::from(MAX_TTL_DAYS)))]
        soft_ttl_days: Option<u32>,
        /// Anonymize superseded facts this many days after they were superseded.
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=i64::from(MAX_TTL_DAYS)))]
        superseded_ttl_days: Option<u32>,
        /// Rows anonymized per transaction.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_BATCH_SIZE)))]
        batch_size: Option<u32>,
        /// Whether the tenant's sweeps only count.
        #[arg(long, value_name = "true|false")]
        dry_run: Option<bool>,
        /// Remove a field, so that the deployment's value holds (repeatable).
        #[arg(long, value_name = "FIELD", value_parser = clap::builder::PossibleValuesParser::new(POLICY_FIELDS))]
        unset: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Soft-delete and anonymize every row carrying a user (facts, and session rows written
    /// under their token) now, whatever the TTLs, with audit rows. Reports counts per kind.
    Erase {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        #[arg(long, value_parser = UserId::parse)]
        user: UserId,
        /// Report what would be erased and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Erase (and audit) even when no row or file carries the user.
        #[arg(long)]
        force: bool,
        #[arg(long)]
        json: bool,
    },
    /// The audit log, newest first: ids, reasons and counts (never content).
    Audit {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: Option<TenantId>,
        /// An event such as memory.anonymize, memory.anonymize.refused, memory.delete, supersede.
        #[arg(long, value_parser = AuditEvent::parse)]
        event: Option<AuditEvent>,
        /// Rows about this memory item (as subject or related item).
        #[arg(long)]
        item: Option<uuid::Uuid>,
        /// A time (RFC 3339) or an age like 24h.
        #[arg(long, value_parser = judge::parse_time)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
}

fn parse_ttl(raw: &str) -> Result<Duration, String> {
    let raw = raw.trim();
    let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (number, unit) = raw.split_at(split);
    let number: u64 = number.parse().map_err(|_| format!("{raw:?} is not a duration like 30m, 1h or 7d"))?;
    let seconds = match unit {
        "s" => 1,
        "" => return Err(format!("{raw:?} has no unit: write it like 90s, 30m, 1h or 7d")),
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("unknown unit {unit:?}: use s, m, h or d")),
    };
    if number == 0 {
        return Err("the lifetime must be positive".into());
    }
    // A century at most: past that a token's expiry, or an age's time, would overflow.
    const MAX_SECONDS: u64 = 100 * 366 * 86_400;
    match number.checked_mul(seconds).filter(|s| *s <= MAX_SECONDS) {
        Some(seconds) => Ok(Duration::from_secs(seconds)),
        None => Err(format!("{raw:?} is longer than a hundred years")),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    mnemo_models::keep_elementwise_ops_on_one_thread();
    let cli = Cli::parse();
    let env = Env::from_process()?;
    // The libraries' warnings (a model call that failed, a replica behind) on stderr; the
    // commands print their own reports. No traces: a command is no service.
    let logs = mnemo_config::LogSettings {
        filter: mnemo_config::guarded_filter("warn"),
        format: mnemo_config::LogFormat::Text,
        traces: None,
    };
    let _telemetry = mnemo_config::init_tracing(&logs, "mnemo-runbook").map_err(anyhow::Error::msg)?;
    match cli.command {
        Command::Migrate { dry_run } => migrate(&env, dry_run).await,
        Command::GrantAppRole { role } => {
            connect(&env).await?.grant_app_role(&role).await.with_context(|| format!("cannot grant to {role}"))?;
            println!("{role} may use mnemo's tables, under row-level security");
            Ok(())
        }
        Command::Status { json } => status(&env, json).await,
        Command::Recall { identity, query, scope, top_k, include_superseded, json } => {
            let request = RecallRequest::new(&query)?.top_k(top_k)?.scope(RecallScope::parse(&scope)?);
            recall(&env, &identity.principal(), &request, include_superseded, json).await
        }
        Command::Judge { command } => judge::run(&connect(&env).await?, command, &env).await,
        Command::EmbedRetry { tenant, json } => {
            let store = connect(&env).await?;
            let queued = store
                .retry_given_up_embeddings(tenant.as_ref(), 10_000, |n| eprintln!("{n} rows queued to embed again"))
                .await?;
            if let Some(tenant) = tenant.as_ref().filter(|_| queued == 0) {
                retention::warn_if_it_holds_nothing(&store, tenant).await?;
            }
            if json {
                println!("{}", serde_json::json!({ "queued": queued }));
            } else {
                println!("{queued} rows given up on are queued to embed again");
            }
            Ok(())
        }
        Command::Workspace { command } => workspace::run(&connect(&env).await?, command, &env).await,
        Command::Memory { command } => memory::run(&connect(&env).await?, &env, command).await,
        Command::Session { command } => {
            // Only a compaction asks for extractions: `show` needs no workspace settings.
            let extraction = match &command {
                session::SessionCommand::Compact { .. } => {
                    WorkspaceSettings::from_env(&env)?.extraction.before_compaction()
                }
                session::SessionCommand::Show { .. } => None,
            };
            session::run(&connect(&env).await?, &ContextSettings::from_env(&env)?, extraction, command).await
        }
        Command::Facts { tenant, user, agent, include_superseded, as_of, json } => {
            let (scope, identity) = match (user, agent) {
                (Some(user), _) => (FactScope::User, user.as_str().to_owned()),
                (None, Some(agent)) => (FactScope::Agent, agent.as_str().to_owned()),
                (None, None) => bail!("give --user or --agent"),
            };
            let store = connect(&env).await?;
            judge::facts(&store, &tenant, scope, &identity, as_of, include_superseded, json).await
        }
        Command::Anonymize { tenant, dry_run, allow_large_sweep, json } => {
            let settings = RetentionSettings::from_env(&env)?;
            retention::anonymize(&connect(&env).await?, &settings, &tenant, dry_run, allow_large_sweep, json).await
        }
        Command::RetentionPolicy { tenant, soft_ttl_days, superseded_ttl_days, batch_size, dry_run, unset, json } => {
            let settings = RetentionSettings::from_env(&env)?;
            let change = retention::PolicyChange { soft_ttl_days, superseded_ttl_days, batch_size, dry_run, unset };
            retention::policy(&connect(&env).await?, &settings, &tenant, change, json).await
        }
        Command::Erase { tenant, user, dry_run, force, json } => {
            let settings = RetentionSettings::from_env(&env)?;
            retention::erase(&connect(&env).await?, &settings, &tenant, &user, dry_run, force, json).await
        }
        Command::Audit { tenant, event, item, since, limit, json } => {
            retention::audit(&connect(&env).await?, tenant, event, item, since, limit, json).await
        }
        Command::Export(args) => {
            let reads = reads(&env).await?;
            let store = reads.complete().await;
            if let Some(replica) = reads.replica_store() {
                // `complete` hands back one of the two stores: say which.
                let from = if std::ptr::eq(store, replica) {
                    "the replica"
                } else {
                    "the primary (the replica is behind or down)"
                };
                eprintln!("exporting from {from}");
            }
            portability::export(store, args).await
        }
        Command::Import(args) => portability::import(&connect(&env).await?, args).await,
        Command::Openapi => {
            println!("{}", serde_json::to_string_pretty(&mnemo_api::openapi::document())?);
            Ok(())
        }
        Command::Token { identity, ttl } => {
            let principal = identity.principal();
            let Some(secret) = env.get(vars::JWT_SECRET) else {
                bail!("{} is not set; tokens are signed with it (HS256)", vars::JWT_SECRET);
            };
            if secret.len() < MIN_JWT_SECRET_BYTES {
                bail!("{} must be at least {MIN_JWT_SECRET_BYTES} bytes", vars::JWT_SECRET);
            }
            let token = mnemo_api::auth::sign_hs256(secret.as_bytes(), &principal, ttl).map_err(anyhow::Error::msg)?;
            println!("{token}");
            Ok(())
        }
    }
}

async fn recall(
    env: &Env,
    principal: &Principal,
    request: &RecallRequest,
    include_superseded: bool,
    json: bool,
) -> anyhow::Result<()> {
    let reads = reads(env).await?;
    let embedder = mnemo_models::embedder(&EmbedSettings::from_env(env)?)?;
    // The runbook never reranks: it shows merge order, which is what recall falls back to.
    let recall =
        Recall::new(reads.primary_store().clone(), embedder, None, RecallSettings::from_env(env)?).reading_from(reads);
    let options = RecallOptions { include_superseded, ..RecallOptions::default() };
    let recalled = recall.recall_with(principal, request, options).await?;
    if json {
        let items: Vec<_> = recalled.items.iter().map(mnemo_api::recalled_item).collect();
        println!("{}", serde_json::json!({ "items": items, "degraded": recalled.degraded }));
        return Ok(());
    }
    for item in &recalled.items {
        println!("{:.4}  {}  {} {}\n        {}", item.score, item.id, item.source_kind, item.source_ref, item.content);
    }
    if recalled.degraded {
        println!(
            "(degraded: some rows still wait for vectors, the query could not be embedded, or the replica is behind)"
        );
    }
    Ok(())
}

async fn connect(env: &Env) -> anyhow::Result<Store> {
    let settings = DatabaseSettings::from_env(env)?;
    as_owner(settings.url.expose(), 2).await
}

/// The store at `url` as the tables' owner. The operator's commands cross tenants, and
/// row-level security would hide every row from them: they refuse a role the wall holds rather
/// than report an empty database.
async fn as_owner(url: &str, max_connections: u32) -> anyhow::Result<Store> {
    let store = Store::connect(url, max_connections).await.context("cannot connect to the database")?;
    refuse_walled(&store, vars::DATABASE_URL)?;
    Ok(store)
}

fn refuse_walled(store: &Store, variable: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !store.walled(),
        "{variable}'s role is held by row-level security (the API's role?): the runbook connects as the tables' \
         owner (ARCHITECTURE.md, \"Two roles\")"
    );
    Ok(())
}

/// The primary, and the replica named by `MNEMO_READ_DATABASE_URL` if one is.
async fn reads(env: &Env) -> anyhow::Result<Reads> {
    let settings = DatabaseSettings::from_env(env)?;
    let primary = as_owner(settings.url.expose(), 4).await?;
    let reads = Reads::primary(primary);
    Ok(match &settings.read_url {
        Some(url) => {
            // As for the primary: a role the wall holds would read an empty tenant from the
            // replica. A replica that cannot be reached now is left to `Reads`, which reads the
            // primary then.
            if let Ok(replica) = Store::connect(url.expose(), 1).await {
                refuse_walled(&replica, vars::READ_DATABASE_URL)?;
            }
            reads.with_replica(url.expose(), 4, settings.replica_wait, None).context(vars::READ_DATABASE_URL)?
        }
        None => reads,
    })
}

async fn status(env: &Env, json: bool) -> anyhow::Result<()> {
    let model = EmbedSettings::from_env(env)?.model;
    let store = connect(env).await?;
    let queues = store.queue_status(true).await?;
    let backlog = store.embed_backlog(&model).await?;
    let workers = store.workers(mnemo_config::orphan_timeout(env)?).await?;
    let alive = workers.iter().filter(|w| w.alive).count();
    if json {
        let queues: Vec<_> = queues
            .iter()
            .map(|q| {
                serde_json::json!({ "queue": q.queue, "pending": q.pending, "running": q.running, "failed": q.failed,
                    "dead": q.dead, "done": q.done, "oldest_pending_seconds": q.oldest_pending_seconds })
            })
            .collect();
        let workers: Vec<_> = workers
            .iter()
            .map(|w| serde_json::json!({ "id": w.id, "queue": w.queue, "last_seen": w.last_seen, "alive": w.alive }))
            .collect();
        let report = serde_json::json!({
            "queues": queues,
            "embeddings": { "model": model, "pending": backlog.pending, "failed": backlog.failed,
                "oldest_pending_seconds": backlog.oldest_pending_seconds },
            "workers": { "alive": alive, "list": workers },
        });
        println!("{report}");
        return Ok(());
    }
    let age = |s: Option<f64>| s.map_or("-".to_owned(), |s| format!("{s:.1}s"));
    println!(
        "{:<12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12}",
        "queue", "pending", "running", "failed", "dead", "done", "oldest"
    );
    for q in &queues {
        println!(
            "{:<12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12}",
            q.queue,
            q.pending,
            q.running,
            q.failed,
            q.dead,
            q.done.unwrap_or(0),
            age(q.oldest_pending_seconds)
        );
    }
    println!(
        "\nembeddings ({model}): {} rows pending (oldest {}), {} failed for good",
        backlog.pending,
        age(backlog.oldest_pending_seconds),
        backlog.failed
    );
    println!("workers: {alive} alive of {} known", workers.len());
    for w in workers.iter().filter(|w| w.alive) {
        println!("  {} ({}), last seen {}", w.id, w.queue, w.last_seen.format("%H:%M:%S"));
    }
    Ok(())
}

async fn migrate(env: &Env, dry_run: bool) -> anyhow::Result<()> {
    // Not `connect`: before the first migration nobody owns the tables, so every role looks held
    // by the wall. Migrating reads no tenant's rows, and the role that creates the tables owns them.
    let settings = DatabaseSettings::from_env(env)?;
    let store = Store::connect(settings.url.expose(), 2).await.context("cannot connect to the database")?;
    let before = MIGRATOR.status(store.pool()).await?;
    if !before.unknown.is_empty() {
        anyhow::bail!(
            "the database was migrated by a newer mnemo (migrations {:?} are not this build's): run that build, \
             or a later one",
            before.unknown
        );
    }
    // Some migrations take minutes on a large database (docs/runbook.md says which).
    let verb = if dry_run { "would apply" } else { "applying" };
    if !before.pending.is_empty() {
        eprintln!("{verb} {} migrations:", before.pending.len());
    }
    for version in &before.pending {
        eprintln!("  {version} {}", MIGRATOR.description(*version).unwrap_or_default());
    }
    if dry_run {
        println!("{} migrations pending; nothing applied (dry run)", before.pending.len());
        return Ok(());
    }
    MIGRATOR.run(store.pool()).await.context("migration failed")?;
    let after = MIGRATOR.status(store.pool()).await?;
    println!("schema is current ({} migrations applied now)", before.pending.len() - after.pending.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_parse_with_units() {
        assert_eq!(parse_ttl("90s"), Ok(Duration::from_secs(90)));
        assert!(parse_ttl("24").is_err_and(|e| e.contains("no unit")), "a bare number is no duration");
        assert_eq!(parse_ttl("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_ttl("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert!(parse_ttl("1w").is_err());
        assert!(parse_ttl("0m").is_err());
        assert!(parse_ttl("h").is_err());
        // Past a century a token's expiry would wrap to the past (and an age panic).
        assert_eq!(parse_ttl("36600d"), Ok(Duration::from_secs(36_600 * 86_400)));
        assert!(parse_ttl("36601d").unwrap_err().contains("hundred years"));
        assert!(parse_ttl("999999999999999d").is_err());
    }
}
