//! A session's conversation for operators: its messages (roles, token counts, tool pairing;
//! content only with `--content`), its compactions and the one pending, and compaction on demand.

use std::sync::Arc;

use anyhow::Context;
use clap::Subcommand;
use mnemo_config::ContextSettings;
use mnemo_core::{CompactionTrigger, Gates, SessionId, TenantId};
use mnemo_jobs::{CompactPlan, CompactPolicy, CompactReport, Compactor, SUMMARY_RETRIES};
use mnemo_store::Store;
use mnemo_store::queue::CompactJob;
use serde_json::{Value, json};

/// The most messages `session show` lists.
const SHOW_LIMIT: i64 = 10_000;

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// Messages in order with roles and token counts, the compactions with the messages they
    /// cover, and the compaction pending.
    Show {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        #[arg(long, value_parser = SessionId::parse)]
        session: SessionId,
        /// Print each message's content too (first 120 characters).
        #[arg(long)]
        content: bool,
        #[arg(long)]
        json: bool,
    },
    /// Compact the session: queue a compact job for the workers, or with --now run it here with
    /// the configured model (MNEMO_LLM_*; without one, add --truncate to truncate). --dry-run
    /// says what would be compacted.
    Compact {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        #[arg(long, value_parser = SessionId::parse)]
        session: SessionId,
        #[arg(long)]
        dry_run: bool,
        #[arg(long, conflicts_with = "dry_run")]
        now: bool,
        /// With --now: truncate without a model, or when the model fails for now instead of leaving
        /// it to the workers' retries (the messages leave the window unsummarized).
        #[arg(long, requires = "now")]
        truncate: bool,
        #[arg(long)]
        json: bool,
    },
}

/// `settings` are the context's; `extraction` the gates of the extraction a compaction asks for
/// (`None`: none), as the workers have them.
pub async fn run(
    store: &Store,
    settings: &ContextSettings,
    extraction: Option<Gates>,
    command: SessionCommand,
) -> anyhow::Result<()> {
    match command {
        SessionCommand::Show { tenant, session, content, json } => show(store, &tenant, &session, content, json).await,
        SessionCommand::Compact { tenant, session, dry_run, now, truncate, json } => {
            let how = match (dry_run, now) {
                (true, _) => How::DryRun,
                (false, true) => How::Now { truncate },
                (false, false) => How::Queue,
            };
            compact(store, settings, extraction, &tenant, &session, how, json).await
        }
    }
}

async fn show(store: &Store, tenant: &TenantId, session: &SessionId, content: bool, json: bool) -> anyhow::Result<()> {
    // One more than shown tells whether there are more.
    let mut messages = store.session_messages(tenant, session, None, SHOW_LIMIT + 1).await?;
    let truncated = messages.len() as i64 > SHOW_LIMIT;
    messages.truncate(SHOW_LIMIT as usize);
    let compactions = store.session_compactions(tenant, session).await?;
    let state = store.session_state(tenant, session).await?;
    // A mistyped session has nothing at all: said, not shown as an empty session.
    if messages.is_empty() && compactions.is_empty() && state.pending.is_none() {
        anyhow::bail!("session {session} of tenant {tenant} has no messages");
    }
    // Compacted: at or before the last message compacted (which may itself be deleted since).
    let compacted =
        |m: &mnemo_store::SessionMessage| state.through.is_some_and(|c| (m.event_time, m.id) <= (c.event_time, c.id));
    if json {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut row = json!({
                    "id": m.id, "role": m.role.as_str(), "token_count": m.token_count,
                    "tool_call_id": m.tool_call_id, "event_time": m.event_time, "compacted": compacted(m),
                });
                // Any other message's name is its participant's: shown with the content only.
                if content || m.tool_call_id.is_some() {
                    row["name"] = json!(m.tool_name);
                }
                if content {
                    row["content"] = json!(m.content);
                }
                row
            })
            .collect();
        let compactions: Vec<Value> = compactions
            .iter()
            .map(|c| {
                json!({ "through_message": c.through_id, "messages": c.messages, "outcome": c.outcome.as_str(),
                    "reason": c.reason, "summary_id": c.summary_id, "model": c.model,
                    "trigger": c.trigger.as_str(), "at": c.created_at })
            })
            .collect();
        let report = json!({
            "truncated": truncated,
            "messages": messages,
            "compactions": compactions,
            "summary_id": state.summary.as_ref().map(|s| s.id),
            "pending": state.pending.map(|p| p.trigger.as_str()),
            "pending_since": state.pending.map(|p| p.since),
        });
        println!("{report}");
        return Ok(());
    }
    println!("{} messages{}", messages.len(), if truncated { " (first ones only)" } else { "" });
    for m in &messages {
        let tool = match (&m.tool_call_id, &m.tool_name) {
            (Some(id), name) => format!(" {}#{id}", name.as_deref().unwrap_or("tool")),
            _ => String::new(),
        };
        let tokens = m.token_count.map_or("?".to_owned(), |n| n.to_string());
        let mark = if compacted(m) { "compacted" } else { "window" };
        print!("{}  {} {:<9} {:>6} tok  {mark}{tool}", m.id, m.event_time.format("%Y-%m-%d %H:%M:%S"), m.role, tokens);
        if content {
            print!("  {}", m.content.chars().take(120).collect::<String>().replace('\n', " "));
        }
        println!();
    }
    println!("\n{} compactions", compactions.len());
    for c in &compactions {
        println!(
            "  through {} ({} messages): {}{}, trigger {}, summary {}, at {}",
            c.through_id,
            c.messages,
            c.outcome,
            c.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default(),
            c.trigger,
            c.summary_id.map_or("-".to_owned(), |id| id.to_string()),
            c.created_at.format("%Y-%m-%d %H:%M:%S"),
        );
    }
    match state.pending {
        Some(p) => {
            println!("pending: a compaction asked for ({}) at {}", p.trigger, p.since.format("%Y-%m-%d %H:%M:%S"))
        }
        None => println!("pending: none"),
    }
    Ok(())
}

/// What `session compact` does.
enum How {
    DryRun,
    /// Here and now; `truncate` allows it without a model.
    Now {
        truncate: bool,
    },
    Queue,
}

async fn compact(
    store: &Store,
    settings: &ContextSettings,
    extraction: Option<Gates>,
    tenant: &TenantId,
    session: &SessionId,
    how: How,
    json: bool,
) -> anyhow::Result<()> {
    let compactor = Compactor {
        store: store.clone(),
        summarizer: mnemo_models::summarizer(settings)?,
        counter: Arc::new(mnemo_models::Tokenizer::new(settings.tokenizer)),
        policy: CompactPolicy::from_settings(settings),
        extraction,
    };
    if let How::Now { truncate: false } = how
        && compactor.summarizer.is_none()
    {
        // The workers may have a model this shell does not: a truncation here is for good.
        anyhow::bail!(
            "no MNEMO_LLM_MODEL here, so --now would truncate (the messages leave the window unsummarized, \
             for good); set the model as the workers have it, leave out --now to queue the job for them, \
             or add --truncate"
        );
    }
    // A mistyped session would queue a job that finds nothing to compact.
    if store.session_messages_newest_first(tenant, session, None, None, 1).await?.is_empty() {
        anyhow::bail!("session {session} of tenant {tenant} has no messages");
    }
    if let How::DryRun = how {
        let CompactPlan { messages, history, cut, .. } = compactor.plan(tenant, session, None, None).await?;
        let tokens: u64 = history[..cut].iter().map(|m| m.cost()).sum();
        let way = if compactor.summarizer.is_some() { "summarize" } else { "truncate" };
        let (first, last) = (messages[..cut].first().map(|m| m.id), messages[..cut].last().map(|m| m.id));
        if json {
            println!(
                "{}",
                json!({ "dry_run": true, "messages": cut, "tokens": tokens, "first": first, "through": last,
                    "kept": messages.len() - cut, "would": way })
            );
        } else if cut == 0 {
            println!("nothing to compact: the {} messages since the last compaction are all kept", messages.len());
        } else {
            let hint = if compactor.summarizer.is_some() { "" } else { " (no MNEMO_LLM_MODEL)" };
            println!(
                "would {way}{hint} {cut} messages ({tokens} tokens), {} through {}, and keep {}",
                first.map(|id| id.to_string()).unwrap_or_default(),
                last.map(|id| id.to_string()).unwrap_or_default(),
                messages.len() - cut
            );
        }
        return Ok(());
    }
    if let How::Now { .. } = how {
        let job = CompactJob {
            tenant_id: tenant.clone(),
            session_id: session.clone(),
            trigger: CompactionTrigger::Operator,
            keep: None,
            keep_at_most: None,
            // --truncate: a model that fails for now truncates here, as the last try would.
            summary_failures: if let How::Now { truncate: true } = how { SUMMARY_RETRIES.len() as u32 } else { 0 },
        };
        let report = compactor.run(&job).await.context("compaction failed")?;
        let (messages, outcome, reason) = match &report {
            CompactReport::NothingToCompact => (0, "nothing", None),
            CompactReport::Retrying { reason, .. } => (0, "retrying", Some(reason.clone())),
            CompactReport::Overtaken => (0, "overtaken", None),
            CompactReport::MessagesChanged => (0, "messages_changed", None),
            CompactReport::Compacted { messages, outcome, reason } => (*messages, outcome.as_str(), reason.clone()),
        };
        let retry_after = match &report {
            CompactReport::Retrying { after, .. } => Some(after.as_secs()),
            _ => None,
        };
        if json {
            println!(
                "{}",
                json!({ "messages": messages, "outcome": outcome, "reason": reason, "retry_after_s": retry_after })
            );
        } else {
            println!("{outcome}: {messages} messages{}", reason.map(|r| format!(" ({r})")).unwrap_or_default());
            if let Some(after) = retry_after {
                println!("the summary failed for now: a worker serving the compact queue asks again in {after}s");
            }
        }
        return Ok(());
    }
    let queued = store.request_compaction(tenant, session, CompactionTrigger::Operator, None, None).await?;
    if json {
        println!("{}", json!({ "queued": queued }));
    } else if queued {
        println!("queued: a worker serving the compact queue will compact the session");
    } else {
        println!("a compaction is already pending for this session");
    }
    Ok(())
}
