//! The `consolidate` job: an (agent, user)'s daily notes distilled into MEMORY.md, one run at a
//! time per pair (held in the database). It reads the notes changed since the watermark and
//! within the day range, with MEMORY.md; MEMORY.md is replaced only when the model says so and
//! the result fits its token budget, and the watermark moves only when the run succeeds, so a
//! failed run's notes are read again by the next.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use mnemo_config::ConsolidationSettings;
use mnemo_core::{ConsolidationInput, Consolidator, TokenCounter, Workspace, WorkspacePath};
use mnemo_store::Store;
use mnemo_store::queue::ConsolidateJob;

use crate::JobError;

/// Runs consolidate jobs.
#[derive(Debug, Clone)]
pub struct ConsolidateRunner {
    pub store: Store,
    pub consolidator: Option<Arc<dyn Consolidator>>,
    pub counter: Arc<dyn TokenCounter>,
    pub worker: String,
    pub settings: ConsolidationSettings,
    pub stale_after: Duration,
}

/// What one job did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsolidateReport {
    /// Another run holds the pair: this job waits and runs again.
    Held,
    /// No note changed since the watermark.
    NothingNew,
    Disabled,
    /// The model kept MEMORY.md as it is (the watermark moved).
    Kept {
        notes: usize,
    },
    Updated {
        notes: usize,
    },
    /// Nothing changed and the watermark stayed: the model failed, or its result was over budget.
    Failed {
        reason: String,
    },
}

impl ConsolidateRunner {
    pub async fn run(&self, job: &ConsolidateJob) -> Result<ConsolidateReport, JobError> {
        let workspace =
            Workspace { tenant: job.tenant_id.clone(), agent: job.agent_id.clone(), user: Some(job.user_id.clone()) };
        let Some(watermark) = self.store.claim_consolidation(&workspace, &self.worker, self.stale_after).await? else {
            self.store.retry_after(job, Duration::from_secs(5)).await?;
            return Ok(ConsolidateReport::Held);
        };
        let result = self.claimed(job, &workspace, watermark).await;
        if result.is_err() {
            // Whatever failed, the run is not left held until it goes stale.
            let _ = self.store.finish_consolidation(&workspace, &self.worker, None, None, "failed", "error").await;
        }
        result
    }

    /// The run, once this worker holds the (agent, user).
    async fn claimed(
        &self,
        job: &ConsolidateJob,
        workspace: &Workspace,
        watermark: chrono::DateTime<Utc>,
    ) -> Result<ConsolidateReport, JobError> {
        let workspace = workspace.clone();
        let since = Utc::now().date_naive() - chrono::Days::new(u64::from(self.settings.day_range));
        let notes = self.store.notes_changed_since(&workspace, watermark, since).await?;
        let Some(newest) = notes.iter().map(|n| n.updated_at).max() else {
            self.store.finish_consolidation(&workspace, &self.worker, None, None, "nothing_new", "").await?;
            return Ok(ConsolidateReport::NothingNew);
        };
        let Some(consolidator) = &self.consolidator else {
            self.store.finish_consolidation(&workspace, &self.worker, None, None, "disabled", "no_model").await?;
            return Ok(ConsolidateReport::Disabled);
        };
        let memory_key = workspace
            .file(WorkspacePath::parse("MEMORY.md").expect("a valid path"))
            .map_err(|e| JobError::Setup(e.to_string()))?;
        let memory = self.store.read_file(&memory_key).await?.map(|f| f.content).unwrap_or_default();
        let budget = self.settings.max_memory_tokens;
        let input = ConsolidationInput {
            memory,
            notes: notes.iter().map(|n| (n.day, n.content.clone())).collect(),
            // Told to the model in characters, which it can count; checked below in tokens.
            max_chars: usize::try_from(budget * 4).unwrap_or(usize::MAX),
        };
        let failed = |reason: &str| ConsolidateReport::Failed { reason: reason.to_owned() };
        let report = match consolidator.consolidate(&input).await {
            Err(failure) => {
                tracing::warn!(tenant = %job.tenant_id, kind = failure.kind, "consolidation failed; nothing changed");
                self.store.finish_consolidation(&workspace, &self.worker, None, None, "failed", failure.kind).await?;
                failed(failure.kind)
            }
            Ok(answer) => match answer.memory_content.filter(|_| answer.should_update) {
                Some(content) if u64::from(self.counter.count(&content)) > budget => {
                    self.store
                        .finish_consolidation(&workspace, &self.worker, None, None, "failed", "over_budget")
                        .await?;
                    failed("over_budget")
                }
                Some(content) => {
                    self.store
                        .finish_consolidation(&workspace, &self.worker, Some(&content), Some(newest), "updated", "")
                        .await?;
                    ConsolidateReport::Updated { notes: notes.len() }
                }
                None => {
                    self.store.finish_consolidation(&workspace, &self.worker, None, Some(newest), "kept", "").await?;
                    ConsolidateReport::Kept { notes: notes.len() }
                }
            },
        };
        tracing::info!(tenant = %job.tenant_id, notes = notes.len(), ?report, "consolidation finished");
        Ok(report)
    }
}
