//! The `consolidate` job: an (agent, user)'s daily notes distilled into MEMORY.md, one run at a
//! time per pair (held in the database). It reads the notes of the day range at versions it has
//! not read yet, with MEMORY.md; MEMORY.md is replaced only when the model says so, the result
//! fits its token budget and MEMORY.md was not edited during the call, and the notes are
//! recorded as read only when the run succeeds, so a failed run's notes are read again by the
//! next.

use std::sync::Arc;
use std::time::Duration;

use chrono::NaiveDate;
use mnemo_config::ConsolidationSettings;
use mnemo_core::{
    Consolidation, ConsolidationInput, Consolidator, ModelFailure, SHOWN_FILE_BYTES, TokenCounter, Workspace,
    WorkspacePath, newest_part,
};
use mnemo_store::queue::ConsolidateJob;
use mnemo_store::{ChangedNote, ConsolidationClaim, Replacement, Store, StoreError};

use crate::{JobError, UndoIfDropped};

/// The most characters of notes one run shows the model (about 16,000 tokens). The notes past
/// it, the newest, are left to the next run, which this run asks for; a single note longer than
/// that is shown its end (entries are appended: the newest are last).
pub const MAX_NOTES_CHARS: usize = 64_000;

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
    /// No note of the day range changed since a run read it.
    NothingNew,
    Disabled,
    /// The model kept MEMORY.md as it is (the notes are recorded as read).
    Kept {
        notes: usize,
    },
    Updated {
        notes: usize,
    },
    /// Nothing changed and the notes wait for the next run: the model failed, its result was over
    /// budget, or MEMORY.md was edited during the call.
    Failed {
        reason: String,
    },
}

impl ConsolidateRunner {
    pub async fn run(&self, job: &ConsolidateJob) -> Result<ConsolidateReport, JobError> {
        // Switched off (`MNEMO_CONSOLIDATE_ENABLED`): jobs that extraction or an operator asked
        // for end here, having read nothing.
        if !self.settings.enabled {
            return Ok(ConsolidateReport::Disabled);
        }
        let workspace =
            Workspace { tenant: job.tenant_id.clone(), agent: job.agent_id.clone(), user: Some(job.user_id.clone()) };
        match self.store.claim_consolidation(job, &self.worker, self.stale_after, Duration::from_secs(5)).await? {
            ConsolidationClaim::Claimed => {}
            ConsolidationClaim::Held => return Ok(ConsolidateReport::Held),
            ConsolidationClaim::NoNote => return self.nothing_to_read(&workspace).await,
        }
        // Cut off midway, the run is released as a failed one is below.
        let cut_off = {
            let (store, workspace, worker) = (self.store.clone(), workspace.clone(), self.worker.clone());
            UndoIfDropped::new(async move {
                let _ = store.finish_consolidation(&workspace, &worker, None, None, "failed", "timeout").await;
            })
        };
        let result = self.claimed(job, &workspace).await;
        cut_off.disarm();
        let Ok((report, more)) = result else {
            // Whatever failed, the run is not left held until it goes stale.
            let _ = self.store.finish_consolidation(&workspace, &self.worker, None, None, "failed", "error").await;
            // The user erased during the run (their notes and state gone with them, hence the
            // failure): a retry would name them in the queue again.
            if !self.store.has_daily_notes(&workspace).await? {
                if let Err(e) = &result {
                    tracing::debug!(error = %e, "a failed consolidation run left no note to read (its user erased, say)");
                }
                return self.nothing_to_read(&workspace).await;
            }
            return result.map(|(report, _)| report);
        };
        // After the run is released and nothing may end it any more: the run's ownership is
        // this process's name, so an undo or a failure here could end the run another job of
        // this process has claimed since.
        if more && matches!(report, ConsolidateReport::Updated { .. } | ConsolidateReport::Kept { .. }) {
            // Under the user's files: an erasure that committed since leaves no note, and no request.
            self.store.request_consolidation(&workspace, None).await?;
        }
        Ok(report)
    }

    /// The user has no daily note, so nothing to read: no run is taken, and no idle state row is
    /// left naming them (an erased user above all).
    async fn nothing_to_read(&self, workspace: &Workspace) -> Result<ConsolidateReport, JobError> {
        self.store.forget_idle_consolidation(workspace).await?;
        Ok(ConsolidateReport::NothingNew)
    }

    /// What the model would be asked now, without taking the run: the notes not yet read at
    /// their current version and MEMORY.md (`None`: nothing new), and the model's answer (`None`: no model).
    /// Nothing is applied.
    pub async fn propose(
        &self,
        workspace: &Workspace,
    ) -> Result<Option<(ConsolidationInput, Option<Result<Consolidation, ModelFailure>>)>, JobError> {
        let Some(Read { input, .. }) = self.input(workspace).await? else { return Ok(None) };
        let Some(consolidator) = &self.consolidator else { return Ok(Some((input, None))) };
        let answer = self.ask(consolidator.as_ref(), &input).await;
        Ok(Some((input, Some(answer))))
    }

    /// The model's answer; or, without asking, `memory_too_large`: MEMORY.md is over the budget
    /// and longer than extraction shows a file ([`SHOWN_FILE_BYTES`]), so the model would be
    /// asked to rewrite a file it may not hold in its context into a fraction of it, and would
    /// fail or cut the user's file short (a user's own long MEMORY.md, a budget lowered). The
    /// notes wait, as after any failure, until MEMORY.md is shortened by hand.
    async fn ask(
        &self,
        consolidator: &dyn Consolidator,
        input: &ConsolidationInput,
    ) -> Result<Consolidation, ModelFailure> {
        if input.memory.len() > SHOWN_FILE_BYTES && u64::from(self.counter.count(&input.memory)) > input.max_tokens {
            let detail =
                format!("MEMORY.md holds {} bytes, over the budget of {} tokens", input.memory.len(), input.max_tokens);
            return Err(ModelFailure::new("memory_too_large", detail));
        }
        consolidator.consolidate(input).await
    }

    /// What a run reads: the notes within the day range (by the tenant's calendar) changed since
    /// consolidation last read them, and MEMORY.md; `None` when no note changed.
    async fn input(&self, workspace: &Workspace) -> Result<Option<Read>, JobError> {
        let (_, today) = self.store.tenant_today(&workspace.tenant).await?;
        // Today is one of the days: a range of 7 reads today and the 6 before it.
        let since = today - chrono::Days::new(u64::from(self.settings.day_range.saturating_sub(1)));
        let mut notes = self.store.notes_to_consolidate(workspace, since).await?;
        if notes.is_empty() {
            return Ok(None);
        }
        // Oldest first, while they fit (the first one always, cut when it alone does not).
        let mut shown = 0;
        let fit = notes
            .iter()
            .take_while(|n| {
                shown += n.content.chars().count();
                shown <= MAX_NOTES_CHARS
            })
            .count()
            .max(1);
        let more = fit < notes.len();
        notes.truncate(fit);
        let memory_key = workspace
            .file(WorkspacePath::parse("MEMORY.md").expect("a valid path"))
            .map_err(|e| JobError::Setup(e.to_string()))?;
        let (memory, memory_version) =
            self.store.read_file(&memory_key).await?.map_or((String::new(), None), |f| (f.content, Some(f.version)));
        let notes_shown: Vec<(NaiveDate, String)> =
            notes.iter().map(|n| (n.day, newest_part(&n.content, MAX_NOTES_CHARS))).collect();
        // Checked in tokens, told in characters: as many as the budget's tokens hold in this
        // text (about 4 in English, 1 to 2 in Chinese or Japanese, under 1 in some scripts),
        // never more than 4.
        let (mut chars, mut tokens) = (memory.chars().count(), u64::from(self.counter.count(&memory)));
        for (_, text) in &notes_shown {
            chars += text.chars().count();
            tokens += u64::from(self.counter.count(text));
        }
        let per_token = if tokens == 0 { 4.0 } else { (chars as f64 / tokens as f64).clamp(0.1, 4.0) };
        let budget = self.settings.max_memory_tokens;
        let input = ConsolidationInput {
            memory,
            notes: notes_shown,
            max_tokens: budget,
            max_chars: ((budget as f64 * per_token) as usize).max(1),
        };
        Ok(Some(Read { input, notes, memory_version, more }))
    }

    /// The run, once this worker holds the (agent, user).
    /// The run, which ends by releasing it; with whether notes were left for another run.
    async fn claimed(
        &self,
        job: &ConsolidateJob,
        workspace: &Workspace,
    ) -> Result<(ConsolidateReport, bool), JobError> {
        let workspace = workspace.clone();
        let Some(Read { input, notes: read, memory_version, more }) = self.input(&workspace).await? else {
            self.store.finish_consolidation(&workspace, &self.worker, None, None, "nothing_new", "").await?;
            return Ok((ConsolidateReport::NothingNew, false));
        };
        let Some(consolidator) = &self.consolidator else {
            self.store.finish_consolidation(&workspace, &self.worker, None, None, "disabled", "no_model").await?;
            return Ok((ConsolidateReport::Disabled, false));
        };
        let budget = self.settings.max_memory_tokens;
        let notes = input.notes.len();
        let failed = |reason: &str| ConsolidateReport::Failed { reason: reason.to_owned() };
        let report = match self.ask(consolidator.as_ref(), &input).await {
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
                // A MEMORY.md no edit could then save: refused as the API refuses it.
                Some(content) if content.len() > self.settings.max_file_bytes => {
                    self.store
                        .finish_consolidation(&workspace, &self.worker, None, None, "failed", "too_large")
                        .await?;
                    failed("too_large")
                }
                Some(content) => {
                    let replacement = Replacement { content, read_version: memory_version };
                    let finished = self
                        .store
                        .finish_consolidation(&workspace, &self.worker, Some(&replacement), Some(&read), "updated", "")
                        .await;
                    match finished {
                        Ok(()) => ConsolidateReport::Updated { notes },
                        // MEMORY.md, or a note the model read, changed during the model call:
                        // the edit stays, and the notes are left to the next run, which shows the
                        // model the files as they are now.
                        Err(StoreError::FileChanged { path }) => {
                            let reason = if path == "MEMORY.md" { "memory_changed" } else { "notes_changed" };
                            self.store
                                .finish_consolidation(&workspace, &self.worker, None, None, "failed", reason)
                                .await?;
                            failed(reason)
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                None => {
                    self.store.finish_consolidation(&workspace, &self.worker, None, Some(&read), "kept", "").await?;
                    ConsolidateReport::Kept { notes }
                }
            },
        };
        tracing::info!(tenant = %job.tenant_id, notes, ?report, "consolidation finished");
        Ok((report, more))
    }
}

/// What a run reads: the model's input, the notes at the versions read (recorded as consolidated
/// when the run succeeds), and the version of MEMORY.md shown (`None`: no live file).
struct Read {
    input: ConsolidationInput,
    notes: Vec<ChangedNote>,
    memory_version: Option<i32>,
    /// Notes were left out: another run follows.
    more: bool,
}
