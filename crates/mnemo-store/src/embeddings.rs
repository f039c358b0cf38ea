//! Embedding state: which rows a batch of embed jobs should embed, writing vectors back,
//! recording failures, and re-queueing. Vectors live in `memory_embeddings`, one per (row,
//! model); `memory_items.embedded_model` names the model whose vector matches the row's current
//! content.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use mnemo_core::{Queue, TenantId};
use pgvector::Vector;
use uuid::Uuid;

use crate::judge::push_judge_jobs;
use crate::queue::{EmbedJob, EmbedRow, push, push_after};
use crate::{Store, StoreError};

/// A row an embed job asked for, as it is now.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct RowToEmbed {
    pub id: Uuid,
    #[sqlx(try_from = "String")]
    pub tenant_id: TenantId,
    pub content: String,
    pub content_sha256: Vec<u8>,
    pub created_at: DateTime<Utc>,
    /// For a chat message when asked for, the session's chat message before it in conversation
    /// order that every role seeing this row may see too, if any.
    pub previous: Option<String>,
    /// That message's id.
    pub previous_id: Option<Uuid>,
    /// A vector of this model for this content exists already, and the row names a model (one
    /// that names none has no full text counted yet: it is embedded, and counted, again).
    pub done: bool,
    /// The row names this model and is not failing. A row done but not recorded (its vector
    /// made before a switch to another model and back) is recorded by
    /// [`Store::record_embedded`], or housekeeping would queue it again forever.
    pub recorded: bool,
}

/// A row's failed attempt to record: retried after `retry_after`, or given up without it.
#[derive(Debug, Clone)]
pub struct EmbedFailure<'a> {
    pub job: &'a EmbedRow,
    pub error: String,
    pub retry_after: Option<Duration>,
}

/// A vector to store for a row's content as it was read.
#[derive(Debug, Clone)]
pub struct NewVector {
    pub id: Uuid,
    pub tenant_id: TenantId,
    pub content_sha256: Vec<u8>,
    pub embedding: Vec<f32>,
    /// The message whose words were embedded with the content, if any: anonymizing it drops
    /// this vector.
    pub previous_id: Option<Uuid>,
}

const ROWS_TO_EMBED: &str = "
SELECT m.id, m.tenant_id, m.content, m.content_sha256, m.created_at, p.previous, p.previous_id,
       (e.item_id IS NOT NULL AND m.embedded_model IS NOT NULL) AS done,
       (m.embedded_model IS NOT DISTINCT FROM $3 AND m.embed_failing_since IS NULL AND m.embed_error IS NULL) AS recorded
-- Two jobs naming one row (a recovered orphan and its re-queued copy) read it once.
FROM (SELECT DISTINCT id, tenant_id FROM unnest($1::uuid[], $2::text[]) AS u(id, tenant_id)) AS j
JOIN memory_items m ON m.id = j.id AND m.tenant_id = j.tenant_id
LEFT JOIN memory_embeddings e ON e.tenant_id = m.tenant_id AND e.item_id = m.id AND e.model = $3 AND e.content_sha256 = m.content_sha256
-- p's conditions hold the conversation index's predicate: finding the previous turn is one probe.
LEFT JOIN LATERAL (
    -- Characters, so at least as many bytes as the embedded text keeps: a long turn is not read whole.
    SELECT left(p.content, $5) AS previous, p.id AS previous_id FROM memory_items p
    WHERE $4 AND m.source_kind = 'chat_message' AND m.scope = 'session'
      AND p.tenant_id = m.tenant_id AND p.session_id = m.session_id AND p.scope = 'session'
      AND p.source_kind IN ('chat_message', 'tool_output') AND p.deleted_at IS NULL AND p.anonymized_at IS NULL
      AND (p.event_time, p.id) < (m.event_time, m.id) AND p.source_kind = 'chat_message'
      -- Only a turn everyone who may see m may see too: roles never leak words through a vector.
      AND (p.allowed_roles = '{}' OR (m.allowed_roles <> '{}' AND m.allowed_roles <@ p.allowed_roles))
    ORDER BY p.event_time DESC, p.id DESC LIMIT 1
) p ON true
WHERE m.deleted_at IS NULL AND m.anonymized_at IS NULL";

/// Stores vectors only for rows whose content is still what was embedded; a row changed since
/// has a newer job of its own. Nor a vector made with a previous turn deleted or anonymized
/// since: that could not drop a vector not yet stored (the caller queues its row again). A
/// live fact not yet judged is marked for the judge. A row whose full text is computed now for
/// the first time adds its lexemes to its tenant's counts, which keyword search weighs words by
/// (migration 032). Run under `LOCK_TEXT_COUNTS`, so `was` (the statement's snapshot) already
/// holds whatever another transaction counted.
const SAVE_VECTORS: &str = "
WITH v AS (
    -- One vector a row: an upsert may not touch a row twice.
    SELECT DISTINCT ON (id, tenant_id) *
    FROM unnest($1::uuid[], $2::text[], $3::bytea[], $4::vector[], $6::uuid[]) AS v(id, tenant_id, sha, embedding, previous_id)
), current AS (
    SELECT v.* FROM v JOIN memory_items m ON m.id = v.id AND m.tenant_id = v.tenant_id AND m.content_sha256 = v.sha
    WHERE m.anonymized_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM memory_items p
                      WHERE p.tenant_id = v.tenant_id AND p.id = v.previous_id
                        AND (p.deleted_at IS NOT NULL OR p.anonymized_at IS NOT NULL))
), saved AS (
    INSERT INTO memory_embeddings (tenant_id, item_id, model, embedding, content_sha256, previous_id)
    SELECT tenant_id, id, $5, embedding, sha, previous_id FROM current
    ON CONFLICT (tenant_id, item_id, model) DO UPDATE
        SET embedding = EXCLUDED.embedding, content_sha256 = EXCLUDED.content_sha256,
            previous_id = EXCLUDED.previous_id, embedded_at = now()
    RETURNING tenant_id, item_id
), updated AS (
    UPDATE memory_items m SET embedded_model = $5, embed_error = NULL, embed_failing_since = NULL,
        judge_enqueued_at = CASE WHEN m.source_kind = 'fact' AND m.judge_at IS NULL AND m.superseded_by IS NULL
                                 THEN now() ELSE m.judge_enqueued_at END
    FROM saved WHERE m.tenant_id = saved.tenant_id AND m.id = saved.item_id
    RETURNING m.id, m.tenant_id, m.tsv, (m.source_kind = 'fact' AND m.judge_at IS NULL AND m.superseded_by IS NULL) AS judge
), first_text AS (
    -- `was` is read in the statement's snapshot: the row as it was before the update above.
    SELECT u.tenant_id, u.tsv FROM updated u
    JOIN memory_items was ON was.tenant_id = u.tenant_id AND was.id = u.id
    WHERE was.tsv IS NULL AND u.tsv IS NOT NULL
), counted_lexemes AS (
    INSERT INTO tenant_lexemes (tenant_id, lexeme, documents)
    SELECT f.tenant_id, l, count(*) FROM first_text f CROSS JOIN unnest(tsvector_to_array(f.tsv)) AS l
    GROUP BY 1, 2 ORDER BY 1, 2
    ON CONFLICT (tenant_id, lexeme) DO UPDATE SET documents = tenant_lexemes.documents + EXCLUDED.documents
), counted_rows AS (
    INSERT INTO tenant_text (tenant_id, documents, lexemes)
    SELECT tenant_id, count(*), sum(length(tsv)) FROM first_text GROUP BY 1 ORDER BY 1
    ON CONFLICT (tenant_id) DO UPDATE
        SET documents = tenant_text.documents + EXCLUDED.documents, lexemes = tenant_text.lexemes + EXCLUDED.lexemes
)
SELECT id, tenant_id, judge FROM updated";

/// A tenant's text counts (migration 032) change one transaction at a time: the embed worker's
/// save, anonymization and a recount each take this lock before the statement that reads and
/// changes them, so that statement's snapshot already holds the last change. Tenants are locked
/// in sorted order, so batches spanning several never deadlock. The lock is migration 032's
/// `mnemo_lock_text_counts`, which `mnemo_count_tenant_text` takes too.
const LOCK_TEXT_COUNTS: &str = "
SELECT mnemo_lock_text_counts(t) FROM (SELECT DISTINCT t FROM unnest($1::text[]) AS t ORDER BY t) s";

pub(crate) async fn lock_text_counts(tx: &mut sqlx::PgConnection, tenants: &[String]) -> Result<(), StoreError> {
    sqlx::query(LOCK_TEXT_COUNTS).bind(tenants).execute(tx).await?;
    Ok(())
}

/// Of vectors `save_vectors` left, the live rows with the content they were made from whose
/// previous turn was deleted or anonymized meanwhile: embedded again, without its words.
const TO_EMBED_AGAIN_WITHOUT_PREVIOUS: &str = "
SELECT m.id, m.tenant_id, m.content_sha256
FROM unnest($1::uuid[], $2::text[], $3::uuid[]) AS v(id, tenant_id, previous_id)
JOIN memory_items m ON m.tenant_id = v.tenant_id AND m.id = v.id
JOIN memory_items p ON p.tenant_id = v.tenant_id AND p.id = v.previous_id
WHERE m.deleted_at IS NULL AND m.anonymized_at IS NULL AND (p.deleted_at IS NOT NULL OR p.anonymized_at IS NOT NULL)";

/// The embed job of a row read as (id, tenant, content hash).
pub(crate) fn embed_job((item_id, tenant, sha): (Uuid, String, Vec<u8>)) -> Result<EmbedJob, StoreError> {
    let row = EmbedRow { tenant_id: TenantId::parse(&tenant)?, item_id, content_sha256: hex::encode(sha) };
    Ok(EmbedJob::of(&row))
}

impl Store {
    /// The live rows behind a batch of embed jobs, each checked against its job's tenant, with
    /// each chat message's previous turn when `with_previous`.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn rows_to_embed(
        &self,
        jobs: &[EmbedRow],
        model: &str,
        with_previous: bool,
    ) -> Result<Vec<RowToEmbed>, StoreError> {
        let ids: Vec<Uuid> = jobs.iter().map(|j| j.item_id).collect();
        let tenants: Vec<&str> = jobs.iter().map(|j| j.tenant_id.as_str()).collect();
        Ok(sqlx::query_as(ROWS_TO_EMBED)
            .bind(&ids)
            .bind(&tenants)
            .bind(model)
            .bind(with_previous)
            .bind(mnemo_core::PREVIOUS_TURN_BYTES as i32)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Writes vectors back and queues the judge for facts that wait for it, in one transaction;
    /// returns the ids stored (rows changed or anonymized since are left).
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn save_vectors(&self, model: &str, vectors: Vec<NewVector>) -> Result<Vec<Uuid>, StoreError> {
        if vectors.is_empty() {
            return Ok(Vec::new());
        }
        let mut ids = Vec::with_capacity(vectors.len());
        let mut tenants = Vec::with_capacity(vectors.len());
        let mut shas = Vec::with_capacity(vectors.len());
        let mut embeddings = Vec::with_capacity(vectors.len());
        let mut previous = Vec::with_capacity(vectors.len());
        for v in vectors {
            ids.push(v.id);
            tenants.push(v.tenant_id.as_str().to_owned());
            shas.push(v.content_sha256);
            embeddings.push(Vector::from(v.embedding));
            previous.push(v.previous_id);
        }
        let mut tx = self.pool.begin().await?;
        lock_text_counts(&mut tx, &tenants).await?;
        let saved: Vec<(Uuid, String, bool)> = sqlx::query_as(SAVE_VECTORS)
            .bind(&ids)
            .bind(&tenants)
            .bind(shas)
            .bind(embeddings)
            .bind(model)
            .bind(&previous)
            .fetch_all(&mut *tx)
            .await?;
        let to_judge =
            saved.iter().filter(|(_, _, judge)| *judge).map(|(id, tenant, _)| (*id, tenant.clone())).collect();
        push_judge_jobs(&mut tx, to_judge).await?;
        if saved.len() < ids.len() {
            // By tenant and id: an import into a second tenant keeps its rows' ids.
            let stored: HashSet<(Uuid, &str)> = saved.iter().map(|(id, tenant, _)| (*id, tenant.as_str())).collect();
            let left =
                (0..ids.len()).filter(|&i| previous[i].is_some() && !stored.contains(&(ids[i], tenants[i].as_str())));
            let (ids, tenants, previous): (Vec<_>, Vec<_>, Vec<_>) =
                left.map(|i| (ids[i], tenants[i].as_str(), previous[i])).collect();
            let again: Vec<(Uuid, String, Vec<u8>)> = sqlx::query_as(TO_EMBED_AGAIN_WITHOUT_PREVIOUS)
                .bind(ids)
                .bind(tenants)
                .bind(previous)
                .fetch_all(&mut *tx)
                .await?;
            push(&mut tx, &again.into_iter().map(embed_job).collect::<Result<Vec<_>, _>>()?).await?;
        }
        tx.commit().await?;
        Ok(saved.into_iter().map(|(id, _, _)| id).collect())
    }

    /// Records that rows have a vector of `model` for their content already (see
    /// [`RowToEmbed::recorded`]). Only rows that name a model: their full text, which that
    /// column gates, is there and counted either way.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn record_embedded(&self, model: &str, rows: &[&RowToEmbed]) -> Result<(), StoreError> {
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        let tenants: Vec<&str> = rows.iter().map(|r| r.tenant_id.as_str()).collect();
        sqlx::query(
            "UPDATE memory_items m SET embedded_model = $3, embed_error = NULL, embed_failing_since = NULL
             FROM unnest($1::uuid[], $2::text[]) AS j(id, tenant_id)
             WHERE m.tenant_id = j.tenant_id AND m.id = j.id AND m.anonymized_at IS NULL
               AND m.embedded_model IS NOT NULL
               AND EXISTS (SELECT 1 FROM memory_embeddings e
                           WHERE e.tenant_id = m.tenant_id AND e.item_id = m.id AND e.model = $3
                             AND e.content_sha256 = m.content_sha256)",
        )
        .bind(ids)
        .bind(tenants)
        .bind(model)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records a batch's failed attempts of `model` in one transaction, so a store error partway
    /// records none and the job's retry records each once (not a second retry chain for those
    /// before). A failure with `retry_after` queues its row's job again to run after that delay;
    /// one without is final, and its `error` stays on the row. A row that has its current vector
    /// of `model` by now (another job for it succeeded meanwhile) is left as it is.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn record_embed_failures(&self, model: &str, failures: &[EmbedFailure<'_>]) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        for failure in failures {
            let recorded = sqlx::query(
                "UPDATE memory_items m
                 SET embed_attempts = embed_attempts + 1,
                     embed_failing_since = coalesce(embed_failing_since, now()),
                     embed_error = CASE WHEN $3 THEN NULL ELSE $4 END,
                     -- When the retry is due: the housekeeping grace counts from then, so a long
                     -- backoff is not cut short by a re-queue.
                     embed_enqueued_at = now() + make_interval(secs => $5)
                 WHERE m.id = $1 AND m.tenant_id = $2
                   -- Anonymized during the call: no error (it may quote the input) nor retry.
                   AND m.anonymized_at IS NULL
                   AND NOT EXISTS (SELECT 1 FROM memory_embeddings e
                                   WHERE e.tenant_id = m.tenant_id AND e.item_id = m.id AND e.model = $6
                                     AND e.content_sha256 = m.content_sha256)",
            )
            .bind(failure.job.item_id)
            .bind(failure.job.tenant_id.as_str())
            .bind(failure.retry_after.is_some())
            .bind(&failure.error)
            .bind(failure.retry_after.unwrap_or_default().as_secs_f64())
            .bind(model)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if let Some(delay) = failure.retry_after.filter(|_| recorded > 0) {
                push_after(&mut tx, &EmbedJob::of(failure.job), delay, 0).await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// How many times the rows of these jobs have failed so far, and for how many seconds they
    /// have been failing without a success (0 for a row not failing).
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn embed_failures(&self, jobs: &[&EmbedRow]) -> Result<Vec<(String, Uuid, i32, f64)>, StoreError> {
        let ids: Vec<Uuid> = jobs.iter().map(|j| j.item_id).collect();
        let tenants: Vec<&str> = jobs.iter().map(|j| j.tenant_id.as_str()).collect();
        Ok(sqlx::query_as(
            "SELECT m.tenant_id, m.id, m.embed_attempts,
                    extract(epoch FROM now() - coalesce(m.embed_failing_since, now()))::float8
             FROM unnest($1::uuid[], $2::text[]) AS j(id, tenant_id)
             JOIN memory_items m ON m.tenant_id = j.tenant_id AND m.id = j.id",
        )
        .bind(ids)
        .bind(tenants)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Queues a new embed job for every live row without a vector of `model` whose job was last
    /// queued before `grace` ago (a lost job, a crash, or a model switch). At most `limit` rows.
    /// A row queued after the oldest embed job still waiting has its own job waiting too (they
    /// are run oldest first): a backlog longer than `grace` is not queued a second time.
    pub async fn requeue_unembedded(&self, model: &str, grace: Duration, limit: i64) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        let stale: Vec<(Uuid, String, Vec<u8>)> = sqlx::query_as(
            "WITH oldest_waiting AS (
                SELECT run_at FROM apalis.jobs
                WHERE job_type = $4 AND status = 'Pending' AND priority = 0
                ORDER BY run_at LIMIT 1
            ), stale AS (
                SELECT tenant_id, id FROM memory_items
                WHERE embed_error IS NULL AND deleted_at IS NULL AND anonymized_at IS NULL
                  -- Three ranges, not `<>`, which the pending index's btree cannot serve.
                  AND (embedded_model IS NULL OR embedded_model < $1 OR embedded_model > $1)
                  AND embed_enqueued_at < now() - make_interval(secs => $2)
                  AND embed_enqueued_at < COALESCE((SELECT run_at FROM oldest_waiting), 'infinity')
                ORDER BY embed_enqueued_at
                LIMIT $3
                FOR UPDATE SKIP LOCKED
            )
            UPDATE memory_items m SET embed_enqueued_at = now()
            FROM stale WHERE m.tenant_id = stale.tenant_id AND m.id = stale.id
            RETURNING m.id, m.tenant_id, m.content_sha256",
        )
        .bind(model)
        .bind(grace.as_secs_f64())
        .bind(limit)
        .bind(Queue::Embed.as_str())
        .fetch_all(&mut *tx)
        .await?;
        let count = stale.len() as u64;
        let jobs = stale.into_iter().map(embed_job).collect::<Result<Vec<_>, StoreError>>()?;
        push(&mut tx, &jobs).await?;
        tx.commit().await?;
        Ok(count)
    }

    /// Gives the live rows whose embedding was given up (`embed_error`: attempts used up in an
    /// outage longer than they last, or a permanent failure) a new start: no error, no attempts,
    /// and an embed job each, `batch` rows a transaction, calling `progress` with the count so
    /// far after each. `tenant`: only that tenant's. A row that fails again meanwhile is not
    /// taken again. Returns how many.
    pub async fn retry_given_up_embeddings(
        &self,
        tenant: Option<&TenantId>,
        batch: i64,
        mut progress: impl FnMut(u64),
    ) -> Result<u64, StoreError> {
        let started: DateTime<Utc> = sqlx::query_scalar("SELECT now()").fetch_one(&self.pool).await?;
        let mut queued = 0;
        loop {
            let mut tx = self.pool.begin().await?;
            let rows: Vec<(Uuid, String, Vec<u8>)> = sqlx::query_as(
                "WITH given_up AS (
                    SELECT tenant_id, id FROM memory_items
                    WHERE embed_error IS NOT NULL AND deleted_at IS NULL AND anonymized_at IS NULL
                      AND ($1::text IS NULL OR tenant_id = $1) AND embed_enqueued_at < $3
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED
                )
                UPDATE memory_items m
                SET embed_error = NULL, embed_attempts = 0, embed_failing_since = NULL, embed_enqueued_at = now()
                FROM given_up WHERE m.tenant_id = given_up.tenant_id AND m.id = given_up.id
                RETURNING m.id, m.tenant_id, m.content_sha256",
            )
            .bind(tenant.map(TenantId::as_str))
            .bind(batch)
            .bind(started)
            .fetch_all(&mut *tx)
            .await?;
            if rows.is_empty() {
                return Ok(queued);
            }
            queued += rows.len() as u64;
            let jobs = rows.into_iter().map(embed_job).collect::<Result<Vec<_>, StoreError>>()?;
            push(&mut tx, &jobs).await?;
            tx.commit().await?;
            progress(queued);
        }
    }

    /// The stored vector of a tenant's row for a model, for checks and tests.
    pub async fn vector(&self, tenant: &TenantId, id: Uuid, model: &str) -> Result<Option<Vec<f32>>, StoreError> {
        let v: Option<Vector> = sqlx::query_scalar(
            "SELECT embedding FROM memory_embeddings WHERE tenant_id = $1 AND item_id = $2 AND model = $3",
        )
        .bind(tenant.as_str())
        .bind(id)
        .bind(model)
        .fetch_optional(&self.pool)
        .await?;
        Ok(v.map(|v| v.to_vec()))
    }
}
