//! The `extract` job: what an agent learns from its user's completed conversations, as one
//! durable run per (agent, user) at a time.
//!
//! The run and its cooldown are held in the database (`extraction_runs`), so they hold across
//! worker processes and restarts; a job that finds the run held or cooling waits as a delayed
//! job. It takes the conversations of the pair still pending, oldest first, as many whole as
//! one transcript holds ([`TRANSCRIPT_MESSAGES`] messages; the rest wait for the next run), so a
//! conversation that arrived meanwhile is coalesced into this run, never dropped. A conversation
//! longer than a transcript is read in pieces, one per run: its first piece is asked for as a
//! conversation of its own, so every message is shown to the model once. The model reads the
//! conversations' messages since the last extraction of their session, and
//! the user's PROFILE.md, MEMORY.md and today's note; its checked answer is applied in one
//! transaction (today's note, the profile, optionally the memory, facts as `POST /v1/facts`
//! writes them). A failure writes nothing, is recorded, and starts the cooldown (the pair's
//! other jobs wait rather than spend attempts on a model that is down); the run is tried again
//! after it, and each conversation that has had its attempts is `failed` for the runbook to list.

use std::sync::Arc;
use std::time::Duration;

use mnemo_config::ExtractionSettings;
use mnemo_core::{
    ExtractionInput, Extractor, Extras, FactScope, ModelFailure, NewMemory, Origin, Principal, Role, SHOWN_FILE_BYTES,
    TRANSCRIPT_MESSAGES, TokenCounter, TriggerSource, Workspace, WorkspacePath, extraction_transcript, newest_part,
    shown_file,
};
use mnemo_store::queue::ExtractJob;
use mnemo_store::{Claim, ExtractionChanges, MessageCursor, PendingExtraction, Replacement, SessionMessage, Store};

use crate::{JobError, UndoIfDropped, backoff};

/// The most characters of today's note the model is shown (about 4,000 tokens): its newest part.
/// The note is context (entries are added to it, never rewritten), and it grows all day; shown
/// whole, a busy day's note would outgrow a model's context and fail every extraction until the
/// next day.
pub const TODAY_NOTE_CHARS: usize = 16_000;

/// The most conversations one run takes (of few messages each); later ones wait for the next run.
pub const MAX_CONVERSATIONS_PER_RUN: usize = TRANSCRIPT_MESSAGES / 2;

/// Runs extract jobs.
#[derive(Debug, Clone)]
pub struct ExtractRunner {
    pub store: Store,
    pub extractor: Option<Arc<dyn Extractor>>,
    /// This worker, named in the run it holds.
    pub worker: String,
    pub settings: ExtractionSettings,
    pub max_file_bytes: usize,
    /// A MEMORY.md extraction writes back holds at most this many tokens (consolidation's
    /// budget), counted by `counter`.
    pub max_memory_tokens: u64,
    pub counter: Arc<dyn TokenCounter>,
    /// A run held longer than this is presumed dead (its worker was killed).
    pub stale_after: Duration,
    /// An extraction asks for a consolidation at most this often per (agent, user); `None`:
    /// never (consolidation is off).
    pub consolidation_throttle: Option<Duration>,
}

/// What one job did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtractReport {
    /// Nothing was pending.
    Nothing,
    /// The run is held or cooling: the job waits this long as a delayed job.
    Waiting(Duration),
    /// No model is configured: the conversations are `disabled`, nothing changed.
    Disabled {
        conversations: usize,
    },
    /// The model saw nothing worth keeping.
    NoUpdate {
        conversations: usize,
    },
    Applied {
        conversations: usize,
        facts: usize,
    },
    /// The model failed (`reason`); `last_attempt` when no conversation is left pending (each
    /// one that has had its attempts is `failed`).
    Failed {
        reason: String,
        last_attempt: bool,
    },
}

impl ExtractRunner {
    pub async fn run(&self, job: &ExtractJob) -> Result<ExtractReport, JobError> {
        let workspace =
            Workspace { tenant: job.tenant_id.clone(), agent: job.agent_id.clone(), user: Some(job.user_id.clone()) };
        // Nothing pending: no run is taken, so no run row names the user (an erased one above
        // all, whose jobs queued or retried around the erasure still run).
        match self.store.claim_extraction(job, &self.worker, self.settings.cooldown, self.stale_after).await? {
            Claim::Claimed => {}
            Claim::Wait(wait) => return Ok(ExtractReport::Waiting(wait)),
            Claim::Nothing => return Ok(ExtractReport::Nothing),
        }
        // Cut off midway, the run is released as a failed one is below (the release is the
        // holder's only: it never ends a run another worker took over).
        let cut_off = {
            let (store, workspace, worker) = (self.store.clone(), workspace.clone(), self.worker.clone());
            UndoIfDropped::new(async move {
                let _ = store.finish_extraction(&workspace, &worker, &[], "pending", "", false).await;
            })
        };
        let result = self.claimed(job, &workspace).await;
        cut_off.disarm();
        // Conversations this run could not take: the job runs again after the cooldown (a
        // failed run has queued its own retry).
        if let Ok((report, true)) = &result
            && !matches!(report, ExtractReport::Failed { last_attempt: false, .. })
        {
            self.store.retry_after(job, self.settings.cooldown).await?;
        }
        let result = result.map(|(report, _)| report);
        if result.is_err() {
            // Whatever failed, the run is not left held until it goes stale.
            let _ = self.store.finish_extraction(&workspace, &self.worker, &[], "pending", "", false).await;
            // The user erased during the run (their conversations' progress gone with them,
            // hence the failure): a retry would name them in the queue again.
            if self.store.pending_extractions(&workspace).await?.is_empty() {
                if let Err(e) = &result {
                    tracing::debug!(error = %e, "a failed extraction run left nothing pending (its user erased, say)");
                }
                return Ok(ExtractReport::Nothing);
            }
        }
        result
    }

    /// The run, once this worker holds the (agent, user), and whether conversations are left
    /// for the next run.
    async fn claimed(&self, job: &ExtractJob, workspace: &Workspace) -> Result<(ExtractReport, bool), JobError> {
        let mut pending = self.store.pending_extractions(workspace).await?;
        if pending.is_empty() {
            self.store.finish_extraction(workspace, &self.worker, &[], "pending", "", false).await?;
            return Ok((ExtractReport::Nothing, false));
        }
        let Some(extractor) = &self.extractor else {
            let more_waiting = pending.len() > MAX_CONVERSATIONS_PER_RUN;
            pending.truncate(MAX_CONVERSATIONS_PER_RUN);
            self.store.finish_extraction(workspace, &self.worker, &pending, "disabled", "no_model", false).await?;
            return Ok((ExtractReport::Disabled { conversations: pending.len() }, more_waiting));
        };
        let (parts, more_waiting) = self.plan(workspace, pending, true).await?;
        Ok((self.extract(job, workspace, extractor.as_ref(), parts).await?, more_waiting))
    }

    /// What this run shows the model of the `pending` conversations (oldest first), and whether
    /// others wait for the next run. Each is taken whole, from where the last one read of its
    /// session ended (extracted, or failed for good), while the transcript has room. When the next is longer than the room
    /// left, it waits, unless nothing was taken: then its first piece, as many messages as the
    /// transcript holds, is taken as a conversation of its own, asked for here with `ask` (a dry
    /// run asks for nothing). A piece whose attempts were spent is not read again (the reading
    /// starts after it, as after a failed conversation) until an operator asks for the session.
    async fn plan(
        &self,
        workspace: &Workspace,
        pending: Vec<PendingExtraction>,
        ask: bool,
    ) -> Result<(Vec<Part>, bool), JobError> {
        // After a run whose answer failed (cut, unreadable, too slow), the oldest conversation
        // is tried alone: one the model always fails on then fails by itself, not with every
        // conversation taken with it. A failing endpoint says nothing of the input.
        let failed_on_answer = pending.first().and_then(|p| p.last_failure.as_deref());
        let at_most = match failed_on_answer {
            Some(kind) if !ModelFailure::is_endpoint_state_kind(kind) => 1,
            _ => MAX_CONVERSATIONS_PER_RUN,
        };
        let more_waiting = pending.len() > at_most;
        let mut parts: Vec<Part> = Vec::new();
        let mut room = TRANSCRIPT_MESSAGES;
        for conversation in pending.into_iter().take(at_most) {
            let session = conversation.session_id.clone();
            // After the previous one of its session in this run, or one read before that ended
            // later (a failed one asked for again is older than what was extracted since).
            let previous = parts.iter().rev().find(|q| q.conversation.session_id == session);
            // A compaction's request that went in while a later conversation of the session was
            // being extracted: that one read these messages (this run starts after its apply
            // committed), and reading them again would write its daily entry twice.
            if conversation.trigger_source == TriggerSource::Compaction
                && self.store.extracted_through(workspace, &session, conversation.through()).await?
            {
                parts.push(Part { conversation, messages: Vec::new() });
                continue;
            }
            let read = self.store.last_read(workspace, &session, conversation.through()).await?;
            let after = read.max(previous.map(|q| q.conversation.through()));
            // In a session several users write in, another user's messages (and the
            // assistant's written under their token) are theirs: they never become this
            // user's memories, which that user's erasure could not reach. The assistant's rows
            // carrying no user stay (`SPOKEN`).
            let mut messages = self
                .store
                .spoken_messages(
                    &workspace.tenant,
                    &session,
                    after,
                    conversation.through().inclusive(),
                    workspace.user.as_ref(),
                    i64::try_from(room + 1).unwrap_or(i64::MAX),
                )
                .await?;
            if messages.len() <= room {
                room -= messages.len();
                parts.push(Part { conversation, messages });
                continue;
            }
            if !parts.is_empty() {
                return Ok((parts, true));
            }
            messages.truncate(room);
            let end = messages.last().map(|m| m.cursor()).expect("room for at least one message");
            let source = conversation.trigger_source;
            if ask {
                self.store.request_extraction_piece(workspace, &self.worker, &session, end, source).await?;
            }
            let piece = PendingExtraction::new(session, end, source);
            parts.push(Part { conversation: piece, messages });
            return Ok((parts, true));
        }
        Ok((parts, more_waiting))
    }

    /// Extracts the conversations of `parts` in one model call.
    async fn extract(
        &self,
        job: &ExtractJob,
        workspace: &Workspace,
        extractor: &dyn Extractor,
        parts: Vec<Part>,
    ) -> Result<ExtractReport, JobError> {
        let workspace = workspace.clone();
        let conversations = parts.len();
        let (input, read) = self.input(&workspace, &parts).await?;
        // When the facts were said: the end of the conversation they came from. The answer does
        // not say which one that was, so with several the earliest end is taken: no fact is
        // then dated after its own conversation, and none outranks what the user stated after
        // it ended. Where: the newest conversation's session. A conversation the model was
        // shown nothing of (one an earlier run read, or only another user's words) adds
        // neither: a fact dated by it would outrank what the user stated before its end, and
        // count as seen in a session it was never said in.
        let shown: Vec<_> = parts
            .iter()
            .filter_map(|p| Some((p.messages.last()?.cursor(), p.conversation.session_id.clone())))
            .collect();
        let said_at = shown.iter().map(|(at, _)| at.event_time).min();
        let newest_session = shown.into_iter().max_by_key(|(at, _)| *at).map(|(_, session)| session);
        let pending: Vec<PendingExtraction> = parts.into_iter().map(|p| p.conversation).collect();
        if input.transcript.is_empty() {
            // Nothing the model was not shown already (an earlier extraction of the session read
            // it), or only another user's words: no call, no entry written twice.
            self.store.finish_extraction(&workspace, &self.worker, &pending, "done", "nothing_new", false).await?;
            return Ok(ExtractReport::NoUpdate { conversations });
        }
        let extraction = match extractor.extract(&input).await {
            Ok(extraction) => extraction,
            // An endpoint that is down fails no conversation for a day: asked again once per
            // cooldown, they are extracted once it is back.
            Err(failure) => {
                return self.failed(job, &workspace, &pending, &failure).await;
            }
        };
        if !extraction.should_update {
            self.store.finish_extraction(&workspace, &self.worker, &pending, "done", "nothing_to_keep", true).await?;
            return Ok(ExtractReport::NoUpdate { conversations });
        }
        let principal = Principal {
            tenant: job.tenant_id.clone(),
            user: Some(job.user_id.clone()),
            agent: Some(job.agent_id.clone()),
            session: None,
            roles: Vec::new(),
        };
        // A fact read from a conversation is no newer than its last message (the store dates its
        // validity so), whenever the extraction runs.
        let said = Extras { event_time: said_at, ..Extras::default() };
        // Only facts about this user: one user's conversation must not teach the agent facts
        // recalled for every other user (nor can a prompt injected into it).
        let facts: Vec<NewMemory> = extraction
            .facts
            .iter()
            .filter(|f| f.scope == FactScope::User)
            .filter_map(|f| {
                let fact = NewMemory::fact(&principal, f.scope, f.content.clone(), f.key.clone(), said.clone()).ok()?;
                let mut fact = fact.with_typed(f.typed.clone(), Origin::Extraction).ok()?;
                // The conversation it was stated in (the newest, when one extraction reads several):
                // promotion counts the sessions a memory was seen in.
                fact.seen_in = newest_session.clone();
                Some(fact)
            })
            .collect();
        let changes = ExtractionChanges {
            day: Some(input.today),
            daily_entry: extraction.daily_entry,
            // A file written back past what extraction shows would be read only to it from then on.
            profile: extraction
                .profile_update
                .filter(|update| input.profile_rewritable && update.len() <= SHOWN_FILE_BYTES)
                .map(|content| Replacement { content, read_version: read.profile }),
            // Held to consolidation's budget, as a consolidation's MEMORY.md is: a longer one is
            // dropped, and the rest of the answer applies.
            memory: extraction
                .memory_update
                .filter(|update| {
                    input.memory_budget.is_some_and(|budget| u64::from(self.counter.count(update)) <= budget)
                        && update.len() <= SHOWN_FILE_BYTES
                })
                .map(|content| Replacement { content, read_version: read.memory }),
            reason: "applied".to_owned(),
            facts,
            max_note_bytes: self.max_file_bytes,
            consolidation_throttle: self.consolidation_throttle,
        };
        match self.store.apply_extraction(&workspace, &self.worker, &pending, &changes).await {
            Ok(_) => {}
            // The database refuses what the model proposed, and would again: the attempt counts,
            // so the conversations end `failed` instead of paying for the model forever.
            Err(e) if e.is_refused_value() => {
                // A database's message may quote the value it refused.
                tracing::debug!(tenant = %job.tenant_id, error = %e, "the extraction could not be stored");
                let failure = mnemo_core::ModelFailure::new("unstorable", "the database refused the answer");
                return self.failed(job, &workspace, &pending, &failure).await;
            }
            Err(e) => return Err(e.into()),
        }
        let facts = changes.facts.len();
        metrics::counter!("mnemo_extractions_total", "outcome" => "applied").increment(1);
        tracing::info!(tenant = %job.tenant_id, conversations, facts, "extraction applied");
        Ok(ExtractReport::Applied { conversations, facts })
    }

    /// Ends a run that failed: each conversation counts the attempt, and the job runs again after
    /// a backoff unless none is left pending.
    async fn failed(
        &self,
        job: &ExtractJob,
        workspace: &Workspace,
        pending: &[PendingExtraction],
        failure: &ModelFailure,
    ) -> Result<ExtractReport, JobError> {
        let (kind, down) = (failure.kind, failure.is_endpoint_state());
        let attempt = pending.iter().map(|p| p.attempts).max().unwrap_or(0) + 1;
        let max_attempts = self.settings.max_attempts;
        let left = self.store.fail_extraction(workspace, &self.worker, pending, kind, down, max_attempts).await?;
        let last_attempt = left == 0;
        tracing::warn!(tenant = %job.tenant_id, kind, attempt, still_pending = left,
            "extraction failed; nothing was written");
        if !last_attempt {
            // The run cools down first, and the endpoint may have asked for longer (Retry-After):
            // the retry waits at least that long.
            let wait = failure.retry_after.unwrap_or_default().max(self.settings.cooldown);
            self.store.retry_after(job, backoff(attempt).max(wait)).await?;
        }
        Ok(ExtractReport::Failed { reason: kind.to_owned(), last_attempt })
    }

    /// What the model would propose in the first run after an operator's request for `session`
    /// (up to its last message), applying nothing: the runbook's dry run. It plans what would
    /// wait after the request, oldest first, as a run takes it: the (agent, user)'s pending
    /// conversations of every session, the session's failed conversations and pieces asked for
    /// again, and its conversation through its last message unless that was extracted already.
    pub async fn propose(&self, workspace: &Workspace, session: &mnemo_core::SessionId) -> Result<Proposal, JobError> {
        let Some(extractor) = &self.extractor else { return Ok(Proposal::NoModel) };
        let last = self.store.session_messages_newest_first(&workspace.tenant, session, None, None, 1).await?;
        let Some(last) = last.first() else { return Ok(Proposal::NoMessages) };
        let failed = self.store.failed_extractions(workspace, session, last.cursor()).await?;
        let asked_again = failed.len();
        let mut waiting = self.store.pending_extractions(workspace).await?;
        waiting.extend(failed);
        if !self.store.extracted_through(workspace, session, last.cursor()).await? {
            waiting.push(PendingExtraction::new(session.clone(), last.cursor(), mnemo_core::TriggerSource::Manual));
        }
        // A message ends one conversation at most: the same end is the same request.
        waiting.sort_by_key(PendingExtraction::through);
        waiting.dedup_by_key(|p| p.through());
        let throughs: Vec<MessageCursor> = waiting.iter().map(PendingExtraction::through).collect();
        let (parts, _) = self.plan(workspace, waiting, false).await?;
        let (input, _) = self.input(workspace, &parts).await?;
        if input.transcript.is_empty() {
            return Ok(Proposal::NothingNew);
        }
        let shown = Shown {
            waiting: throughs.len(),
            asked_again,
            taken: parts.len(),
            messages: parts.iter().map(|p| p.messages.len()).sum(),
            piece: parts.last().is_some_and(|p| !throughs.contains(&p.conversation.through())),
        };
        Ok(Proposal::Answer(extractor.extract(&input).await, shown))
    }

    /// The transcript of the `parts` and the user's files as they are now, with the versions of
    /// PROFILE.md and MEMORY.md read.
    async fn input(&self, workspace: &Workspace, parts: &[Part]) -> Result<(ExtractionInput, ReadVersions), JobError> {
        let messages: Vec<(Role, String)> =
            parts.iter().flat_map(|p| p.messages.iter().map(|m| (m.role, m.content.clone()))).collect();
        let borrowed: Vec<(Role, &str)> = messages.iter().map(|(role, text)| (*role, text.as_str())).collect();
        let (_, today) = self.store.tenant_today(&workspace.tenant).await?;
        let read = |path: WorkspacePath| {
            let key = workspace.file(path);
            async move {
                match key {
                    Ok(key) => Ok::<_, JobError>(
                        self.store
                            .read_file(&key)
                            .await?
                            .map_or((String::new(), None), |f| (f.content, Some(f.version))),
                    ),
                    Err(_) => Ok((String::new(), None)),
                }
            }
        };
        let (profile, profile_version) = read(WorkspacePath::parse("PROFILE.md").expect("valid")).await?;
        let (memory, memory_version) = read(WorkspacePath::parse("MEMORY.md").expect("valid")).await?;
        let ((profile, profile_whole), (memory, memory_whole)) = (shown_file(&profile), shown_file(&memory));
        let input = ExtractionInput {
            transcript: extraction_transcript(&borrowed),
            profile,
            profile_rewritable: profile_whole,
            memory,
            memory_budget: (memory_whole && self.settings.update_memory).then_some(self.max_memory_tokens),
            today_note: newest_part(&read(WorkspacePath::daily_note(today)).await?.0, TODAY_NOTE_CHARS),
            today,
        };
        Ok((input, ReadVersions { profile: profile_version, memory: memory_version }))
    }
}

/// A conversation a run takes, and its messages the model is shown (oldest first).
struct Part {
    conversation: PendingExtraction,
    messages: Vec<SessionMessage>,
}

/// What a dry run found.
#[derive(Debug)]
pub enum Proposal {
    /// No extraction model is configured.
    NoModel,
    /// The session holds no messages.
    NoMessages,
    /// Nothing the model has not been shown: the session was extracted for the user through
    /// its last message, or holds only other users' words since.
    NothingNew,
    /// The model's answer, or how it failed, and what it was shown.
    Answer(Result<mnemo_core::Extraction, mnemo_core::ModelFailure>, Shown),
}

/// What a dry run showed the model: the first run's share of what waits after an operator's
/// request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shown {
    /// Conversations and pieces waiting after the request (the (agent, user)'s, every session),
    /// and of them the session's that had failed, asked for again.
    pub waiting: usize,
    pub asked_again: usize,
    /// Of those, how many the first run takes (oldest first), and their messages.
    pub taken: usize,
    pub messages: usize,
    /// Whether the last one taken is the first piece of a conversation longer than a transcript.
    pub piece: bool,
}

/// The versions of PROFILE.md and MEMORY.md the model was shown (`None`: no live file), so a
/// replacement never overwrites a change made during the model call.
#[derive(Debug, Clone, Copy)]
struct ReadVersions {
    profile: Option<i32>,
    memory: Option<i32>,
}
