//! Background maintenance, once per interval across all workers: daily notes older than their
//! retention move to `memory/archive/` (disabled, still readable, every step versioned with the
//! actor `maintenance`), and session messages older than theirs are soft-deleted, with audit
//! rows, so the retention sweep anonymizes them. Both statements are cross-tenant by design
//! (housekeeping finds the work); each file move names its own tenant, agent and user.

use std::time::Duration;

use chrono::NaiveDate;
use mnemo_core::{AgentId, AuditEvent, FileKey, TenantId, UserId, WorkspacePath};

use crate::workspace::{NewState, apply, current, lock};
use crate::{DEFAULT_SORT_ORDER, Store, StoreError};

const ACTOR: &str = "maintenance";

/// Takes run `$1` for worker `$2`, or over from a holder silent past `$3` seconds (killed, or
/// stopped by a deploy, mid-run: every step is bounded and safe to run again).
const CLAIM: &str = "
INSERT INTO maintenance_runs (tick, worker) VALUES ($1, $2)
ON CONFLICT (tick) DO UPDATE SET worker = $2, started_at = now()
WHERE maintenance_runs.finished_at IS NULL AND maintenance_runs.started_at < now() - make_interval(secs => $3)";

/// Finishes run `$1` if worker `$7` still holds it (not taken over after it went silent).
const FINISH: &str =
    "UPDATE maintenance_runs SET archived = $2, pruned = $3, promoted = $4, faded = $5, forgotten = $6,
                                finished_at = now()
     WHERE tick = $1 AND worker = $7 AND finished_at IS NULL";

/// Live daily notes of days before `$1` (a path bound), at most `$2`, in key order after the
/// key `($3, $4, $5, $6)`: a page at a time, so a row passed over never holds up the rest.
const OLD_NOTES: &str = "
SELECT tenant_id, agent_id, user_id, path FROM workspace_files
WHERE user_id <> '' AND deleted_at IS NULL
  AND path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$' AND path < $1
  AND (tenant_id, agent_id, user_id, path) > ($3, $4, $5, $6)
ORDER BY tenant_id, agent_id, user_id, path
LIMIT $2";

/// Soft-deletes at most `$2` live rows (messages, tool outputs, summaries) of sessions idle for `$1`
/// days, with an audit row each. A session still in use keeps its old messages and the summary
/// that stands for them: its window starts after what was compacted, and the agent would forget
/// the start of a live conversation. Idle: no live message of the session is newer (read
/// through the session's index of messages). Old: by its date and by its write, so that a
/// conversation written today with its real, old dates (a backfill) is not pruned at once.
const PRUNE_SESSIONS: &str = "
WITH old AS (
    SELECT m.tenant_id, m.id FROM memory_items m
    WHERE m.scope = 'session' AND m.source_kind IN ('chat_message', 'tool_output', 'session_summary')
      AND m.deleted_at IS NULL AND m.anonymized_at IS NULL
      AND m.event_time < now() - make_interval(days => $1) AND m.created_at < now() - make_interval(days => $1)
      AND NOT EXISTS (
          SELECT 1 FROM memory_items n
          WHERE n.tenant_id = m.tenant_id AND n.session_id = m.session_id AND n.scope = 'session'
            AND n.source_kind IN ('chat_message', 'tool_output') AND n.deleted_at IS NULL AND n.anonymized_at IS NULL
            AND n.event_time >= now() - make_interval(days => $1))
    LIMIT $2
    FOR UPDATE OF m SKIP LOCKED
), deleted AS (
    UPDATE memory_items m SET deleted_at = now()
    FROM old WHERE m.tenant_id = old.tenant_id AND m.id = old.id
    RETURNING m.tenant_id, m.id
), audit AS (
    INSERT INTO audit_log (tenant_id, event, item_id, reason, actor)
    SELECT tenant_id, $3, id, 'session_retention', 'maintenance' FROM deleted
)
SELECT count(*) FROM deleted";

/// What one maintenance run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Maintained {
    pub archived: u64,
    pub pruned: u64,
    /// Episodic memories promoted to semantic.
    pub promoted: u64,
    /// Episodic memories that left packs.
    pub faded: u64,
    /// Faded memories deleted for their decay.
    pub forgotten: u64,
}

impl Store {
    /// Claims maintenance run `tick` for `worker`: one caller per tick gets `true`, and another
    /// once the run has been held unfinished for longer than `stale` (its holder died).
    pub async fn claim_maintenance(&self, tick: i64, worker: &str, stale: Duration) -> Result<bool, StoreError> {
        let claimed = sqlx::query(CLAIM).bind(tick).bind(worker).bind(stale.as_secs_f64()).execute(&self.pool).await?;
        Ok(claimed.rows_affected() == 1)
    }

    /// Gives up `worker`'s claim of `tick` when its run failed, so the next caller runs it
    /// again; not a claim another worker took over meanwhile.
    pub async fn release_maintenance(&self, tick: i64, worker: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM maintenance_runs WHERE tick = $1 AND worker = $2 AND finished_at IS NULL")
            .bind(tick)
            .bind(worker)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Records `worker`'s run of `tick` as finished with what it did, if it still holds it;
    /// whether it did.
    pub async fn finish_maintenance(&self, tick: i64, worker: &str, done: Maintained) -> Result<bool, StoreError> {
        let finished = sqlx::query(FINISH)
            .bind(tick)
            .bind(done.archived as i64)
            .bind(done.pruned as i64)
            .bind(done.promoted as i64)
            .bind(done.faded as i64)
            .bind(done.forgotten as i64)
            .bind(worker)
            .execute(&self.pool)
            .await?;
        Ok(finished.rows_affected() == 1)
    }

    /// Moves at most `limit` daily notes of days before `before` to `memory/archive/`, one
    /// transaction each: the archive copy (disabled) and the note's soft delete. A note that
    /// would take its day's archive past `max_bytes` stays where it is.
    pub async fn archive_daily_notes(
        &self,
        before: NaiveDate,
        limit: i64,
        max_bytes: usize,
    ) -> Result<u64, StoreError> {
        if limit < 1 {
            return Ok(0);
        }
        let bound = WorkspacePath::daily_note(before);
        let mut after = (String::new(), String::new(), String::new(), String::new());
        let mut archived = 0;
        loop {
            let page: Vec<(String, String, String, String)> = sqlx::query_as(OLD_NOTES)
                .bind(bound.as_str())
                .bind(limit)
                .bind(&after.0)
                .bind(&after.1)
                .bind(&after.2)
                .bind(&after.3)
                .fetch_all(&self.pool)
                .await?;
            let last_page = (page.len() as i64) < limit;
            for row in page {
                if self.archive_note(&row.0, &row.1, &row.2, &row.3, max_bytes).await? {
                    archived += 1;
                    if archived as i64 == limit {
                        return Ok(archived);
                    }
                }
                after = row;
            }
            if last_page {
                return Ok(archived);
            }
        }
    }

    /// Archives one daily note; false when it is not one, is gone already, or does not fit.
    async fn archive_note(
        &self,
        tenant: &str,
        agent: &str,
        user: &str,
        path: &str,
        max_bytes: usize,
    ) -> Result<bool, StoreError> {
        // A name of no real day (written before such names were refused) is passed over.
        let Ok(note) = WorkspacePath::parse(path) else { return Ok(false) };
        let Some(day) = note.note_day() else { return Ok(false) };
        let archive = WorkspacePath::parse(&format!("memory/archive/{}.md", day.format("%Y-%m-%d")))
            .map_err(StoreError::Stored)?;
        let key = |path: WorkspacePath| -> Option<FileKey> {
            Some(FileKey {
                tenant: TenantId::parse(tenant).ok()?,
                agent: AgentId::parse(agent).ok()?,
                user: Some(UserId::parse(user).ok()?),
                path,
            })
        };
        // Nor are ids that no longer parse: one such note must not stop every note's archiving.
        let (Some(from), Some(to)) = (key(note), key(archive)) else {
            tracing::warn!("a daily note is passed over: its ids do not parse");
            return Ok(false);
        };
        let mut tx = self.pool.begin().await?;
        lock(&mut tx, &from).await?;
        lock(&mut tx, &to).await?;
        let Some(note) = current(&mut tx, &from).await?.filter(|c| !c.deleted) else { return Ok(false) };
        let existing = current(&mut tx, &to).await?;
        // A note of a day archived before (written again since) is added to that day's archive,
        // not put in its place; a note the archive holds already (restored from an earlier
        // version, say) is not added twice.
        let archived = existing.as_ref().filter(|c| !c.deleted && !c.file.content.trim().is_empty());
        let held = archived.is_some_and(|a| holds_note(&a.file.content, &note.file.content));
        let content = match archived {
            Some(archived) if held => archived.file.content.clone(),
            Some(archived) => format!("{}\n\n{}", archived.file.content.trim_end(), note.file.content),
            None => note.file.content.clone(),
        };
        // An archive no edit could then save (full, or the limit lowered since the note was
        // written): the note stays, whole, where it is.
        if !held && content.len() > max_bytes {
            tracing::debug!(tenant, "a daily note stays: its day's archive would be over the file limit");
            return Ok(false);
        }
        let copy = NewState { content: &content, enabled: false, sort_order: DEFAULT_SORT_ORDER, deleted: false };
        apply(&mut tx, &to, &copy, existing.map_or(1, |c| c.file.version + 1), "archived", ACTOR).await?;
        let gone = NewState {
            content: &note.file.content,
            enabled: note.file.enabled,
            sort_order: note.file.sort_order,
            deleted: true,
        };
        apply(&mut tx, &from, &gone, note.file.version + 1, "deleted", ACTOR).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Soft-deletes at most `limit` messages and summaries of sessions idle for `days` days (the
    /// retention sweep anonymizes them later); how many.
    pub async fn prune_old_sessions(&self, days: u32, limit: i64) -> Result<u64, StoreError> {
        let pruned: i64 = sqlx::query_scalar(PRUNE_SESSIONS)
            .bind(i32::try_from(days).unwrap_or(i32::MAX))
            .bind(limit)
            .bind(AuditEvent::Delete.as_str())
            .fetch_one(&self.pool)
            .await?;
        Ok(pruned as u64)
    }
}

/// Whether a day's archive holds `note` as one of the notes it was made of (or a run of them):
/// whole, between the blank lines archiving puts between notes, not a fragment of a sentence,
/// which would leave the note's words in no live file.
fn holds_note(archive: &str, note: &str) -> bool {
    let (archive, note) = (archive.trim(), note.trim());
    note.is_empty()
        || archive.match_indices(note).any(|(at, _)| {
            let (before, after) = (&archive[..at], &archive[at + note.len()..]);
            (before.is_empty() || before.ends_with("\n\n")) && (after.is_empty() || after.starts_with("\n\n"))
        })
}
