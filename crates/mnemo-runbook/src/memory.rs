//! The memory jobs for operators: extraction and consolidation state per agent and user, and an
//! extraction's proposed changes without applying them.

use clap::Subcommand;
use mnemo_core::TenantId;
use mnemo_store::Store;
use serde_json::{Value, json};

#[derive(Debug, Subcommand)]
pub enum MemoryCommand {
    /// Per agent and user: conversations waiting for extraction and failed for good, the last
    /// extraction and a run in progress, the consolidation watermark and its last outcome.
    Status {
        #[arg(long, value_parser = TenantId::parse)]
        tenant: TenantId,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(store: &Store, command: MemoryCommand) -> anyhow::Result<()> {
    match command {
        MemoryCommand::Status { tenant, json } => {
            let rows = store.memory_status(&tenant).await?;
            if json {
                let rows: Vec<Value> = rows
                    .iter()
                    .map(|r| {
                        json!({ "agent": r.agent_id, "user": r.user_id, "pending": r.pending, "failed": r.failed,
                            "last_extraction": r.last_extraction, "extraction_running_since": r.extraction_running_since,
                            "consolidation_watermark": r.consolidation_watermark,
                            "last_consolidation": r.last_consolidation,
                            "last_consolidation_outcome": r.last_consolidation_outcome,
                            "last_consolidation_reason": r.last_consolidation_reason })
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
                    "{}/{}: {} pending, {} failed; last extraction {}{}; consolidated through {} (last {}: {})",
                    r.agent_id,
                    r.user_id,
                    r.pending,
                    r.failed,
                    time(r.last_extraction),
                    r.extraction_running_since.map_or(String::new(), |t| format!(", running since {t}")),
                    time(r.consolidation_watermark),
                    time(r.last_consolidation),
                    r.last_consolidation_outcome.as_deref().unwrap_or("-"),
                );
            }
            if rows.is_empty() {
                println!("(no extraction or consolidation yet)");
            }
        }
    }
    Ok(())
}
