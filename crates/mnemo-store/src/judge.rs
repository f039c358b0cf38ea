//! The contradiction judge's state. A fact is pending while it is live, embedded and unjudged
//! (`judge_at IS NULL`). Candidates come from its own (tenant, scope, identity) bucket only.
//! A judgement is applied in one transaction under a per-bucket advisory lock, re-checking
//! that both rows are still live, with one audit row per retired fact. The audit log is also
//! the history behind as-of reads: a fact was live at T if it existed then and its last
//! supersede, delete or revive event at or before T was a revive (or there was none).

use std::time::Duration;

use chrono::{DateTime, Utc};
use mnemo_core::{AuditEvent, FactScope, JudgeOutcome, TenantId};
use sqlx::{AssertSqlSafe, Postgres, Transaction};
use uuid::Uuid;

use crate::queue::{JudgeJob, push, push_after};
use crate::{Store, StoreError};

/// A fact waiting for the judge.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct PendingFact {
    pub id: Uuid,
    #[sqlx(try_from = "String")]
    pub tenant_id: TenantId,
    #[sqlx(try_from = "String")]
    pub scope: FactScope,
    /// The user (user scope) or agent (agent scope) the bucket belongs to.
    pub identity: String,
    pub content: String,
    pub fact_key: Option<String>,
    /// The start of its current validity: a revived fact is younger than the facts it was
    /// superseded by.
    pub valid_from: DateTime<Utc>,
    pub embedded_model: String,
    /// Its readers: a fact replaces only older facts that exactly the same readers read, so a
    /// supersession never hides a fact from readers who cannot see its successor, nor lets a
    /// writer replace a fact it cannot read (the API refuses an agent fact restricted to roles
    /// its writer holds none of).
    pub visibility: String,
    pub allowed_roles: Vec<String>,
    /// For a user's fact shared with its agent (`visibility: agent`), that agent: its readers are
    /// that agent's users, so it replaces only facts shared with the same agent.
    pub reader_agent: Option<String>,
    /// For an agent's fact written with a user's token, that user: it replaces only the agent's
    /// facts that user wrote, as that user's token deletes only those (one user's conversation
    /// must not rewrite what the agent's other users recall). `None`: a user's own fact (its
    /// bucket is that user's), or one written by a service token, which replaces any.
    pub writer: Option<String>,
    /// Proposed by a model reading a conversation (extraction): its key retires only facts
    /// such proposals made, never what a user or an application stated.
    pub extracted: bool,
    /// How many times a judgement sent it to be judged again, as it was read: a judgement of a
    /// fact reopened since is not applied (it never saw the fact that reopened it).
    pub reopens: i32,
}

impl PendingFact {
    /// The column that holds the bucket's identity, as a literal for the statement text (a
    /// parameter would hide the index from the plan).
    fn identity_column(&self) -> &'static str {
        match self.scope {
            FactScope::User => "user_id",
            FactScope::Agent => "agent_id",
        }
    }
}

/// An older live fact of the same bucket.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Candidate {
    pub id: Uuid,
    pub content: String,
    /// Cosine distance to the pending fact; `None` for a fact found by its key.
    pub distance: Option<f64>,
}

/// Why a fact is retired, as its audit row says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retire {
    /// The new fact has its key.
    KeyMatch,
    /// The model said the new fact makes it untrue.
    Model,
    /// The model said the new fact says it again, in other words.
    Duplicate,
    /// The new fact has its words, case and punctuation aside (no model).
    SameWords,
}

impl Retire {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::KeyMatch => "key_match",
            Self::Model => "model",
            Self::Duplicate => "duplicate",
            Self::SameWords => "same_words",
        }
    }

    /// Whether the new fact says what the retired one said.
    fn is_copy(self) -> bool {
        matches!(self, Self::Duplicate | Self::SameWords)
    }
}

/// What the judge decided for one pending fact, before it is applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgement {
    /// What is recorded when no fact could be retired (`Superseded` is, when one is): `Kept` for
    /// a model that kept every candidate, or whose retirements another judgement made first;
    /// `NoCandidates`, `Disabled` or `FailOpen` for a judgement that had no model to ask.
    pub unless_retired: JudgeOutcome,
    /// Facts to retire, and why.
    pub retire: Vec<(Uuid, Retire)>,
    /// A short code of how it was decided; a fail-open's audit row names the failure's kind.
    pub reason: &'static str,
    /// The model that decided, if one did.
    pub model: Option<String>,
    pub candidates: usize,
    /// A fail-open whose failure may pass on its own (the endpoint down, overloaded or slow):
    /// housekeeping asks again later ([`Store::rejudge_passing_failures`]).
    pub failure_may_pass: bool,
}

/// A fact with its state, for the admin view.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct FactRecord {
    pub id: Uuid,
    pub content: String,
    pub fact_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub valid_from: Option<DateTime<Utc>>,
    pub valid_to: Option<DateTime<Utc>>,
    pub superseded_by: Option<Uuid>,
    pub superseded_at: Option<DateTime<Utc>>,
    pub judge_at: Option<DateTime<Utc>>,
    pub judge_outcome: Option<String>,
    pub anonymized: bool,
    /// Live at the time asked about (now, or the as-of time).
    pub live: bool,
}

/// A fact whose judge failed open.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct FailOpenFact {
    pub id: Uuid,
    #[sqlx(try_from = "String")]
    pub tenant_id: TenantId,
    pub judge_at: DateTime<Utc>,
    /// The failure's kind, from its audit row.
    pub reason: Option<String>,
}

/// A fact `judge clear` re-opened (or would): its id and tenant.
pub type ClearedFact = (Uuid, String);

/// Which facts `judge clear` re-opens.
#[derive(Debug, Clone, PartialEq)]
pub enum ClearSelection {
    Ids(Vec<Uuid>),
    Outcome { outcome: JudgeOutcome, since: DateTime<Utc> },
}

/// The judge's backlog and recent outcomes.
#[derive(Debug, Clone, PartialEq)]
pub struct JudgeStatus {
    pub pending: i64,
    pub oldest_pending_seconds: Option<f64>,
    /// Rows judged within the window, per outcome (every outcome listed, zeros too).
    pub outcomes: Vec<(JudgeOutcome, i64)>,
    /// Live facts failed open that housekeeping will ask about again (their failure may pass).
    pub to_ask_again: i64,
    pub batches: BatchStats,
}

/// Whether a tenant's supersede chains and their audit rows agree (see
/// [`Store::supersede_integrity`]): [`SupersedeIntegrity::broken`] lists what does not. The
/// first four fields are counts to read, and `buckets_with_several_live` only a workload whose
/// facts all contradict each other expects to be zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, sqlx::FromRow, serde::Serialize)]
pub struct SupersedeIntegrity {
    pub facts: i64,
    pub superseded: i64,
    /// Live facts with a vector that the judge has not judged yet.
    pub unjudged: i64,
    /// Live facts whose last judgement failed open: asked again by housekeeping if the failure
    /// may pass, otherwise waiting for an operator's re-judge.
    pub failed_open: i64,
    /// Facts with more than one supersede audit row.
    pub superseded_twice: i64,
    /// Superseded facts without the audit row naming their successor.
    pub unaudited: i64,
    /// Supersede audit rows whose fact is not superseded by the fact they name.
    pub audit_without_row: i64,
    /// Facts retired by a fact that is not newer, or of another bucket.
    pub retired_wrongly: i64,
    pub buckets_with_several_live: i64,
}

impl SupersedeIntegrity {
    /// The broken invariants, each with how many facts or audit rows break it.
    pub fn broken(&self) -> Vec<(&'static str, i64)> {
        [
            ("superseded twice", self.superseded_twice),
            ("superseded without their audit row", self.unaudited),
            ("supersede audit rows that do not match their fact", self.audit_without_row),
            ("retired by an older fact or one of another bucket", self.retired_wrongly),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect()
    }
}

/// Judge batches finished within a window.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BatchStats {
    pub batches: i64,
    pub rows: i64,
    pub model_calls: i64,
    /// Means per batch.
    pub mean_wall_ms: f64,
    pub mean_model_max_ms: f64,
    /// Mean model time per call.
    pub mean_model_call_ms: f64,
    /// Rows judged per second of batch time, one worker.
    pub rows_per_second: f64,
}

/// One finished batch, as the dispatcher measured it.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRecord {
    pub worker: String,
    pub batch_size: usize,
    pub rows: usize,
    pub model_calls: usize,
    pub wall: Duration,
    pub model_sum: Duration,
    pub model_max: Duration,
}

/// How long housekeeping waits before asking again about a fact whose judge failed in a way that
/// may pass, the first time; each later failure doubles it. After `REJUDGE_WAITS` failures
/// (5 minutes to 160, about 5¼ hours in all) the fact waits for an operator's `judge clear`.
const REJUDGE_FIRST_WAIT_S: u32 = 300;
const REJUDGE_WAITS: u32 = 6;

const LIVE_FACT: &str =
    "source_kind = 'fact' AND superseded_by IS NULL AND deleted_at IS NULL AND anonymized_at IS NULL";

const PENDING_COLUMNS: &str = "m.id, m.tenant_id, m.scope,
    COALESCE(CASE m.scope WHEN 'agent' THEN m.agent_id ELSE m.user_id END, '') AS identity,
    m.content, m.fact_key, COALESCE(m.valid_from, m.created_at) AS valid_from, m.embedded_model,
    m.visibility, m.allowed_roles,
    CASE WHEN m.scope = 'user' AND m.visibility = 'agent' THEN m.agent_id END AS reader_agent,
    CASE WHEN m.scope = 'agent' THEN m.user_id END AS writer,
    m.origin IS NOT DISTINCT FROM 'extraction' AS extracted, m.judge_reopens AS reopens";

/// The most newer facts one judgement sends to be judged again (each may cost a model call).
const REOPEN_AT_MOST: i64 = 50;

/// The advisory lock of a bucket: judgements in one bucket apply one at a time.
const LOCK_BUCKET: &str = "SELECT pg_advisory_xact_lock(
    hashtextextended($1 || chr(31) || $2 || chr(31) || $3 || chr(31) || COALESCE($4, ''), 0))";

fn pending_filter(alias: &str) -> String {
    format!(
        "{alias}.source_kind = 'fact' AND {alias}.judge_at IS NULL AND {alias}.embedded_model IS NOT NULL
         AND {alias}.superseded_by IS NULL AND {alias}.deleted_at IS NULL AND {alias}.anonymized_at IS NULL"
    )
}

impl Store {
    /// The facts behind a batch of judge jobs that are still pending, each checked against its
    /// job's tenant.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn pending_facts(&self, jobs: &[JudgeJob]) -> Result<Vec<PendingFact>, StoreError> {
        let ids: Vec<Uuid> = jobs.iter().map(|j| j.item_id).collect();
        let tenants: Vec<&str> = jobs.iter().map(|j| j.tenant_id.as_str()).collect();
        let sql = format!(
            "SELECT DISTINCT ON (m.tenant_id, m.id) {PENDING_COLUMNS}
             FROM unnest($1::uuid[], $2::text[]) AS j(id, tenant_id)
             JOIN memory_items m ON m.id = j.id AND m.tenant_id = j.tenant_id
             WHERE {}",
            pending_filter("m")
        );
        Ok(sqlx::query_as(AssertSqlSafe(sql)).bind(&ids).bind(&tenants).fetch_all(&self.pool).await?)
    }

    /// Up to `limit` pending facts, longest waiting first, whatever their jobs.
    pub async fn oldest_pending_facts(&self, limit: i64) -> Result<Vec<JudgeJob>, StoreError> {
        let sql = format!(
            "SELECT m.tenant_id, m.id FROM memory_items m WHERE {} ORDER BY m.judge_enqueued_at NULLS FIRST, m.id LIMIT $1",
            pending_filter("m")
        );
        let rows: Vec<(String, Uuid)> = sqlx::query_as(AssertSqlSafe(sql)).bind(limit).fetch_all(&self.pool).await?;
        rows.into_iter()
            .map(|(tenant, item_id)| Ok(JudgeJob { tenant_id: TenantId::parse(&tenant)?, item_id }))
            .collect()
    }

    /// Live facts of the pending fact's bucket that are older than it (by the start of their
    /// validity) and within `threshold` cosine distance, closest first, at most `topk`. Only
    /// facts with a vector of the same model compare.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn judge_candidates(
        &self,
        fact: &PendingFact,
        threshold: f64,
        topk: usize,
    ) -> Result<Vec<Candidate>, StoreError> {
        let sql = format!(
            "SELECT o.id, o.content, (e.embedding <=> p.embedding)::float8 AS distance
             FROM memory_embeddings p
             JOIN memory_items o ON o.tenant_id = $1 AND o.{column} = $2 AND o.scope = $3
             JOIN memory_embeddings e ON e.tenant_id = $1 AND e.item_id = o.id AND e.model = p.model
             WHERE p.tenant_id = $1 AND p.item_id = $4 AND p.model = $5
               AND o.{LIVE_FACT}
               AND (COALESCE(o.valid_from, o.created_at), o.id) < ($6, $4)
               AND (e.embedding <=> p.embedding) < $7
               AND o.visibility = $9 AND o.allowed_roles = $10 AND ($11::text IS NULL OR o.agent_id = $11)
               AND ($12::text IS NULL OR o.user_id = $12)
             ORDER BY distance, o.id
             LIMIT $8",
            column = fact.identity_column(),
        );
        Ok(sqlx::query_as(AssertSqlSafe(sql))
            .bind(fact.tenant_id.as_str())
            .bind(&fact.identity)
            .bind(fact.scope.as_str())
            .bind(fact.id)
            .bind(&fact.embedded_model)
            .bind(fact.valid_from)
            .bind(threshold)
            .bind(i64::try_from(topk).unwrap_or(i64::MAX))
            .bind(&fact.visibility)
            .bind(&fact.allowed_roles)
            .bind(&fact.reader_agent)
            .bind(&fact.writer)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Whether an older live fact of the bucket still waits for its vector. Judging now would
    /// miss it for good (it is older, so its own judgement never looks at this fact), so the
    /// judgement waits.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn older_facts_unembedded(&self, fact: &PendingFact) -> Result<bool, StoreError> {
        let sql = format!(
            "SELECT EXISTS (
                SELECT 1 FROM memory_items o
                WHERE o.tenant_id = $1 AND o.{column} = $2 AND o.scope = $3 AND o.{LIVE_FACT}
                  AND o.embed_error IS NULL AND o.embedded_model IS DISTINCT FROM $4
                  AND (COALESCE(o.valid_from, o.created_at), o.id) < ($5, $6)
                  AND o.visibility = $7 AND o.allowed_roles = $8 AND ($9::text IS NULL OR o.agent_id = $9)
                  AND ($10::text IS NULL OR o.user_id = $10)
            )",
            column = fact.identity_column(),
        );
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(fact.tenant_id.as_str())
            .bind(&fact.identity)
            .bind(fact.scope.as_str())
            .bind(&fact.embedded_model)
            .bind(fact.valid_from)
            .bind(fact.id)
            .bind(&fact.visibility)
            .bind(&fact.allowed_roles)
            .bind(&fact.reader_agent)
            .bind(&fact.writer)
            .fetch_one(&self.pool)
            .await?)
    }

    /// Queues the fact's judge job again to run after `delay`; it stays pending meanwhile.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn defer_judgement(&self, fact: &PendingFact, delay: Duration) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("UPDATE memory_items SET judge_enqueued_at = now() WHERE id = $1 AND tenant_id = $2")
            .bind(fact.id)
            .bind(fact.tenant_id.as_str())
            .execute(&mut *tx)
            .await?;
        let job = JudgeJob { tenant_id: fact.tenant_id.clone(), item_id: fact.id };
        push_after(&mut tx, &job, delay, 0).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Live, older facts of the bucket with the pending fact's key, whatever their distance, read
    /// under the bucket's lock by [`Store::apply_judgement`]. The scope is written as a literal
    /// here and in the reopen below, so that even a generic plan reads the bucket through its
    /// class's index (migration 039), not every row of the agent.
    async fn same_key_facts(
        tx: &mut Transaction<'_, Postgres>,
        fact: &PendingFact,
        key: &str,
    ) -> Result<Vec<Uuid>, StoreError> {
        let sql = format!(
            "SELECT o.id
             FROM memory_items o
             WHERE o.tenant_id = $1 AND o.{column} = $2 AND o.scope = '{scope}' AND o.fact_key = $3
               AND o.{LIVE_FACT}
               AND (COALESCE(o.valid_from, o.created_at), o.id) < ($4, $5)
               AND o.visibility = $6 AND o.allowed_roles = $7 AND ($8::text IS NULL OR o.agent_id = $8)
               AND ($9::text IS NULL OR o.user_id = $9)
               AND (NOT $10 OR o.origin IS NOT DISTINCT FROM 'extraction')
             ORDER BY o.valid_from, o.id
             LIMIT 1000",
            column = fact.identity_column(),
            scope = fact.scope.as_str(),
        );
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(fact.tenant_id.as_str())
            .bind(&fact.identity)
            .bind(key)
            .bind(fact.valid_from)
            .bind(fact.id)
            .bind(&fact.visibility)
            .bind(&fact.allowed_roles)
            .bind(&fact.reader_agent)
            .bind(&fact.writer)
            .bind(fact.extracted)
            .fetch_all(&mut **tx)
            .await?)
    }

    /// Applies a judgement: retires the facts it names that are still live and older, with an
    /// audit row each, records the outcome and its time on the pending fact, and audits a
    /// fail-open. One transaction under the bucket's lock. Returns the outcome recorded, or
    /// `None` when the fact is no longer pending (judged by another worker, retired, deleted), in
    /// which case nothing changes.
    #[tracing::instrument(skip_all, fields(otel.kind = "client", db.system.name = "postgresql"))]
    pub async fn apply_judgement(
        &self,
        fact: &PendingFact,
        judgement: &Judgement,
    ) -> Result<Option<JudgeOutcome>, StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(LOCK_BUCKET)
            .bind(fact.tenant_id.as_str())
            .bind(fact.scope.as_str())
            .bind(&fact.identity)
            .bind(&fact.reader_agent)
            .execute(&mut *tx)
            .await?;
        // Pending with the validity it was read with: a fact superseded and revived meanwhile
        // waits for its own judgement (against the fact that had retired it). And not reopened
        // since it was read: an older fact judged meanwhile sent it to be judged again, with
        // that fact among its older ones, which this judgement never saw.
        let still_pending: Option<Uuid> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT m.id FROM memory_items m
             WHERE m.id = $1 AND m.tenant_id = $2 AND COALESCE(m.valid_from, m.created_at) = $3
               AND m.judge_reopens = $4 AND {}
             FOR UPDATE",
            pending_filter("m")
        )))
        .bind(fact.id)
        .bind(fact.tenant_id.as_str())
        .bind(fact.valid_from)
        .bind(fact.reopens)
        .fetch_optional(&mut *tx)
        .await?;
        if still_pending.is_none() {
            return Ok(None);
        }

        // A keyed fact retires the older facts of its key as they stand under the lock: one
        // whose writer began first but committed after this fact was read for judging is among
        // them (the reopen below covers the other order). No model decides these.
        let by_key: Vec<(Uuid, Retire)>;
        let retire = match &fact.fact_key {
            Some(key) => {
                by_key = Self::same_key_facts(&mut tx, fact, key)
                    .await?
                    .into_iter()
                    .map(|id| (id, Retire::KeyMatch))
                    .collect();
                &by_key
            }
            None => &judgement.retire,
        };
        let mut outcome = judgement.unless_retired;
        if !retire.is_empty() {
            let ids: Vec<Uuid> = retire.iter().map(|(id, _)| *id).collect();
            let reasons: Vec<&str> = retire.iter().map(|(_, why)| why.as_str()).collect();
            let retired: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(format!(
                "WITH retired AS (
                    UPDATE memory_items o
                    SET superseded_by = $4, superseded_at = now(), valid_to = now()
                    WHERE o.tenant_id = $1 AND o.{column} = $2 AND o.scope = $3 AND o.id = ANY($5)
                      AND o.{LIVE_FACT}
                      AND (COALESCE(o.valid_from, o.created_at), o.id) < ($6, $4)
                      AND o.visibility = $9 AND o.allowed_roles = $10 AND ($11::text IS NULL OR o.agent_id = $11)
                      AND ($12::text IS NULL OR o.user_id = $12)
                    RETURNING o.id
                )
                INSERT INTO audit_log (tenant_id, event, item_id, related_item_id, reason, actor, details)
                SELECT $1, '{supersede}', id, $4, r.reason, 'judge', jsonb_build_object('model', $8::text)
                FROM retired JOIN unnest($5::uuid[], $7::text[]) AS r (id, reason) USING (id)
                RETURNING item_id",
                column = fact.identity_column(),
                supersede = AuditEvent::Supersede,
            )))
            .bind(fact.tenant_id.as_str())
            .bind(&fact.identity)
            .bind(fact.scope.as_str())
            .bind(fact.id)
            .bind(&ids)
            .bind(fact.valid_from)
            .bind(&reasons)
            .bind(&judgement.model)
            .bind(&fact.visibility)
            .bind(&fact.allowed_roles)
            .bind(&fact.reader_agent)
            .bind(&fact.writer)
            .fetch_all(&mut *tx)
            .await?;
            // None, when another judgement retired them first.
            if !retired.is_empty() {
                outcome = JudgeOutcome::Superseded;
            }
            // The statement left standing keeps the most its copies were rated (an unrated one
            // counts as ½, as in ranking), and the most durable layer (an episodic copy never
            // turns a semantic memory into one that fades): saying a thing again never makes it
            // matter less (seed 004 weighs importance and confidence when it deduplicates).
            let copies: Vec<Uuid> =
                retire.iter().filter(|(id, why)| why.is_copy() && retired.contains(id)).map(|(id, _)| *id).collect();
            if !copies.is_empty() {
                sqlx::query(
                    "UPDATE memory_items n
                     SET importance = CASE WHEN c.importance > COALESCE(n.importance, 0.5) THEN c.importance
                                           ELSE n.importance END,
                         confidence = CASE WHEN c.confidence > COALESCE(n.confidence, 0.5) THEN c.confidence
                                           ELSE n.confidence END,
                         layer = CASE WHEN n.layer = 'episodic' THEN COALESCE(c.layer, n.layer) ELSE n.layer END,
                         faded_at = CASE WHEN c.layer IS NULL THEN n.faded_at END
                     FROM (SELECT max(COALESCE(importance, 0.5)) AS importance,
                                  max(COALESCE(confidence, 0.5)) AS confidence,
                                  min(layer) FILTER (WHERE layer <> 'episodic') AS layer
                           FROM memory_items WHERE tenant_id = $1 AND id = ANY($3)) c
                     WHERE n.tenant_id = $1 AND n.id = $2",
                )
                .bind(fact.tenant_id.as_str())
                .bind(fact.id)
                .bind(&copies)
                .execute(&mut *tx)
                .await?;
                // Where the copies were stated counts for the survivor: promotion looks for a
                // memory stated in two sessions. Seen now, as `export --since` reads sightings.
                sqlx::query(
                    "INSERT INTO memory_sightings (tenant_id, item_id, session_id, user_id, seen_at)
                     SELECT tenant_id, $2, session_id, user_id, now() FROM memory_sightings
                     WHERE tenant_id = $1 AND item_id = ANY($3)
                     ON CONFLICT DO NOTHING",
                )
                .bind(fact.tenant_id.as_str())
                .bind(fact.id)
                .bind(&copies)
                .execute(&mut *tx)
                .await?;
            }
        }
        // A failure that may pass is asked about again after a wait that doubles with each of the
        // fact's failures since it was last revived or cleared by an operator (its fail-open audit
        // rows, this one not yet among them), at most `REJUDGE_WAITS` times; any other outcome
        // clears the wait.
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE memory_items SET judge_at = now(), judge_outcome = $3,
                 judge_retry_at = CASE WHEN $4 THEN (
                     SELECT now() + make_interval(secs => {REJUDGE_FIRST_WAIT_S} * 2 ^ count(*))
                     FROM audit_log a
                     WHERE a.tenant_id = $1 AND a.item_id = $2 AND a.event = '{fail_open}'
                       AND a.id > coalesce((
                           SELECT max(r.id) FROM audit_log r
                           WHERE r.tenant_id = $1 AND r.item_id = $2
                             AND (r.event = '{revive}' OR (r.event = '{clear}' AND r.reason = 'operator'))), 0)
                     HAVING count(*) < {REJUDGE_WAITS}) END
             WHERE tenant_id = $1 AND id = $2",
            fail_open = AuditEvent::JudgeFailOpen,
            revive = AuditEvent::Revive,
            clear = AuditEvent::JudgeClear,
        )))
        .bind(fact.tenant_id.as_str())
        .bind(fact.id)
        .bind(outcome.as_str())
        .bind(outcome == JudgeOutcome::FailOpen && judgement.failure_may_pass)
        .execute(&mut *tx)
        .await?;
        // A fact's validity starts when its writer's transaction began, so a newer fact of its
        // key may have been judged while it was not yet committed, and never saw it; and an
        // extracted fact is valid from when it was said, often before facts already judged.
        // Judged again, those see it among their older facts, and one that replaces it retires
        // it: one fact per key stays live, and a later statement wins over an earlier one read
        // late. The same key's for a keyed fact; every newer one of the bucket for an extracted
        // fact (those of its key, then the nearest, a bounded number). Unkeyed pending ones too:
        // one being judged by a model now read its older facts before this one was judged, and
        // its judgement is dropped when applied (`judge_reopens`).
        let reopen = match (&fact.fact_key, fact.extracted) {
            (_, true) => Some(None),
            (Some(key), false) => Some(Some(key)),
            (None, false) => None,
        };
        if let Some(key) = reopen {
            let reopened: Vec<(Uuid, String)> = sqlx::query_as(AssertSqlSafe(format!(
                "UPDATE memory_items r SET judge_at = NULL, judge_outcome = NULL, judge_enqueued_at = now(),
                                           judge_reopens = r.judge_reopens + 1
                 WHERE r.tenant_id = $1 AND r.id IN (
                   SELECT n.id FROM memory_items n
                   WHERE n.tenant_id = $1 AND n.{column} = $2 AND n.scope = '{scope}'
                     AND ($3::text IS NULL OR n.fact_key = $3)
                     -- Judged, or being judged by a model: pending, unkeyed, with a vector (one
                     -- without reads its older facts later; a keyed one reads its key's under the lock).
                     AND n.{LIVE_FACT}
                     AND (n.judge_at IS NOT NULL OR (n.embedded_model IS NOT NULL AND n.fact_key IS NULL))
                     AND (COALESCE(n.valid_from, n.created_at), n.id) > ($4, $5)
                     AND n.visibility = $6 AND n.allowed_roles = $7 AND ($8::text IS NULL OR n.agent_id = $8)
                     -- Only one that may retire it: an agent's fact, by its writer or a service token.
                     AND (n.scope <> 'agent' OR n.user_id IS NULL OR n.user_id IS NOT DISTINCT FROM $9)
                   ORDER BY COALESCE(n.fact_key = $10, false) DESC, COALESCE(n.valid_from, n.created_at), n.id
                   LIMIT {REOPEN_AT_MOST})
                 RETURNING r.id, r.tenant_id",
                column = fact.identity_column(),
                scope = fact.scope.as_str(),
            )))
            .bind(fact.tenant_id.as_str())
            .bind(&fact.identity)
            .bind(key)
            .bind(fact.valid_from)
            .bind(fact.id)
            .bind(&fact.visibility)
            .bind(&fact.allowed_roles)
            .bind(&fact.reader_agent)
            .bind(&fact.writer)
            .bind(&fact.fact_key)
            .fetch_all(&mut *tx)
            .await?;
            push_judge_jobs(&mut tx, reopened).await?;
        }
        if outcome == JudgeOutcome::FailOpen {
            sqlx::query(
                "INSERT INTO audit_log (tenant_id, event, item_id, reason, actor, details)
                 VALUES ($1, $6, $2, $3, 'judge',
                         jsonb_build_object('model', $4::text, 'candidates', $5::int))",
            )
            .bind(fact.tenant_id.as_str())
            .bind(fact.id)
            .bind(judgement.reason)
            .bind(&judgement.model)
            .bind(i32::try_from(judgement.candidates).unwrap_or(i32::MAX))
            .bind(AuditEvent::JudgeFailOpen.as_str())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(Some(outcome))
    }

    /// Records one finished batch for `judge tune`.
    pub async fn record_judge_batch(&self, batch: &BatchRecord) -> Result<(), StoreError> {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        sqlx::query(
            "INSERT INTO judge_batches (worker, batch_size, rows_judged, model_calls, wall_ms, model_ms_sum, model_ms_max)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(&batch.worker)
        .bind(i32::try_from(batch.batch_size).unwrap_or(i32::MAX))
        .bind(i32::try_from(batch.rows).unwrap_or(i32::MAX))
        .bind(i32::try_from(batch.model_calls).unwrap_or(i32::MAX))
        .bind(ms(batch.wall))
        .bind(ms(batch.model_sum))
        .bind(ms(batch.model_max))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Queues a new judge job for every pending fact whose job was queued more than `grace` ago
    /// (a job that failed for good, or a fact from before the judge existed). At most `limit`.
    /// A fact queued after the oldest judge job still waiting has its own job waiting too (they
    /// run oldest first): a backlog longer than `grace` is not queued a second time, as
    /// [`Store::requeue_unembedded`] does for embedding.
    pub async fn requeue_unjudged(&self, grace: Duration, limit: i64) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        let stale: Vec<(Uuid, String)> = sqlx::query_as(AssertSqlSafe(format!(
            "WITH oldest_waiting AS (
                SELECT run_at FROM apalis.jobs WHERE job_type = $3 AND status = 'Pending'
                ORDER BY run_at LIMIT 1
            ), stale AS (
                SELECT m.tenant_id, m.id FROM memory_items m
                WHERE {} AND (m.judge_enqueued_at IS NULL
                              OR (m.judge_enqueued_at < now() - make_interval(secs => $1)
                                  AND m.judge_enqueued_at < COALESCE((SELECT run_at FROM oldest_waiting), 'infinity')))
                ORDER BY m.judge_enqueued_at NULLS FIRST
                LIMIT $2
                FOR UPDATE SKIP LOCKED
            )
            UPDATE memory_items m SET judge_enqueued_at = now()
            FROM stale WHERE m.tenant_id = stale.tenant_id AND m.id = stale.id
            RETURNING m.id, m.tenant_id",
            pending_filter("m")
        )))
        .bind(grace.as_secs_f64())
        .bind(limit)
        .bind(mnemo_core::Queue::Judge.as_str())
        .fetch_all(&mut *tx)
        .await?;
        let count = stale.len() as u64;
        push_judge_jobs(&mut tx, stale).await?;
        tx.commit().await?;
        Ok(count)
    }

    /// The backlog, the outcomes of the rows judged within `window`, and the batches finished
    /// within it.
    pub async fn judge_status(&self, window: Duration) -> Result<JudgeStatus, StoreError> {
        let (pending, oldest_pending_seconds): (i64, Option<f64>) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*), extract(epoch FROM now() - min(COALESCE(m.judge_enqueued_at, m.created_at)))::float8
             FROM memory_items m WHERE {}",
            pending_filter("m")
        )))
        .fetch_one(&self.pool)
        .await?;
        let counts: Vec<(String, i64)> = sqlx::query_as(
            "SELECT judge_outcome, count(*) FROM memory_items
             WHERE source_kind = 'fact' AND judge_at IS NOT NULL AND judge_at >= now() - make_interval(secs => $1)
             GROUP BY judge_outcome",
        )
        .bind(window.as_secs_f64())
        .fetch_all(&self.pool)
        .await?;
        let outcomes = JudgeOutcome::ALL
            .into_iter()
            .map(|o| (o, counts.iter().find(|(name, _)| name == o.as_str()).map_or(0, |(_, n)| *n)))
            .collect();
        let to_ask_again: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM memory_items
             WHERE judge_retry_at IS NOT NULL AND judge_outcome = '{fail_open}' AND {LIVE_FACT}",
            fail_open = JudgeOutcome::FailOpen.as_str(),
        )))
        .fetch_one(&self.pool)
        .await?;
        let batches = self.judge_batch_stats(window).await?;
        Ok(JudgeStatus { pending, oldest_pending_seconds, outcomes, to_ask_again, batches })
    }

    pub async fn judge_batch_stats(&self, window: Duration) -> Result<BatchStats, StoreError> {
        let row: (i64, i64, i64, f64, f64, f64, f64) = sqlx::query_as(
            "SELECT count(*), COALESCE(sum(rows_judged), 0), COALESCE(sum(model_calls), 0),
                    COALESCE(avg(wall_ms), 0), COALESCE(avg(model_ms_max), 0),
                    COALESCE(sum(model_ms_sum) / NULLIF(sum(model_calls), 0), 0),
                    COALESCE(sum(rows_judged) / NULLIF(sum(wall_ms) / 1000.0, 0), 0)
             FROM judge_batches WHERE finished_at >= now() - make_interval(secs => $1)",
        )
        .bind(window.as_secs_f64())
        .fetch_one(&self.pool)
        .await?;
        Ok(BatchStats {
            batches: row.0,
            rows: row.1,
            model_calls: row.2,
            mean_wall_ms: row.3,
            mean_model_max_ms: row.4,
            mean_model_call_ms: row.5,
            rows_per_second: row.6,
        })
    }

    /// Facts whose judge failed open since `since`, newest first, with the failure's kind.
    pub async fn fail_open_facts(
        &self,
        tenant: Option<&TenantId>,
        since: DateTime<Utc>,
        limit: i64,
    ) -> Result<Vec<FailOpenFact>, StoreError> {
        Ok(sqlx::query_as(AssertSqlSafe(format!(
            "SELECT m.id, m.tenant_id, m.judge_at, a.reason
             FROM memory_items m
             LEFT JOIN LATERAL (
                SELECT reason FROM audit_log
                WHERE tenant_id = m.tenant_id AND item_id = m.id AND event = '{fail_open}'
                ORDER BY created_at DESC, id DESC LIMIT 1
             ) a ON true
             WHERE m.source_kind = 'fact' AND m.judge_at IS NOT NULL AND m.judge_outcome = '{outcome}'
               AND m.judge_at >= $1 AND ($2::text IS NULL OR m.tenant_id = $2)
             ORDER BY m.judge_at DESC, m.id
             LIMIT $3",
            fail_open = AuditEvent::JudgeFailOpen,
            outcome = JudgeOutcome::FailOpen,
        )))
        .bind(since)
        .bind(tenant.map(TenantId::as_str))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Re-opens judged live facts so they are judged again: clears `judge_at` and the outcome,
    /// queues a judge job, and writes a `judge_clear` audit row each, `batch` facts a transaction
    /// (oldest judgement first), calling `progress` with each batch done. Only judgements made
    /// before the call are cleared: a fact judged again meanwhile is not taken twice. With
    /// `dry_run`, only says which rows it would clear, locking nothing. Returns how many.
    pub async fn clear_judgements(
        &self,
        selection: &ClearSelection,
        tenant: Option<&TenantId>,
        actor: &str,
        dry_run: bool,
        batch: i64,
        progress: &mut dyn FnMut(&[ClearedFact]),
    ) -> Result<usize, StoreError> {
        let (ids, outcome, since) = match selection {
            ClearSelection::Ids(ids) => (Some(ids.clone()), None, None),
            ClearSelection::Outcome { outcome, since } => (None, Some(outcome.as_str()), Some(*since)),
        };
        let select = format!(
            "SELECT m.id, m.tenant_id, m.judge_at FROM memory_items m
             WHERE m.{LIVE_FACT} AND m.judge_at IS NOT NULL
               AND ($1::uuid[] IS NULL OR m.id = ANY($1))
               AND ($2::text IS NULL OR m.judge_outcome = $2)
               AND ($3::timestamptz IS NULL OR m.judge_at >= $3)
               AND ($4::text IS NULL OR m.tenant_id = $4)
               AND m.judge_at <= $5 AND ($6::timestamptz IS NULL OR (m.judge_at, m.id) > ($6, $7))
             ORDER BY m.judge_at, m.id
             LIMIT $8 {lock}",
            lock = if dry_run { "" } else { "FOR UPDATE" }
        );
        let started: DateTime<Utc> = sqlx::query_scalar("SELECT now()").fetch_one(&self.pool).await?;
        let (mut after, mut total): (Option<(DateTime<Utc>, Uuid)>, usize) = (None, 0);
        loop {
            let mut tx = self.pool.begin().await?;
            let found: Vec<(Uuid, String, DateTime<Utc>)> = sqlx::query_as(AssertSqlSafe(select.clone()))
                .bind(&ids)
                .bind(outcome)
                .bind(since)
                .bind(tenant.map(TenantId::as_str))
                .bind(started)
                .bind(after.map(|a| a.0))
                .bind(after.map(|a| a.1))
                .bind(batch)
                .fetch_all(&mut *tx)
                .await?;
            let Some(last) = found.last() else { return Ok(total) };
            after = Some((last.2, last.0));
            let rows: Vec<(Uuid, String)> = found.into_iter().map(|(id, tenant, _)| (id, tenant)).collect();
            if !dry_run {
                clear_batch(&mut tx, &rows, actor, "operator").await?;
                tx.commit().await?;
            }
            total += rows.len();
            progress(&rows);
            if (rows.len() as i64) < batch {
                return Ok(total);
            }
        }
    }

    /// Re-opens, as `judge clear` does, the live facts whose judge failed in a way that may pass
    /// and whose wait has ended (at most `limit`), with a `judge_clear` audit row each (actor
    /// `housekeeping`, reason `retry`) and a judge job. Returns how many.
    pub async fn rejudge_passing_failures(&self, limit: i64) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        // The conditions are the index's predicate (migration 046): a fact retired while it
        // waited leaves the index.
        let due: Vec<(Uuid, String)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT m.id, m.tenant_id FROM memory_items m
             WHERE m.judge_retry_at <= now() AND m.judge_outcome = '{fail_open}' AND m.{LIVE_FACT}
             ORDER BY m.judge_retry_at LIMIT $1
             FOR UPDATE SKIP LOCKED",
            fail_open = JudgeOutcome::FailOpen.as_str(),
        )))
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        if !due.is_empty() {
            clear_batch(&mut tx, &due, "housekeeping", "retry").await?;
        }
        tx.commit().await?;
        Ok(due.len() as u64)
    }

    /// The facts of one bucket with their state, oldest first. With `as_of`, liveness is as it
    /// was then (from the audit history) and facts written later are left out; otherwise it is
    /// as it is now. Retired facts come back only with `include_retired`.
    pub async fn facts(
        &self,
        tenant: &TenantId,
        scope: FactScope,
        identity: &str,
        as_of: Option<DateTime<Utc>>,
        include_retired: bool,
    ) -> Result<Vec<FactRecord>, StoreError> {
        let column = match scope {
            FactScope::User => "user_id",
            FactScope::Agent => "agent_id",
        };
        let sql = format!(
            "SELECT * FROM (
                SELECT m.id, m.content, m.fact_key, m.created_at, m.valid_from, m.valid_to, m.superseded_by,
                       m.superseded_at, m.judge_at, m.judge_outcome, m.anonymized_at IS NOT NULL AS anonymized,
                       CASE WHEN $4::timestamptz IS NULL
                            THEN m.superseded_by IS NULL AND m.deleted_at IS NULL AND m.anonymized_at IS NULL
                            ELSE COALESCE((
                                    SELECT a.event FROM audit_log a
                                    WHERE a.tenant_id = m.tenant_id AND a.item_id = m.id
                                      AND a.event IN ('{supersede}', '{delete}', '{revive}') AND a.created_at <= $4
                                    ORDER BY a.created_at DESC, a.id DESC LIMIT 1
                                 ), '{revive}') = '{revive}'
                       END AS live
                FROM memory_items m
                WHERE m.tenant_id = $1 AND m.scope = $2 AND m.{column} = $3 AND m.source_kind = 'fact'
                  AND ($4::timestamptz IS NULL OR m.created_at <= $4)
             ) f
             WHERE f.live OR $5
             ORDER BY f.created_at, f.id",
            supersede = AuditEvent::Supersede,
            delete = AuditEvent::Delete,
            revive = AuditEvent::Revive,
        );
        Ok(sqlx::query_as(AssertSqlSafe(sql))
            .bind(tenant.as_str())
            .bind(scope.as_str())
            .bind(identity)
            .bind(as_of)
            .bind(include_retired)
            .fetch_all(&self.pool)
            .await?)
    }
}

impl Store {
    /// Checks a tenant's supersede chains against the audit log: each retired fact has exactly one
    /// supersede audit row naming its successor, which is newer and of the same bucket, and each
    /// supersede audit row matches its fact. Facts ever revived are left out, with their audit
    /// rows: their history legitimately differs. An anonymized fact has lost its user or agent,
    /// so only its successor's age is checked. An imported chain has the audit row the import
    /// wrote for it (the source's log is not exported).
    pub async fn supersede_integrity(&self, tenant: &TenantId) -> Result<SupersedeIntegrity, StoreError> {
        let sql = format!(
            "WITH f AS (
                SELECT m.id, m.scope, COALESCE(CASE m.scope WHEN 'agent' THEN m.agent_id ELSE m.user_id END, '') AS identity,
                       m.visibility, m.allowed_roles,
                       CASE WHEN m.scope = 'user' AND m.visibility = 'agent' THEN m.agent_id END AS reader_agent,
                       COALESCE(m.valid_from, m.created_at) AS valid_from, m.superseded_by, m.judge_at,
                       m.judge_outcome, m.embedded_model, m.anonymized_at IS NOT NULL AS anonymized,
                       (m.superseded_by IS NULL AND m.deleted_at IS NULL AND m.anonymized_at IS NULL) AS live
                FROM memory_items m
                WHERE m.tenant_id = $1 AND m.source_kind = 'fact'
                  AND NOT EXISTS (SELECT 1 FROM audit_log r
                                  WHERE r.tenant_id = $1 AND r.event = '{revive}' AND r.item_id = m.id)
            ), s AS (
                SELECT a.item_id, a.related_item_id FROM audit_log a JOIN f ON f.id = a.item_id
                WHERE a.tenant_id = $1 AND a.event = '{supersede}'
            )
            SELECT (SELECT count(*) FROM f) AS facts,
                   (SELECT count(*) FROM f WHERE superseded_by IS NOT NULL) AS superseded,
                   (SELECT count(*) FROM f WHERE live AND judge_at IS NULL AND embedded_model IS NOT NULL) AS unjudged,
                   (SELECT count(*) FROM f WHERE live AND judge_outcome = '{fail_open}') AS failed_open,
                   (SELECT count(*) FROM (SELECT 1 FROM s GROUP BY item_id HAVING count(*) > 1) t) AS superseded_twice,
                   (SELECT count(*) FROM f WHERE superseded_by IS NOT NULL AND NOT EXISTS
                       (SELECT 1 FROM s WHERE s.item_id = f.id AND s.related_item_id = f.superseded_by)) AS unaudited,
                   (SELECT count(*) FROM s WHERE NOT EXISTS
                       (SELECT 1 FROM f WHERE f.id = s.item_id AND f.superseded_by = s.related_item_id))
                       AS audit_without_row,
                   (SELECT count(*) FROM f JOIN f n ON n.id = f.superseded_by
                    WHERE (n.valid_from, n.id) <= (f.valid_from, f.id)
                       OR (NOT f.anonymized AND NOT n.anonymized
                           AND (n.scope <> f.scope OR n.identity <> f.identity
                                OR n.visibility <> f.visibility OR n.allowed_roles <> f.allowed_roles
                                OR n.reader_agent IS DISTINCT FROM f.reader_agent)))
                       AS retired_wrongly,
                   (SELECT count(*) FROM (SELECT 1 FROM f WHERE live
                                          GROUP BY scope, identity, visibility, allowed_roles, reader_agent
                                          HAVING count(*) > 1) t)
                       AS buckets_with_several_live",
            revive = AuditEvent::Revive,
            supersede = AuditEvent::Supersede,
            fail_open = JudgeOutcome::FailOpen.as_str(),
        );
        Ok(sqlx::query_as(AssertSqlSafe(sql)).bind(tenant.as_str()).fetch_one(&self.pool).await?)
    }
}

/// Queues one judge job per (row, tenant), inside the caller's transaction.
pub(crate) async fn push_judge_jobs(tx: &mut sqlx::PgConnection, rows: Vec<(Uuid, String)>) -> Result<(), StoreError> {
    let jobs = rows
        .into_iter()
        .map(|(item_id, tenant)| Ok(JudgeJob { tenant_id: TenantId::parse(&tenant)?, item_id }))
        .collect::<Result<Vec<_>, StoreError>>()?;
    push(tx, &jobs).await
}

/// Clears the judgements of `rows` (locked by the caller), with an audit row (`actor`, `reason`)
/// and a judge job each.
async fn clear_batch(
    tx: &mut sqlx::PgConnection,
    rows: &[(Uuid, String)],
    actor: &str,
    reason: &str,
) -> Result<(), StoreError> {
    let (ids, tenants): (Vec<Uuid>, Vec<String>) = rows.iter().cloned().unzip();
    sqlx::query(
        "WITH cleared AS (
            UPDATE memory_items m SET judge_at = NULL, judge_outcome = NULL, judge_retry_at = NULL,
                                      judge_enqueued_at = now()
            FROM unnest($1::uuid[], $2::text[]) AS c(id, tenant_id)
            WHERE m.tenant_id = c.tenant_id AND m.id = c.id
            RETURNING m.id, m.tenant_id
        )
        INSERT INTO audit_log (tenant_id, event, item_id, reason, actor)
        SELECT tenant_id, $4, id, $5, $3 FROM cleared",
    )
    .bind(&ids)
    .bind(&tenants)
    .bind(actor)
    .bind(AuditEvent::JudgeClear.as_str())
    .bind(reason)
    .execute(&mut *tx)
    .await?;
    push_judge_jobs(tx, ids.into_iter().zip(tenants).collect()).await
}
