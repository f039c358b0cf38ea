//! Workspace files: the current state of each file and every state it had. Each change runs in
//! one transaction, serialized per file by an advisory lock: the new current row, its version
//! row, and an audit row naming the actor (ids, the path, sizes; never content). A user's
//! `MEMORY.md` and daily notes are also recall rows (kind `workspace_note`), re-indexed in that
//! same transaction.

use std::collections::HashSet;

use chrono::{DateTime, NaiveDate, Utc};
use mnemo_core::{
    AgentId, AuditEvent, FileKey, NOTE_CHUNK_BYTES, NewMemory, TenantId, UserId, Workspace, WorkspacePath, note_chunks,
};
use serde_json::json;
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, Postgres, Transaction};
use uuid::Uuid;

use crate::memories::insert_in;
use crate::{Store, StoreError};

/// A file's state without its content.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct FileMeta {
    #[sqlx(try_from = "String")]
    pub path: WorkspacePath,
    pub size_bytes: i32,
    pub enabled: bool,
    pub sort_order: i32,
    pub version: i32,
    pub updated_at: DateTime<Utc>,
    /// '' for the agent's own files.
    pub user_id: String,
}

/// A file with its content.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct WorkspaceFile {
    #[sqlx(try_from = "String")]
    pub path: WorkspacePath,
    pub content: String,
    pub size_bytes: i32,
    pub enabled: bool,
    pub sort_order: i32,
    pub version: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// One state a file had.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct FileVersion {
    pub version: i32,
    pub size_bytes: i32,
    pub enabled: bool,
    pub sort_order: i32,
    pub deleted: bool,
    pub actor: String,
    pub created_at: DateTime<Utc>,
    /// When retention redacted its text (see [`Store::redact_due_versions`]).
    pub redacted_at: Option<DateTime<Utc>>,
}

/// How a write landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    Created { version: i32 },
    Overwritten { version: i32 },
}

/// How a restore ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restored {
    /// The version's content is current again, as this new version.
    As(i32),
    NoSuchVersion,
    /// The version is this many bytes, over the limit a file holds now.
    TooLarge {
        bytes: usize,
    },
}

/// How a find-and-replace ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edited {
    Replaced {
        count: usize,
        version: i32,
    },
    NoSuchFile,
    TextNotFound,
    /// Found this many times, and `replace_all` was not asked for.
    Ambiguous {
        count: usize,
    },
    /// The edited file would be this many bytes, over the limit.
    TooLarge {
        bytes: usize,
    },
}

/// The change that creates a core file from its template: its content is boilerplate, so recall
/// does not index it.
const FROM_TEMPLATE: &str = "created_from_template";

/// The change that sets a file's `enabled` and `sort_order` only.
const PATCHED: &str = "patched";

/// The sort order of a file that is not a core file, unless a caller sets one.
pub const DEFAULT_SORT_ORDER: i32 = 100;

const LOCK_FILE: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1 || '/' || $2 || '/' || $3 || '/' || $4, 0))";

/// A user's files, as a whole: each write of one of them holds this shared for its transaction
/// (before the file's own lock), and the user's erasure holds it alone. An erasure then waits
/// for the writes in flight, whose new versions it could not see and would leave behind, and a
/// write that comes while it runs waits for it.
const LOCK_USER_FILES: &str =
    "SELECT pg_advisory_xact_lock_shared(hashtextextended('user files/' || $1 || '/' || $2, 0))";
const LOCK_USER_FILES_ALONE: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended('user files/' || $1 || '/' || $2, 0))";

const CURRENT: &str = "
SELECT path, content, size_bytes, enabled, sort_order, version, created_at, updated_at, deleted_at IS NOT NULL AS deleted
FROM workspace_files WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND path = $4";

const UPSERT: &str = "
INSERT INTO workspace_files (tenant_id, agent_id, user_id, path, id, content, size_bytes, enabled, sort_order, version, deleted_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, CASE WHEN $11 THEN now() END)
ON CONFLICT (tenant_id, agent_id, user_id, path) DO UPDATE SET
    content = EXCLUDED.content, size_bytes = EXCLUDED.size_bytes, enabled = EXCLUDED.enabled,
    sort_order = EXCLUDED.sort_order, version = EXCLUDED.version, deleted_at = EXCLUDED.deleted_at,
    updated_at = now()
RETURNING id";

const INSERT_VERSION: &str = "
INSERT INTO workspace_file_versions (tenant_id, agent_id, user_id, path, version, content, enabled, sort_order, deleted, actor)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";

const AUDIT: &str = "
INSERT INTO audit_log (tenant_id, event, item_id, reason, actor, details) VALUES ($1, $2, $3, $4, $5, $6)";

const LIST: &str = "
SELECT path, size_bytes, enabled, sort_order, version, updated_at, user_id
FROM workspace_files
WHERE tenant_id = $1 AND agent_id = $2 AND user_id IN ('', $3) AND deleted_at IS NULL
  AND starts_with(path, $4) AND ($5::int IS NULL OR (sort_order, path) > ($5, $6))
ORDER BY sort_order, path
LIMIT $7";

/// The enabled files a prompt renders as blocks: the agent's and the user's but those under
/// `memory/`, in any case (a prompt takes daily notes by day, below, not every file a user enabled
/// there; `is_under_memory`).
const ENABLED: &str = "
SELECT path, content, size_bytes, enabled, sort_order, version, created_at, updated_at
FROM workspace_files
WHERE tenant_id = $1 AND agent_id = $2 AND user_id IN ('', $3) AND deleted_at IS NULL AND enabled
  AND NOT (user_id <> '' AND lower(left(path, 7)) = 'memory/')
ORDER BY sort_order, path";

/// The user's live daily notes (`memory/YYYY-MM-DD.md`) from the day in `$4` through the day in `$5`.
const DAILY_NOTES: &str = "
SELECT path, content FROM workspace_files
WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND deleted_at IS NULL
  AND path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$' AND path >= $4 AND path <= $5
ORDER BY path DESC";

/// A recallable file's live pieces: ids and content hashes.
const LIVE_PIECES: &str = "
SELECT id, content_sha256 FROM memory_items
WHERE tenant_id = $1 AND source_kind = 'workspace_note' AND user_id = $2 AND agent_id = $3
  AND metadata ->> 'path' = $4 AND deleted_at IS NULL";

const RETIRE_PIECES: &str = "UPDATE memory_items SET deleted_at = now() WHERE tenant_id = $1 AND id = ANY($2)";

const HISTORY: &str = "
SELECT version, octet_length(content) AS size_bytes, enabled, sort_order, deleted, actor, created_at,
       redacted_at
FROM workspace_file_versions
WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND path = $4
ORDER BY version";

const VERSION_CONTENT: &str = "
SELECT content, redacted_at FROM workspace_file_versions
WHERE tenant_id = $1 AND agent_id = $2 AND user_id = $3 AND path = $4 AND version = $5";

/// Whether the file's first version was made from its template (the change its audit row names).
const FIRST_VERSION_FROM_TEMPLATE: &str = "
SELECT EXISTS (
    SELECT 1 FROM workspace_files f
    JOIN audit_log a ON a.tenant_id = f.tenant_id AND a.item_id = f.id
    WHERE f.tenant_id = $1 AND f.agent_id = $2 AND f.user_id = $3 AND f.path = $4
      AND a.reason = $5 AND (a.details ->> 'version')::int = 1)";

#[derive(sqlx::FromRow)]
pub(crate) struct Current {
    #[sqlx(flatten)]
    pub file: WorkspaceFile,
    pub deleted: bool,
}

/// The state a change leaves a file in.
pub(crate) struct NewState<'a> {
    pub content: &'a str,
    pub enabled: bool,
    pub sort_order: i32,
    pub deleted: bool,
}

/// How many places `old` starts at in `text`, overlapping ones too, counted up to 2 (one place
/// or more: finding every overlap of a long repeated text would take time quadratic in it); none
/// for an empty `old`.
fn places(text: &str, old: &str) -> usize {
    if old.is_empty() {
        return 0;
    }
    let mut from = 0;
    std::iter::from_fn(|| {
        let at = from + text[from..].find(old)?;
        from = at + text[at..].chars().next().map_or(1, char::len_utf8);
        Some(())
    })
    .take(2)
    .count()
}

fn user_column(key: &FileKey) -> &str {
    key.user.as_ref().map_or("", |u| u.as_str())
}

impl Store {
    /// Creates the core files the workspace lacks (never recreating one that was deleted), with
    /// the given contents; all but `except`, the file a caller is about to write, whose first
    /// version is then the caller's (a write expecting no file finds none).
    pub async fn ensure_core_files(
        &self,
        workspace: &Workspace,
        templates: &[(WorkspacePath, String)],
        except: Option<&WorkspacePath>,
    ) -> Result<(), StoreError> {
        // Without a user, only the agent's own core files.
        let files: Vec<(FileKey, &String)> = templates
            .iter()
            .filter(|(path, _)| Some(path) != except)
            .filter_map(|(path, content)| Some((workspace.file(path.clone()).ok()?, content)))
            .collect();
        let mut conn = self.tenant_connection([workspace.tenant.as_str()]).await?;
        // The usual case, every core file there already (or deleted on purpose): one read.
        let present: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM workspace_files f
             JOIN unnest($3::text[], $4::text[]) AS k(user_id, path) USING (user_id, path)
             WHERE f.tenant_id = $1 AND f.agent_id = $2",
        )
        .bind(workspace.tenant.as_str())
        .bind(workspace.agent.as_str())
        .bind(files.iter().map(|(k, _)| user_column(k).to_owned()).collect::<Vec<_>>())
        .bind(files.iter().map(|(k, _)| k.path.as_str().to_owned()).collect::<Vec<_>>())
        .fetch_one(&mut *conn)
        .await?;
        if present == files.len() as i64 {
            return Ok(());
        }
        for (key, content) in &files {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            lock(&mut tx, key).await?;
            if current(&mut tx, key).await?.is_none() {
                let state = NewState {
                    content,
                    enabled: true,
                    sort_order: key.path.core_sort_order().unwrap_or(0),
                    deleted: false,
                };
                apply(&mut tx, key, &state, 1, FROM_TEMPLATE, "api").await?;
            }
            tx.commit().await?;
        }
        Ok(())
    }

    /// The workspace's live files under `prefix`, by sort order and path: the agent's and, with
    /// a user, that user's; at most `limit`, after the (sort order, path) `after` when given.
    pub async fn list_files(
        &self,
        workspace: &Workspace,
        prefix: &str,
        after: Option<&(i32, String)>,
        limit: i64,
    ) -> Result<Vec<FileMeta>, StoreError> {
        Ok(sqlx::query_as(LIST)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(workspace.user.as_ref().map(|u| u.as_str()))
            .bind(prefix)
            .bind(after.map(|a| a.0))
            .bind(after.map(|a| a.1.as_str()))
            .bind(limit)
            .fetch_all(&mut *self.tenant_connection([workspace.tenant.as_str()]).await?)
            .await?)
    }

    /// The enabled live files a prompt renders as blocks (see `ENABLED`), by sort order.
    pub async fn enabled_files(&self, workspace: &Workspace) -> Result<Vec<WorkspaceFile>, StoreError> {
        Ok(sqlx::query_as(ENABLED)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(workspace.user.as_ref().map(|u| u.as_str()))
            .fetch_all(&mut *self.tenant_connection([workspace.tenant.as_str()]).await?)
            .await?)
    }

    /// The user's daily notes from `since` through `until`, newest first (none without a user).
    pub async fn daily_notes(
        &self,
        workspace: &Workspace,
        since: NaiveDate,
        until: NaiveDate,
    ) -> Result<Vec<(NaiveDate, String)>, StoreError> {
        let Some(user) = &workspace.user else { return Ok(Vec::new()) };
        let rows: Vec<(String, String)> = sqlx::query_as(DAILY_NOTES)
            .bind(workspace.tenant.as_str())
            .bind(workspace.agent.as_str())
            .bind(user.as_str())
            .bind(WorkspacePath::daily_note(since).as_str())
            .bind(WorkspacePath::daily_note(until).as_str())
            .fetch_all(&mut *self.tenant_connection([workspace.tenant.as_str()]).await?)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(path, content)| Some((WorkspacePath::parse(&path).ok()?.note_day()?, content)))
            .collect())
    }

    /// The live file, if there is one.
    pub async fn read_file(&self, key: &FileKey) -> Result<Option<WorkspaceFile>, StoreError> {
        let mut conn = self.tenant_connection([key.tenant.as_str()]).await?;
        Ok(current(&mut conn, key).await?.filter(|c| !c.deleted).map(|c| c.file))
    }

    /// Replaces the file's content, creating it (disabled, unless it is a core file) if needed.
    /// With `expected_version`, only while the live file is at that version (0: while there is
    /// none), so that a writer who read the file overwrites no change made since
    /// ([`StoreError::FileChanged`] otherwise, and nothing is written).
    pub async fn write_file(
        &self,
        key: &FileKey,
        content: &str,
        actor: &str,
        expected_version: Option<i32>,
    ) -> Result<Written, StoreError> {
        let mut conn = self.tenant_connection([key.tenant.as_str()]).await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        lock(&mut tx, key).await?;
        let current = current(&mut tx, key).await?;
        let live_version = current.as_ref().filter(|c| !c.deleted).map_or(0, |c| c.file.version);
        if expected_version.is_some_and(|expected| expected != live_version) {
            return Err(StoreError::FileChanged { path: key.path.as_str().to_owned() });
        }
        let written = match current {
            Some(c) if !c.deleted => {
                let state =
                    NewState { content, enabled: c.file.enabled, sort_order: c.file.sort_order, deleted: false };
                apply(&mut tx, key, &state, c.file.version + 1, "overwritten", actor).await?;
                Written::Overwritten { version: c.file.version + 1 }
            }
            previous => {
                let version = previous.map_or(1, |c| c.file.version + 1);
                let core = key.path.core_sort_order();
                let state = NewState {
                    content,
                    enabled: core.is_some(),
                    sort_order: core.unwrap_or(DEFAULT_SORT_ORDER),
                    deleted: false,
                };
                apply(&mut tx, key, &state, version, "created", actor).await?;
                Written::Created { version }
            }
        };
        tx.commit().await?;
        Ok(written)
    }

    /// Replaces `old` with `new` in the file: once, or everywhere with `replace_all`.
    pub async fn edit_file(
        &self,
        key: &FileKey,
        old: &str,
        new: &str,
        replace_all: bool,
        max_bytes: usize,
        actor: &str,
    ) -> Result<Edited, StoreError> {
        let mut conn = self.tenant_connection([key.tenant.as_str()]).await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        lock(&mut tx, key).await?;
        let Some(c) = current(&mut tx, key).await?.filter(|c| !c.deleted) else { return Ok(Edited::NoSuchFile) };
        // Without `replace_all` an edit names one place: two that overlap ("x\nx\n" in
        // "x\nx\nx\n") are two places, though `matches` finds one.
        let count = match c.file.content.matches(old).count() {
            1 if !replace_all => places(&c.file.content, old),
            n => n,
        };
        let edited = match count {
            0 => Edited::TextNotFound,
            n if n > 1 && !replace_all => Edited::Ambiguous { count: n },
            n => {
                let replaced = if replace_all { n } else { 1 };
                // Sized before it is built: many matches of a short text replaced by a long one
                // would otherwise build a string of gigabytes.
                let bytes =
                    (c.file.content.len() - replaced * old.len()).saturating_add(replaced.saturating_mul(new.len()));
                if bytes > max_bytes {
                    return Ok(Edited::TooLarge { bytes });
                }
                let content = c.file.content.replacen(old, new, replaced);
                let state = NewState {
                    content: &content,
                    enabled: c.file.enabled,
                    sort_order: c.file.sort_order,
                    deleted: false,
                };
                apply(&mut tx, key, &state, c.file.version + 1, "edited", actor).await?;
                Edited::Replaced { count: n, version: c.file.version + 1 }
            }
        };
        tx.commit().await?;
        Ok(edited)
    }

    /// Sets the file's `enabled` and `sort_order`; `None` when there is no such live file.
    pub async fn patch_file(
        &self,
        key: &FileKey,
        enabled: Option<bool>,
        sort_order: Option<i32>,
        actor: &str,
    ) -> Result<Option<WorkspaceFile>, StoreError> {
        let mut conn = self.tenant_connection([key.tenant.as_str()]).await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        lock(&mut tx, key).await?;
        let Some(c) = current(&mut tx, key).await?.filter(|c| !c.deleted) else { return Ok(None) };
        let state = NewState {
            content: &c.file.content,
            enabled: enabled.unwrap_or(c.file.enabled),
            sort_order: sort_order.unwrap_or(c.file.sort_order),
            deleted: false,
        };
        apply(&mut tx, key, &state, c.file.version + 1, PATCHED, actor).await?;
        let patched = current(&mut tx, key).await?.map(|c| c.file);
        tx.commit().await?;
        Ok(patched)
    }

    /// Soft-deletes the file (its versions stay); the new version, or `None` when there is no
    /// such live file.
    pub async fn delete_file(&self, key: &FileKey, actor: &str) -> Result<Option<i32>, StoreError> {
        let mut conn = self.tenant_connection([key.tenant.as_str()]).await?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        lock(&mut tx, key).await?;
        let Some(c) = current(&mut tx, key).await?.filter(|c| !c.deleted) else { return Ok(None) };
        let state = NewState {
            content: &c.file.content,
            enabled: c.file.enabled,
            sort_order: c.file.sort_order,
            deleted: true,
        };
        apply(&mut tx, key, &state, c.file.version + 1, "deleted", actor).await?;
        tx.commit().await?;
        Ok(Some(c.file.version + 1))
    }

    /// Indexes every live MEMORY.md and daily note (of `tenant`, or of all tenants) for recall
    /// as it is now, for files written before recall indexed them; pieces already indexed keep
    /// their rows. Calls `progress` with (files done, files found) after each file. How many
    /// files were indexed (one deleted meanwhile is not).
    pub async fn reindex_recallable_files(
        &self,
        tenant: Option<&TenantId>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<u64, StoreError> {
        let files: Vec<(String, String, String, String)> = sqlx::query_as(
            "SELECT tenant_id, agent_id, user_id, path FROM workspace_files
             WHERE ($1::text IS NULL OR tenant_id = $1) AND user_id <> '' AND deleted_at IS NULL
               AND (path = 'MEMORY.md' OR path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$')
             ORDER BY tenant_id, agent_id, user_id, path",
        )
        .bind(tenant.map(TenantId::as_str))
        .fetch_all(&self.pool)
        .await?;
        let mut indexed = 0;
        for (done, (tenant, agent, user, path)) in files.iter().enumerate() {
            let key = FileKey {
                tenant: TenantId::parse(tenant)?,
                agent: AgentId::parse(agent)?,
                user: Some(UserId::parse(user)?),
                path: WorkspacePath::parse(path)?,
            };
            let mut tx = self.pool.begin().await?;
            lock(&mut tx, &key).await?;
            if let Some(c) = current(&mut tx, &key).await?.filter(|c| !c.deleted) {
                reindex(&mut tx, &key, &c.file.content, false, c.file.version).await?;
                indexed += 1;
            }
            tx.commit().await?;
            progress(done as u64 + 1, files.len() as u64);
        }
        Ok(indexed)
    }

    /// Every state the file had, oldest first (empty when it never existed).
    pub async fn file_history(&self, key: &FileKey) -> Result<Vec<FileVersion>, StoreError> {
        Ok(sqlx::query_as(HISTORY)
            .bind(key.tenant.as_str())
            .bind(key.agent.as_str())
            .bind(user_column(key))
            .bind(key.path.as_str())
            .fetch_all(&self.pool)
            .await?)
    }

    /// The content of one version of the file; [`StoreError::VersionRedacted`] when retention
    /// took it.
    pub async fn file_version_content(&self, key: &FileKey, version: i32) -> Result<Option<String>, StoreError> {
        let found: Option<(String, Option<DateTime<Utc>>)> = sqlx::query_as(VERSION_CONTENT)
            .bind(key.tenant.as_str())
            .bind(key.agent.as_str())
            .bind(user_column(key))
            .bind(key.path.as_str())
            .bind(version)
            .fetch_optional(&self.pool)
            .await?;
        match found {
            Some((_, Some(at))) => Err(StoreError::VersionRedacted { version, at }),
            found => Ok(found.map(|(content, _)| content)),
        }
    }

    /// Makes version `version`'s content current again, as a new version (undeleting the file),
    /// unless it is over `max_bytes` (the limit may have been lowered since it was written).
    pub async fn restore_file(
        &self,
        key: &FileKey,
        version: i32,
        max_bytes: usize,
        actor: &str,
    ) -> Result<Restored, StoreError> {
        let mut tx = self.pool.begin().await?;
        lock(&mut tx, key).await?;
        let content = self.file_version_content(key, version).await?;
        let (Some(content), Some(c)) = (content, current(&mut tx, key).await?) else {
            return Ok(Restored::NoSuchVersion);
        };
        if content.len() > max_bytes {
            return Ok(Restored::TooLarge { bytes: content.len() });
        }
        let state =
            NewState { content: &content, enabled: c.file.enabled, sort_order: c.file.sort_order, deleted: false };
        apply(&mut tx, key, &state, c.file.version + 1, "restored", actor).await?;
        tx.commit().await?;
        Ok(Restored::As(c.file.version + 1))
    }
}

/// The workspace's user, for state kept per (agent, user): a workspace without one is the
/// caller's mistake.
pub(crate) fn user_of(workspace: &Workspace) -> Result<&str, StoreError> {
    workspace
        .user
        .as_ref()
        .map(|u| u.as_str())
        .ok_or(StoreError::Stored(mnemo_core::InvalidInput::Empty { field: "user" }))
}

/// The key of `path` in `workspace`, for jobs acting for its user.
pub(crate) fn key_in(workspace: &Workspace, path: WorkspacePath) -> Result<FileKey, StoreError> {
    workspace.file(path).map_err(|_| StoreError::Stored(mnemo_core::InvalidInput::Empty { field: "user" }))
}

/// A model's new content for a core file, and the version of the file it was made from (`None`:
/// there was no live file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replacement {
    pub content: String,
    pub read_version: Option<i32>,
}

/// Replaces core file `name` (PROFILE.md, MEMORY.md) inside `tx`, as a new version written by
/// `actor`, if the file still holds what the replacement was made from: the version read, or a
/// later one with the same content (a patch of `enabled` or `sort_order`, which the replacement
/// keeps), or, when there was no live file, one just made from its template; false, writing
/// nothing, when it does not (an edit made during the model call is never overwritten, and a file
/// deleted meanwhile stays deleted). A missing file is created enabled at its core sort order.
pub(crate) async fn replace_core_file(
    tx: &mut Transaction<'_, Postgres>,
    workspace: &Workspace,
    name: &str,
    replacement: &Replacement,
    actor: &str,
) -> Result<bool, StoreError> {
    let path = WorkspacePath::parse(name).expect("core file names are valid paths");
    let key = key_in(workspace, path.clone())?;
    lock(tx, &key).await?;
    let now = current(tx, &key).await?;
    let live = now.as_ref().filter(|c| !c.deleted);
    if live.map(|c| c.file.version) != replacement.read_version {
        let Some(live) = live else { return Ok(false) };
        let unchanged = match replacement.read_version {
            Some(read) => {
                let read_content: Option<String> = sqlx::query_scalar(VERSION_CONTENT)
                    .bind(key.tenant.as_str())
                    .bind(key.agent.as_str())
                    .bind(user_column(&key))
                    .bind(key.path.as_str())
                    .bind(read)
                    .fetch_optional(&mut **tx)
                    .await?;
                read_content.as_deref() == Some(live.file.content.as_str())
            }
            // Created from its template meanwhile (a request for the workspace's files does
            // that) and not changed since: the model would have rewritten the template.
            None => {
                live.file.version == 1
                    && sqlx::query_scalar(FIRST_VERSION_FROM_TEMPLATE)
                        .bind(key.tenant.as_str())
                        .bind(key.agent.as_str())
                        .bind(user_column(&key))
                        .bind(key.path.as_str())
                        .bind(FROM_TEMPLATE)
                        .fetch_one(&mut **tx)
                        .await?
            }
        };
        if !unchanged {
            return Ok(false);
        }
    }
    let content = replacement.content.as_str();
    let state = NewState {
        content,
        enabled: now.as_ref().is_none_or(|c| c.file.enabled),
        sort_order: now.as_ref().map_or(path.core_sort_order().unwrap_or(0), |c| c.file.sort_order),
        deleted: false,
    };
    let version = now.as_ref().map_or(1, |c| c.file.version + 1);
    apply(tx, &key, &state, version, "overwritten", actor).await?;
    Ok(true)
}

pub(crate) async fn lock(tx: &mut Transaction<'_, Postgres>, key: &FileKey) -> Result<(), StoreError> {
    lock_stored(tx, key.tenant.as_str(), key.agent.as_str(), user_column(key), key.path.as_str()).await
}

/// [`lock`] by the names a row stores (`user` '' for the agent's files), for a sweep reading
/// files back: one stored under older path rules may no longer parse, and is locked all the same.
pub(crate) async fn lock_stored(
    tx: &mut Transaction<'_, Postgres>,
    tenant: &str,
    agent: &str,
    user: &str,
    path: &str,
) -> Result<(), StoreError> {
    if !user.is_empty() {
        share_user_files(tx, tenant, user).await?;
    }
    sqlx::query(LOCK_FILE).bind(tenant).bind(agent).bind(user).bind(path).execute(&mut **tx).await?;
    Ok(())
}

/// Shares the user's files until `tx` ends, as a write of one of them does: the user's erasure
/// waits for `tx`, and `tx` waits for an erasure under way (see [`LOCK_USER_FILES`]).
pub(crate) async fn share_user_files(
    tx: &mut Transaction<'_, Postgres>,
    tenant: &str,
    user: &str,
) -> Result<(), StoreError> {
    sqlx::query(LOCK_USER_FILES).bind(tenant).bind(user).execute(&mut **tx).await?;
    Ok(())
}

/// Holds every file of the user still until `tx` ends (see [`LOCK_USER_FILES`]).
pub(crate) async fn lock_user_files(
    tx: &mut Transaction<'_, Postgres>,
    tenant: &TenantId,
    user: &UserId,
) -> Result<(), StoreError> {
    sqlx::query(LOCK_USER_FILES_ALONE).bind(tenant.as_str()).bind(user.as_str()).execute(&mut **tx).await?;
    Ok(())
}

pub(crate) async fn current(conn: &mut PgConnection, key: &FileKey) -> Result<Option<Current>, StoreError> {
    Ok(sqlx::query_as(CURRENT)
        .bind(key.tenant.as_str())
        .bind(key.agent.as_str())
        .bind(user_column(key))
        .bind(key.path.as_str())
        .fetch_optional(conn)
        .await?)
}

/// Writes the file's new state as version `version`, its version row and its audit row.
pub(crate) async fn apply(
    tx: &mut Transaction<'_, Postgres>,
    key: &FileKey,
    state: &NewState<'_>,
    version: i32,
    change: &str,
    actor: &str,
) -> Result<(), StoreError> {
    let (tenant, agent, user, path) = (key.tenant.as_str(), key.agent.as_str(), user_column(key), key.path.as_str());
    let size = i32::try_from(state.content.len()).unwrap_or(i32::MAX);
    let id: Uuid = sqlx::query_scalar(UPSERT)
        .bind(tenant)
        .bind(agent)
        .bind(user)
        .bind(path)
        .bind(Uuid::now_v7())
        .bind(state.content)
        .bind(size)
        .bind(state.enabled)
        .bind(state.sort_order)
        .bind(version)
        .bind(state.deleted)
        .fetch_one(&mut **tx)
        .await?;
    sqlx::query(INSERT_VERSION)
        .bind(tenant)
        .bind(agent)
        .bind(user)
        .bind(path)
        .bind(version)
        .bind(state.content)
        .bind(state.enabled)
        .bind(state.sort_order)
        .bind(state.deleted)
        .bind(actor)
        .execute(&mut **tx)
        .await?;
    let mut details = audited_file(agent, user, path, key.path.is_standard_name());
    details["version"] = json!(version);
    details["bytes"] = json!(size);
    audit_change(tx, tenant, id, change, actor, details).await?;
    // A template is boilerplate, and a patch leaves the content as it was.
    if change != FROM_TEMPLATE && change != PATCHED {
        reindex(tx, key, state.content, state.deleted, version).await?;
    }
    Ok(())
}

/// How an audit row names a file (`user` '' for the agent's): the user by a hash, as erasure
/// names them (the audit log outlives an erasure), and so a user's own file name, which may say
/// what the file held; a name mnemo gives (`standard`) as it is.
pub(crate) fn audited_file(agent: &str, user: &str, path: &str, standard: bool) -> serde_json::Value {
    let hash = |text: &str| hex::encode(Sha256::digest(text.as_bytes()));
    let mut details = json!({ "agent": agent, "user_sha256": (!user.is_empty()).then(|| hash(user)) });
    if user.is_empty() || standard {
        details["path"] = json!(path);
    } else {
        details["path_sha256"] = json!(hash(path));
    }
    details
}

/// Writes a `workspace.change` audit row about file `id` of `tenant`: the change, who made it,
/// `details`.
pub(crate) async fn audit_change(
    tx: &mut Transaction<'_, Postgres>,
    tenant: &str,
    id: Uuid,
    change: &str,
    actor: &str,
    details: serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query(AUDIT)
        .bind(tenant)
        .bind(AuditEvent::WorkspaceChange.as_str())
        .bind(id)
        .bind(change)
        .bind(actor)
        .bind(details)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Keeps recall's pieces of a user's `MEMORY.md` or daily note in step with the file's new state:
/// pieces it still has keep their rows (and vectors), pieces it lost are retired (soft-deleted,
/// for retention), new pieces become rows queued for embedding.
async fn reindex(
    tx: &mut Transaction<'_, Postgres>,
    key: &FileKey,
    content: &str,
    deleted: bool,
    version: i32,
) -> Result<(), StoreError> {
    let Some(user) = key.user.as_ref().filter(|_| key.path.is_recallable()) else { return Ok(()) };
    let live: Vec<(Uuid, Vec<u8>)> = sqlx::query_as(LIVE_PIECES)
        .bind(key.tenant.as_str())
        .bind(user.as_str())
        .bind(key.agent.as_str())
        .bind(key.path.as_str())
        .fetch_all(&mut **tx)
        .await?;
    let pieces = if deleted { Vec::new() } else { note_chunks(content, NOTE_CHUNK_BYTES) };
    let mut wanted = HashSet::new();
    let mut rows = Vec::new();
    for (index, piece) in pieces.into_iter().enumerate() {
        let sha = Sha256::digest(piece.as_bytes()).to_vec();
        if wanted.insert(sha.clone()) && !live.iter().any(|(_, s)| *s == sha) {
            rows.push(NewMemory::workspace_note(key, version, index, piece)?);
        }
    }
    let mut kept = HashSet::new();
    let retired: Vec<Uuid> =
        live.iter().filter(|(_, sha)| !(wanted.contains(sha) && kept.insert(sha))).map(|(id, _)| *id).collect();
    if !retired.is_empty() {
        sqlx::query(RETIRE_PIECES).bind(key.tenant.as_str()).bind(&retired).execute(&mut **tx).await?;
    }
    if !rows.is_empty() {
        for result in insert_in(tx, &rows.iter().collect::<Vec<_>>()).await? {
            match result.unwrap_or(Err(StoreError::Database(sqlx::Error::RowNotFound))) {
                // Its user deleted this piece of this version: hidden until the file changes.
                Ok(_) | Err(StoreError::SourceRefDeleted { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}
