//! The memory jobs for operators: extraction and consolidation state per agent and user,
//! extracting or consolidating by hand, or only seeing what the model would change, and a
//! tenant's time zone.

use std::sync::Arc;

use anyhow::bail;
use clap::Subcommand;
use mnemo_config::{ContextSettings, Env, WorkspaceSettings};
use mnemo_core::{AgentId, SessionId, TenantId, UserId, Workspace};
use mnemo_jobs::{ConsolidateRunner, ExtractRunner, Proposal};
use mnemo_store::{ConsolidationRequest, Store};
use serde_json::{Value, json};

#[derive(Debug, Subcommand)]
pub enum MemoryCommand {
    /// Extract a session's conversation, and ask again for its failed ones: queue them past the
    /// gates, or with --dry-run print what the model (MNEMO_LLM_*) would change in the first
    /// run, applying nothing (prints content).
    Extract {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        #[arg(long, value_parser = AgentId::parse)]
        agent: AgentId,
        #[arg(long, value_parser = UserId::parse)]
        user: UserId,
        #[arg(long, value_parser = SessionId::parse)]
        session: SessionId,
        #[arg(long)]
        dry_run: bool,
        #[arg(long)]
        json: bool,
    },
    /// Consolidate an agent and user's daily notes into MEMORY.md: queue it now (never
    /// throttled), or with --dry-run print the notes the model would read and its proposed
    /// MEMORY.md, applying nothing (prints content).
    Consolidate {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        #[arg(long, value_parser = AgentId::parse)]
        agent: AgentId,
        #[arg(long, value_parser = UserId::parse)]
        user: UserId,
        #[arg(long)]
        dry_run: bool,
        #[arg(long)]
        json: bool,
    },
    /// A tenant's time zone (an IANA name; UTC by default), which decides the day of a daily
    /// note and when the consolidation schedule fires: print it, or set it with --set.
    TimeZone {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        #[arg(long, value_name = "ZONE")]
        set: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Per agent and user: conversations waiting for extraction and failed for good, the last
    /// extraction and a run in progress, the consolidation watermark and its last outcome.
    Status {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        #[arg(long)]
        json: bool,
    },
    /// Compute again the promotion fingerprints of episodic memories holding a negative number,
    /// once after upgrading past migration 46 (before it, "-18" and "18" were the same words).
    /// Idempotent; every tenant, or one.
    Refingerprint {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: Option<TenantId>,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(store: &Store, env: &Env, command: MemoryCommand) -> anyhow::Result<()> {
    match command {
        MemoryCommand::Extract { tenant, agent, user, session, dry_run, json } => {
            // What is extracted goes into this user's files and facts: never another's conversation,
            // nor a workspace of a mistyped agent.
            let (user_there, agent_known) = store.user_and_agent_in_session(&tenant, &user, &agent, &session).await?;
            if !user_there {
                bail!(
                    "user {user} wrote nothing in session {session} of tenant {tenant}: nothing of theirs to extract"
                );
            }
            if !agent_known {
                bail!(
                    "agent {agent} has no message in session {session} and no file of user {user} in tenant {tenant}: \
                     a mistyped agent would get a workspace of its own"
                );
            }
            let workspace = Workspace { tenant, agent, user: Some(user) };
            if !dry_run {
                let last = store.session_messages_newest_first(&workspace.tenant, &session, None, None, 1).await?;
                let Some(last) = last.first() else { bail!("the session has no messages") };
                let queued = store.request_extraction_again(&workspace, &session, last.cursor()).await?;
                if json {
                    println!("{}", json!({ "queued": queued }));
                } else if queued {
                    println!("queued: a worker serving the extract queue will extract the conversation");
                } else {
                    println!(
                        "already asked for this conversation (same last message), or extracted, or the user was \
                         erased meanwhile"
                    );
                }
                return Ok(());
            }
            let context = ContextSettings::from_env(env)?;
            let settings = WorkspaceSettings::from_env(env)?;
            let runner = ExtractRunner {
                store: store.clone(),
                extractor: mnemo_models::extractor(&context, settings.max_file_bytes)?,
                worker: "runbook".into(),
                settings: settings.extraction,
                max_file_bytes: settings.max_file_bytes,
                max_memory_tokens: settings.consolidation.max_memory_tokens,
                counter: Arc::new(mnemo_models::Tokenizer::new(context.tokenizer)),
                stale_after: std::time::Duration::from_secs(600),
                consolidation_throttle: settings.consolidation.after_extraction(),
            };
            let (proposal, shown) = match runner.propose(&workspace, &session).await? {
                Proposal::NoModel => bail!("nothing to propose: no MNEMO_LLM_MODEL"),
                Proposal::NoMessages => bail!("the session has no messages"),
                Proposal::NothingNew => {
                    // What a real request would find: the session's last conversation is done.
                    if json {
                        println!("{}", json!({ "dry_run": true, "nothing_new": true }));
                    } else {
                        println!(
                            "nothing new: the session was extracted for user {} through its last message, or holds \
                             only other users' words since",
                            workspace.user.as_ref().map_or("", |u| u.as_str())
                        );
                    }
                    return Ok(());
                }
                Proposal::Answer(answer, shown) => {
                    (answer.map_err(|f| anyhow::anyhow!("the model failed: {f}"))?, shown)
                }
            };
            if !json {
                println!(
                    "the first run would show the model {} messages of {} of the {} conversations waiting after the \
                     request ({} of this session failed before, asked again){}",
                    shown.messages,
                    shown.taken,
                    shown.waiting,
                    shown.asked_again,
                    if shown.piece { "; the last is the first piece of one longer than a transcript" } else { "" }
                );
            }
            let facts: Vec<Value> = proposal
                .facts
                .iter()
                .map(|f| json!({ "content": f.content.as_str(), "scope": f.scope.as_str(), "key": f.key.as_ref().map(|k| k.as_str()) }))
                .collect();
            let report = json!({ "dry_run": true,
                "shown": { "waiting": shown.waiting, "asked_again": shown.asked_again, "taken": shown.taken,
                           "messages": shown.messages, "piece": shown.piece },
                "should_update": proposal.should_update, "reason": proposal.reason,
                "daily_entry": proposal.daily_entry, "profile_update": proposal.profile_update,
                "memory_update": proposal.memory_update, "facts": facts });
            print_report(&report, json)?;
        }
        MemoryCommand::Consolidate { tenant, agent, user, dry_run, json } => {
            let missing = format!("user {user} has no daily notes under agent {agent} in tenant {tenant}");
            let workspace = Workspace { tenant, agent, user: Some(user) };
            let settings = WorkspaceSettings::from_env(env)?;
            if !settings.consolidation.enabled {
                bail!("consolidation is switched off (MNEMO_CONSOLIDATE_ENABLED=false): nothing to queue or propose");
            }
            // A mistyped name has no notes: the request queues nothing, and a dry run reads nothing.
            if !dry_run {
                let request = store.request_consolidation(&workspace, None).await?;
                if request == ConsolidationRequest::NoNote {
                    bail!("{missing}: nothing to consolidate");
                }
                let queued = request == ConsolidationRequest::Queued;
                if json {
                    println!("{}", json!({ "queued": queued }));
                } else if queued {
                    println!("queued: a worker serving the consolidate queue will consolidate the notes");
                } else {
                    println!("not queued: an earlier request still waits for a worker to take it");
                }
                return Ok(());
            }
            if !store.has_daily_notes(&workspace).await? {
                bail!("{missing}: nothing to consolidate");
            }
            let context = ContextSettings::from_env(env)?;
            let runner = ConsolidateRunner {
                store: store.clone(),
                consolidator: mnemo_models::consolidator(&context)?,
                counter: Arc::new(mnemo_models::Tokenizer::new(context.tokenizer)),
                worker: "runbook".into(),
                settings: settings.consolidation,
                stale_after: std::time::Duration::from_secs(600),
            };
            let Some((input, answer)) = runner.propose(&workspace).await? else {
                bail!("nothing to consolidate: no daily note of the day range changed since consolidation read it");
            };
            let Some(answer) = answer else { bail!("no model: set MNEMO_LLM_MODEL (and MNEMO_LLM_BASE_URL)") };
            let answer = answer.map_err(|f| anyhow::anyhow!("the model failed: {f}"))?;
            let days: Vec<String> = input.notes.iter().map(|(day, _)| day.to_string()).collect();
            let report = json!({ "dry_run": true, "notes": days, "should_update": answer.should_update,
                "reason": answer.reason, "memory_content": answer.memory_content });
            print_report(&report, json)?;
        }
        MemoryCommand::TimeZone { tenant, set, json } => {
            if let Some(zone) = &set {
                if !store.set_time_zone(&tenant, zone).await? {
                    bail!("unknown time zone {zone:?}: give an IANA name such as Europe/Paris or America/New_York");
                }
                crate::retention::warn_if_it_holds_nothing(store, &tenant).await?;
            }
            let (zone, today) = store.tenant_today(&tenant).await?;
            if json {
                println!("{}", json!({ "tenant": tenant.as_str(), "time_zone": zone, "today": today }));
            } else {
                println!("{tenant}: {zone} (today there: {today})");
            }
        }
        MemoryCommand::Refingerprint { tenant, json } => {
            let mut progress = |read: u64, changed: u64| {
                if read.is_multiple_of(10_000) {
                    eprintln!("{read} memories read, {changed} fingerprints changed");
                }
            };
            let (read, changed) = store.refingerprint(tenant.as_ref(), 1_000, &mut progress).await?;
            if json {
                println!("{}", json!({ "read": read, "changed": changed }));
            } else {
                println!("{read} episodic memories with a minus before a digit read, {changed} fingerprints changed");
            }
        }
        MemoryCommand::Status { tenant, json } => {
            let rows = store.memory_status(&tenant).await?;
            if rows.is_empty() {
                crate::retention::warn_if_it_holds_nothing(store, &tenant).await?;
            }
            if json {
                let rows: Vec<Value> = rows
                    .iter()
                    .map(|r| {
                        json!({ "agent": r.agent_id, "user": r.user_id, "pending": r.pending, "failed": r.failed,
                            "last_extraction": r.last_extraction, "extraction_running_since": r.extraction_running_since,
                            "consolidation_watermark": r.consolidation_watermark,
                            "last_consolidation": r.last_consolidation,
                            "last_consolidation_outcome": r.last_consolidation_outcome,
                            "last_consolidation_reason": r.last_consolidation_reason,
                            "consolidation_failures": r.consolidation_failures })
                    })
                    .collect();
                println!("{}", json!({ "pairs": rows }));
                return Ok(());
            }
            let time = |t: Option<chrono::DateTime<chrono::Utc>>| {
                t.map_or("-".to_owned(), |t| t.format("%Y-%m-%d %H:%M:%S").to_string())
            };
            for r in &rows {
                println!(
                    "{}/{}: {} pending, {} failed; last extraction {}{}; consolidated through {} (last {}: {}{})",
                    r.agent_id,
                    r.user_id,
                    r.pending,
                    r.failed,
                    time(r.last_extraction),
                    r.extraction_running_since.map_or(String::new(), |t| format!(", running since {t}")),
                    time(r.consolidation_watermark),
                    time(r.last_consolidation),
                    r.last_consolidation_outcome.as_deref().unwrap_or("-"),
                    match r.consolidation_failures {
                        0 => String::new(),
                        n => format!(", {n} failed in a row"),
                    },
                );
            }
            if rows.is_empty() {
                println!("(no extraction or consolidation yet)");
            }
        }
    }
    Ok(())
}

/// A dry run's report: one line of JSON, or indented for reading.
fn print_report(report: &Value, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(report)?);
    }
    Ok(())
}
