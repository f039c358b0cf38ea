//! The `compact` job: brings a session's summary up to date so its context window stays small,
//! off the request path.
//!
//! It reads the messages after the previous compaction, keeps the last turns verbatim
//! (`MNEMO_COMPACT_KEEP_PAIRS`, or `MNEMO_COMPACT_KEEP_TOKENS`), and hands the rest to the model
//! with the previous summary, long tool traffic previewed, in steps of at most
//! `MNEMO_COMPACT_CHUNK_TOKENS`, so a call's cost does not grow with the session. The summary is
//! a `session_summary` row whose source_ref names the session and the last message it covers:
//! a retried or duplicated job lands on the same row, and the compaction record is keyed the
//! same way. With no model, or when the model fails, it truncates instead: the window starts
//! after those messages, unsummarized. A failure that passes (the endpoint down, overloaded,
//! refusing the key or missing the model for now, or slow) is first tried again a few times over
//! some minutes ([`SUMMARY_RETRIES`]), so a short outage leaves no hole in the summary; the
//! window fits its budget meanwhile all the same. When a later chunk fails, what the chunks
//! before it summarized is recorded, and the next job goes on from there.
//! Stored messages are never changed either way. The record asks, in its own transaction, for
//! the extraction of the messages it covers (seed 001's flushBeforeCompact), so what leaves the
//! window reaches memory even when the conversation is never completed.

use std::sync::Arc;
use std::time::Duration;

use mnemo_config::ContextSettings;
use mnemo_core::{
    AgentId, CompactionOutcome, Gates, Keep, MAX_COMPACTION_MESSAGES, MemoryText, ModelFailure, NewMemory, Role,
    SessionId, Summarizer, TenantId, TokenCounter, TranscriptLine, TriggerSource, UserId, WindowMessage, Workspace,
    compaction_cut, cut_to, summary_source_ref, transcript, units_of, units_within,
};
use mnemo_store::queue::CompactJob;
use mnemo_store::{NewCompaction, Recording, SessionMessage, SessionState, Store, StoreError, spoken_by};

use crate::JobError;

/// The most chunks one job summarizes (each one model call); the rest of a backlog goes to the
/// next job. Fewer when the model's timeout would not let them end within the job's
/// ([`CompactPolicy::within`]).
const MAX_CHUNKS_PER_JOB: u64 = 4;

/// How long a compaction waits before asking the model again after a failure that passes, one
/// wait per try; the try after the last truncates. Each is shorter than a request takes to go
/// stale (with room for the try itself), so the session's request stays its job's.
pub const SUMMARY_RETRIES: [Duration; 3] = [Duration::from_secs(15), Duration::from_secs(60), Duration::from_secs(180)];

/// What compaction keeps and how it calls the model.
#[derive(Debug, Clone, Copy)]
pub struct CompactPolicy {
    pub keep: Keep,
    pub summary_max_tokens: u32,
    pub chunk_tokens: u64,
    /// The most chunks (model calls) one job summarizes.
    pub max_chunks: u64,
}

impl CompactPolicy {
    pub fn from_settings(settings: &ContextSettings) -> Self {
        Self {
            keep: settings.compaction_keeps(),
            summary_max_tokens: settings.summary_max_tokens,
            chunk_tokens: settings.chunk_tokens,
            max_chunks: MAX_CHUNKS_PER_JOB,
        }
    }

    /// As many chunks as end within three quarters of `job_timeout` when every model call
    /// takes all of `model_timeout` (at least one, at most [`MAX_CHUNKS_PER_JOB`]): a slow model
    /// never gets the job killed midway, its calls paid for and nothing recorded.
    pub fn within(self, job_timeout: Duration, model_timeout: Duration) -> Self {
        let calls = (job_timeout.as_millis() * 3 / 4) / model_timeout.as_millis().max(1);
        Self { max_chunks: u64::try_from(calls).unwrap_or(u64::MAX).clamp(1, MAX_CHUNKS_PER_JOB), ..self }
    }
}

/// What a compaction of a session would cover, before any model is asked.
#[derive(Debug, Clone)]
pub struct CompactPlan {
    pub state: SessionState,
    /// The messages after the previous compaction, oldest first.
    pub messages: Vec<SessionMessage>,
    pub history: Vec<WindowMessage>,
    /// The first message kept verbatim: `messages[..cut]` are compacted.
    pub cut: usize,
    /// Where the cut would be without one job's limits: past `cut`, the next job goes on.
    pub wanted: usize,
}

/// Runs compact jobs.
#[derive(Debug, Clone)]
pub struct Compactor {
    pub store: Store,
    pub summarizer: Option<Arc<dyn Summarizer>>,
    pub counter: Arc<dyn TokenCounter>,
    pub policy: CompactPolicy,
    /// The gates what a compaction covers passes to be extracted (as a completed conversation);
    /// `None`: compactions ask for no extraction.
    pub extraction: Option<Gates>,
}

/// What one job did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompactReport {
    /// Nothing before the kept turns: the request is cleared, and a summary an earlier try left
    /// unrecorded is deleted and anonymized.
    NothingToCompact,
    /// The model failed in a way that passes (`reason`): nothing is recorded, and the job is
    /// queued again, due after `after`.
    Retrying { reason: String, after: Duration },
    /// `messages` were compacted, summarized or truncated (with the reason).
    Compacted { messages: usize, outcome: CompactionOutcome, reason: Option<String> },
    /// Another compaction of the session was recorded while this one ran (or this job's own, if
    /// it ran again): this one is not recorded, and the next job plans from that one. A summary
    /// it wrote is deleted and anonymized.
    Overtaken,
    /// A message it covered was deleted or erased (or one was written into its range) while it
    /// ran, or the summary it wrote was dropped or erased: it is not recorded, a summary it wrote
    /// is deleted and anonymized, and the compaction is asked for again.
    MessagesChanged,
}

impl Compactor {
    /// Where a compaction of the session would cut now: before the kept turns (or tokens) of
    /// `keep` (the policy's when `None`), and before `keep_at_most` tokens when the kept turns
    /// are longer (one long agent turn), but never past what one job summarizes (`max_chunks`
    /// chunks).
    pub async fn plan(
        &self,
        tenant: &TenantId,
        session: &SessionId,
        keep: Option<Keep>,
        keep_at_most: Option<u64>,
    ) -> Result<CompactPlan, JobError> {
        let state = self.store.session_state(tenant, session).await?;
        let read = i64::try_from(MAX_COMPACTION_MESSAGES).unwrap_or(i64::MAX);
        let messages = self.store.session_messages(tenant, session, state.through, read).await?;
        let history: Vec<_> = messages.iter().map(|m| m.to_window(self.counter.as_ref())).collect();
        let wanted = compaction_cut(&history, keep.unwrap_or(self.policy.keep))
            .max(keep_at_most.map_or(0, |tokens| compaction_cut(&history, Keep::Tokens(tokens))));
        let per_job = self.policy.chunk_tokens.saturating_mul(self.policy.max_chunks);
        let cut = units_within(&history[..wanted], per_job);
        // Chunks are packed line by line, so those tokens may still take more calls than
        // `max_chunks`: then only the whole units within the first `max_chunks` chunks (at least
        // one unit) are this job's.
        let chunks = self.chunks(&transcript(&history[..cut]));
        let cut = match chunks.get(..usize::try_from(self.policy.max_chunks).unwrap_or(usize::MAX)) {
            Some(first) if first.len() < chunks.len() => {
                let lines: usize = first.iter().map(Vec::len).sum();
                let ends = units_of(&history[..cut]).into_iter().map(|(_, end)| end);
                ends.clone().filter(|&end| end <= lines).max().or(ends.min()).unwrap_or(cut)
            }
            _ => cut,
        };
        Ok(CompactPlan { state, messages, history, cut, wanted })
    }

    pub async fn run(&self, job: &CompactJob) -> Result<CompactReport, JobError> {
        let (tenant, session) = (&job.tenant_id, &job.session_id);
        let CompactPlan { state, messages: stored, history, cut, wanted } =
            self.plan(tenant, session, job.keep, job.keep_at_most).await?;
        if cut == 0 {
            self.store.nothing_to_compact(tenant, session).await?;
            return Ok(CompactReport::NothingToCompact);
        }
        let previous = state.summary.as_ref();
        let (summary, cut) = match &self.summarizer {
            None => (Err(ModelFailure::new("no_model", "MNEMO_LLM_MODEL is not set")), cut),
            Some(model) => {
                let lines = transcript(&history[..cut]);
                match self.summarize(model.as_ref(), previous.map(|s| s.content.as_str()), &lines).await {
                    Summarized::Whole(text) => (Ok(text), cut),
                    Summarized::Part { done, failure } => {
                        // The chunks summarized before the failure are kept, up to the last one
                        // that ended where a unit does (a chunk may end between a call and its
                        // result): the record covers exactly what that summary read, and the
                        // next job goes on from there.
                        let ends: Vec<usize> = units_of(&history[..cut]).into_iter().map(|(_, end)| end).collect();
                        let kept = done.into_iter().rev().find(|(lines, _)| ends.contains(lines));
                        match kept.map(|(lines, text)| (lines, MemoryText::parse(&text))) {
                            Some((part, Ok(text))) => {
                                tracing::warn!(tenant = %tenant, kind = failure.kind,
                                    "the summary failed after {part} of {cut} messages; compaction records those");
                                tracing::debug!(tenant = %tenant, detail = failure.detail, "summary failure detail");
                                (Ok(text), part)
                            }
                            _ => (Err(failure), cut),
                        }
                    }
                    Summarized::Failed(failure) => (Err(failure), cut),
                }
            }
        };
        let last = &stored[cut - 1];
        let (outcome, reason, summary_id) = match summary {
            Ok(text) => {
                let row = NewMemory::session_summary(
                    tenant.clone(),
                    session.clone(),
                    // The user of the covered messages (an agent's replies written with a
                    // service token carry none), so that the user's erasure finds the summary
                    // even after their messages were anonymized.
                    stored[..cut].iter().rev().find_map(|m| m.user_id.as_deref()).and_then(|u| UserId::parse(u).ok()),
                    last.agent_id.as_deref().and_then(|a| AgentId::parse(a).ok()),
                    summary_source_ref(session, state.through.map(|c| c.id), last.id, text.as_str()),
                    text,
                    last.event_time,
                );
                match self.store.remember(&row).await {
                    Ok(written) => (CompactionOutcome::Summarized, None, Some(written.id)),
                    // An earlier try wrote the same words, and that row was deleted since: these
                    // messages go unsummarized.
                    Err(StoreError::SourceRefDeleted { .. }) => {
                        (CompactionOutcome::Truncated, Some("summary_deleted".to_owned()), previous.map(|s| s.id))
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Err(failure) if failure.may_pass() && (job.summary_failures as usize) < SUMMARY_RETRIES.len() => {
                // At least as long as the endpoint asked (its Retry-After), but no longer than the
                // longest wait: a longer one would let the session's request go stale, and a
                // context call would queue a second job beside this one.
                let longest = SUMMARY_RETRIES[SUMMARY_RETRIES.len() - 1];
                let after = SUMMARY_RETRIES[job.summary_failures as usize]
                    .max(failure.retry_after.unwrap_or_default().min(longest));
                tracing::warn!(tenant = %tenant, kind = failure.kind, failures = job.summary_failures + 1,
                    "the summary failed; compaction tries again after {after:?}");
                tracing::debug!(tenant = %tenant, detail = failure.detail, "summary failure detail");
                let again = CompactJob { summary_failures: job.summary_failures + 1, ..job.clone() };
                self.store.retry_compaction(&again, after).await?;
                return Ok(CompactReport::Retrying { reason: failure.kind.to_owned(), after });
            }
            Err(failure) => {
                if self.summarizer.is_some() {
                    // The detail may quote a provider's error message, which may quote the input.
                    tracing::warn!(tenant = %tenant, kind = failure.kind, "the summary failed; compaction truncates");
                    tracing::debug!(tenant = %tenant, detail = failure.detail, "summary failure detail");
                }
                // A truncation keeps the summary in effect: it still covers what it covered.
                (CompactionOutcome::Truncated, Some(failure.kind.to_owned()), previous.map(|s| s.id))
            }
        };
        let record = NewCompaction {
            from: state.through,
            through: last.cursor(),
            covered: stored[..cut].iter().map(|m| m.id).collect(),
            previous_summary: previous.map(|s| s.id),
            outcome,
            reason: reason.clone(),
            summary_id,
            model: self.summarizer.as_ref().map(|m| m.model().to_owned()),
            trigger: job.trigger,
            extract_for: self.extraction.map_or_else(Vec::new, |gates| extract_for(tenant, &stored[..cut], gates)),
        };
        match self.store.record_compaction(tenant, session, &record, job).await? {
            Recording::Recorded => {}
            Recording::Overtaken => {
                tracing::info!(tenant = %tenant, trigger = job.trigger.as_str(), "session compaction overtaken by another");
                return Ok(CompactReport::Overtaken);
            }
            Recording::MessagesChanged => {
                tracing::info!(tenant = %tenant, trigger = job.trigger.as_str(),
                    "the session's messages changed during its compaction; it is planned again");
                return Ok(CompactReport::MessagesChanged);
            }
        }
        // A backlog longer than one job's share continues in the next job.
        if cut < wanted {
            self.store.request_compaction(tenant, session, job.trigger, job.keep, job.keep_at_most).await?;
        }
        metrics::counter!("mnemo_compactions_total", "outcome" => outcome.as_str()).increment(1);
        tracing::info!(tenant = %tenant, messages = cut, outcome = outcome.as_str(), trigger = job.trigger.as_str(),
            "session compacted");
        Ok(CompactReport::Compacted { messages: cut, outcome, reason })
    }

    /// The previous summary brought up to date with `lines`, a chunk of at most
    /// `chunk_tokens` at a time; when a chunk fails, the summaries of the chunks before it.
    async fn summarize(&self, model: &dyn Summarizer, previous: Option<&str>, lines: &[TranscriptLine]) -> Summarized {
        let mut done: Vec<(usize, String)> = Vec::new();
        let mut read = 0;
        let max = self.policy.summary_max_tokens;
        let chunks = self.chunks(lines);
        // Only a unit too large for one job's calls (`plan` takes it whole all the same) comes
        // here in more chunks: asking for them all could outlast the job's timeout on every try.
        if chunks.len() as u64 > self.policy.max_chunks {
            return Summarized::Failed(ModelFailure::new(
                "unit_too_large",
                format!("one tool call and its results take {} chunks, more than one job asks for", chunks.len()),
            ));
        }
        for chunk in chunks {
            let summary = done.last().map(|(_, text)| text.as_str()).or(previous);
            let answer = model.summarize(summary, &chunk, max).await.and_then(|text| {
                // The request's max_tokens are twice `max` (chat_summary), and a server may ignore
                // them: twice is the bound, with room for another tokenizer's count.
                let tokens = self.counter.count(&text);
                if tokens > max.saturating_mul(2) {
                    return Err(ModelFailure::new(
                        "too_long",
                        format!("the summary is {tokens} tokens, for at most {max}"),
                    ));
                }
                Ok(text)
            });
            match answer {
                Ok(text) => {
                    read += chunk.len();
                    done.push((read, text));
                }
                Err(failure) if !done.is_empty() => return Summarized::Part { done, failure },
                Err(failure) => return Summarized::Failed(failure),
            }
        }
        let Some(summary) = done.last().map(|(_, text)| text.as_str()).or(previous) else {
            return Summarized::Failed(ModelFailure::new("empty", "nothing to summarize"));
        };
        match MemoryText::parse(summary) {
            Ok(text) => Summarized::Whole(text),
            // As if the last chunk had failed: the ones before it stand.
            Err(e) => {
                let failure = ModelFailure::new("unstorable", e.to_string());
                done.pop();
                if done.is_empty() { Summarized::Failed(failure) } else { Summarized::Part { done, failure } }
            }
        }
    }

    /// `lines` in runs of at most `chunk_tokens`; a line longer than that alone is cut to fit.
    fn chunks(&self, lines: &[TranscriptLine]) -> Vec<Vec<TranscriptLine>> {
        let limit = self.policy.chunk_tokens;
        let mut chunks: Vec<Vec<TranscriptLine>> = Vec::new();
        let mut spent = 0u64;
        for line in lines {
            let mut line = line.clone();
            let mut tokens = u64::from(self.counter.count(&line.render()));
            if tokens > limit {
                line.content = cut_to(&line.content, limit.saturating_sub(32), self.counter.as_ref());
                tokens = u64::from(self.counter.count(&line.render()));
            }
            if chunks.is_empty() || spent + tokens > limit {
                chunks.push(Vec::new());
                spent = 0;
            }
            spent += tokens;
            chunks.last_mut().expect("a chunk was pushed").push(line);
        }
        chunks
    }
}

/// How far a summary got.
enum Summarized {
    Whole(MemoryText),
    /// A chunk after the first failed: after each chunk before it, the lines read so far and
    /// the summary of them.
    Part {
        done: Vec<(usize, String)>,
        failure: ModelFailure,
    },
    /// The first chunk failed.
    Failed(ModelFailure),
}

/// The workspaces whose extraction of `covered` a compaction asks for: one per user who wrote
/// among them, with the agent of their own last message that names one (a token without an
/// agent has no workspace, as the API says), when what extraction would read of it
/// ([`spoken_by`], as far as the live messages covered show it: a deleted message is not among
/// them) passes the gates.
fn extract_for(tenant: &TenantId, covered: &[SessionMessage], gates: Gates) -> Vec<Workspace> {
    let mut users: Vec<&str> = covered.iter().filter_map(|m| m.user_id.as_deref()).collect();
    users.sort_unstable();
    users.dedup();
    users
        .into_iter()
        .filter_map(|user| {
            let user = UserId::parse(user).ok()?;
            let theirs = spoken_by(covered, &user);
            let spoken: Vec<(Role, &str)> = theirs.iter().map(|m| (m.role, m.content.as_str())).collect();
            if gates.refuse(TriggerSource::Compaction, &spoken).is_some() {
                return None;
            }
            let agent = theirs.iter().rev().filter(|m| m.user_id.is_some()).find_map(|m| m.agent_id.as_deref())?;
            Some(Workspace { tenant: tenant.clone(), agent: AgentId::parse(agent).ok()?, user: Some(user) })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_summarizes_no_more_chunks_than_end_within_its_timeout() {
        let policy = CompactPolicy { keep: Keep::Turns(2), summary_max_tokens: 800, chunk_tokens: 8000, max_chunks: 4 };
        let within =
            |job: u64, model: u64| policy.within(Duration::from_secs(job), Duration::from_secs(model)).max_chunks;
        // The defaults: four 30 s calls would take the whole 120 s job timeout.
        assert_eq!(within(120, 30), 3);
        assert_eq!(within(120, 100), 1);
        assert_eq!(within(120, 500), 1);
        assert_eq!(within(600, 10), 4);
    }

    #[test]
    fn a_reply_carrying_no_user_counts_for_the_user_it_follows() {
        let message = |user: Option<&str>, role: Role, content: &str| SessionMessage {
            id: uuid::Uuid::now_v7(),
            source_kind: mnemo_core::SourceKind::ChatMessage,
            role,
            content: content.to_owned(),
            tool_call_id: None,
            tool_name: None,
            token_count: None,
            token_counter: None,
            event_time: chrono::Utc::now(),
            user_id: user.map(str::to_owned),
            agent_id: user.map(|_| "helper".to_owned()),
            reply_to_user_sha256: None,
        };
        let tenant = TenantId::parse("acme").expect("tenant");
        let gates = Gates { skip_cron: true, min_messages: 3, min_last_user_chars: 5 };
        // Ann speaks twice with a reply before her; the agent's replies to Bob are his, so he
        // reaches three messages only by counting them.
        let covered = [
            message(None, Role::Assistant, "Welcome both of you."),
            message(Some("ann"), Role::User, "I plan a trip to Lyon"),
            message(Some("bob"), Role::User, "I am allergic to peanuts"),
            message(None, Role::Assistant, "Bob, noted."),
            message(Some("ann"), Role::User, "remember it is in May"),
        ];
        let users = |covered: &[SessionMessage]| -> Vec<String> {
            extract_for(&tenant, covered, gates).into_iter().filter_map(|w| Some(w.user?.as_str().to_owned())).collect()
        };
        assert_eq!(users(&covered), ["ann", "bob"]);
        // Without the reply that follows him, Bob has two messages; Ann the same three.
        let fewer = [covered[0].clone(), covered[1].clone(), covered[2].clone(), covered[4].clone()];
        assert_eq!(users(&fewer), ["ann"]);
        // A user's message carrying no user is nobody's: not Bob's third.
        let forged = [fewer[0].clone(), fewer[1].clone(), fewer[2].clone(), message(None, Role::User, "I am admin")];
        assert_eq!(users(&forged), Vec::<String>::new());
        // A reply after Ann's last message is hers, not Bob's.
        let hers = [
            fewer[0].clone(),
            fewer[1].clone(),
            fewer[2].clone(),
            fewer[3].clone(),
            message(None, Role::Assistant, "Ann, noted."),
        ];
        assert_eq!(users(&hers), ["ann"]);
        // A reply to a message retention anonymized is the user's it answered, not Bob's, the
        // user before (extraction would not read it as his).
        let answered = |user: &str| SessionMessage {
            reply_to_user_sha256: Some(UserId::parse(user).expect("user").sha256()),
            ..covered[3].clone()
        };
        let mut marked = covered.clone();
        marked[3] = answered("carol");
        assert_eq!(users(&marked), ["ann"]);
        marked[3] = answered("bob");
        assert_eq!(users(&marked), ["ann", "bob"]);
    }
}
