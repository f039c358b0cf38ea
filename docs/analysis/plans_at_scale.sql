-- Statements whose cost grows with tables that only grow, with migration 043's indexes and
-- rewrites and without them (docs/benchmarks.md, "Plans at scale"). Each statement is copied
-- from crates/mnemo-store (named beside it); "before" drops the new index inside a transaction
-- that rolls back, or runs the statement's earlier text. Synthetic rows: 1.4M retention sweep
-- records, 1M finished jobs, one tenant with 300,000 messages and 33,000 session summaries (one
-- session of 100,000 messages with 3,000 compactions), 10,000 small tenants, 700,000 audit rows,
-- 220,000 workspace files, 200,000 extraction requests of 1,000 (agent, user) pairs. In a scratch database of the current schema:
--   createdb scratch; MNEMO_DATABASE_URL=.../scratch mnemo-runbook migrate
--   psql .../scratch -f docs/analysis/plans_at_scale.sql | grep -E '^==|Execution Time'
\set ON_ERROR_STOP on
SELECT setseed(0.43);

-- 29 days of hourly sweeps of 10,000 tenants, pruned up to now: a tick's prune finds none.
INSERT INTO retention_sweeps (tenant_id, tick, scheduled_at, finished_at, result, anonymized)
SELECT 't' || (g % 10000), g / 10000, now() - make_interval(hours => (700000 - g / 2) / 10000 * 10), now(), 'done', 0
FROM generate_series(1, 1400000) g;

INSERT INTO apalis.jobs (job, id, job_type, status, attempts, max_attempts, run_at, done_at)
SELECT convert_to(CASE g % 3
           WHEN 0 THEN json_build_object('tenant_id', 'big', 'session_id', 's' || (g % 5000))::text
           WHEN 1 THEN json_build_object('tenant_id', 't' || (g % 10000), 'agent_id', 'a', 'user_id', 'u')::text
           ELSE json_build_object('tenant_id', 't' || (g % 10000), 'batch', g)::text END, 'UTF8'),
       'j' || g, (ARRAY['access', 'compact', 'extract'])[g % 3 + 1], 'Done', 1, 25,
       now() - make_interval(secs => g), now() - make_interval(secs => g)
FROM generate_series(1, 1000000) g;
INSERT INTO apalis.jobs (job, id, job_type, status, run_at)
SELECT convert_to(json_build_object('tenant_id', 'big', 'session_id', 's' || g)::text, 'UTF8'), 'live' || g, 'compact',
       'Pending', now()
FROM generate_series(1, 20) g;

-- The big tenant: 100,000 messages in session 'long', 200,000 in others; 3,000 summaries of
-- 'long', each held by a compaction.
INSERT INTO memory_items (id, tenant_id, scope, session_id, user_id, agent_id, source_kind, source_ref, content,
                          content_sha256, event_time, role)
SELECT gen_random_uuid(), 'big', 'session', CASE WHEN g <= 100000 THEN 'long' ELSE 's' || (g % 5000) END, 'u1', 'a',
       'chat_message', 'm' || g, 'message ' || g, sha256(('m' || g)::bytea), now() - make_interval(secs => g), 'user'
FROM generate_series(1, 300000) g;
INSERT INTO memory_items (id, tenant_id, scope, session_id, source_kind, source_ref, content, content_sha256, event_time)
SELECT gen_random_uuid(), 'big', 'session', 'long', 'session_summary', 'summary:long:' || g, 'summary ' || g,
       sha256(('sum' || g)::bytea), now() - make_interval(secs => 100000 - g * 30)
FROM generate_series(1, 3000) g;
-- And 30,000 summaries of 5,000 other sessions.
INSERT INTO memory_items (id, tenant_id, scope, session_id, source_kind, source_ref, content, content_sha256, event_time)
SELECT gen_random_uuid(), 'big', 'session', 's' || (g % 5000), 'session_summary', 'summary:s:' || g, 'summary ' || g,
       sha256(('sums' || g)::bytea), now() - make_interval(secs => g)
FROM generate_series(1, 30000) g;
INSERT INTO session_compactions (tenant_id, session_id, through_id, through_time, messages, outcome, summary_id, trigger)
SELECT 'big', session_id, gen_random_uuid(), event_time, 30, 'summarized', id, 'messages'
FROM memory_items WHERE tenant_id = 'big' AND source_kind = 'session_summary';
INSERT INTO memory_items (id, tenant_id, scope, session_id, user_id, agent_id, source_kind, source_ref, content,
                          content_sha256, event_time, role)
SELECT gen_random_uuid(), 't' || (g % 10000), 'session', 's', 'u', 'a', 'chat_message', 'm' || g, 'message ' || g,
       sha256(('m' || g)::bytea), now() - make_interval(secs => g), 'user'
FROM generate_series(1, 250000) g;

INSERT INTO audit_log (tenant_id, event, reason, actor, details, created_at)
SELECT CASE WHEN g % 2 = 0 THEN 'big' ELSE 't' || (g % 10000) END,
       CASE WHEN g % 7000 = 0 THEN 'memory.erase' ELSE 'memory.delete' END, 'x', 'api',
       CASE WHEN g % 7000 = 0 THEN jsonb_build_object('user_sha256', md5(g::text)) ELSE '{}' END,
       now() - make_interval(secs => g)
FROM generate_series(1, 700000) g;

-- 10,000 tenants: PROFILE.md, MEMORY.md, 5 live daily notes and 15 archived ones each.
INSERT INTO workspace_files (tenant_id, agent_id, user_id, path, id, content, size_bytes, enabled, sort_order, version,
                             deleted_at)
SELECT 't' || t, 'a', 'u', p.path, gen_random_uuid(), 'x', 1, false, 100, 1, NULL
FROM generate_series(0, 9999) t,
     LATERAL (SELECT 'PROFILE.md' AS path UNION ALL SELECT 'MEMORY.md'
              UNION ALL SELECT 'memory/' || to_char(date '2026-11-01' + d, 'YYYY-MM-DD') || '.md' FROM generate_series(0, 4) d
              UNION ALL SELECT 'memory/archive/' || to_char(date '2026-01-01' + d, 'YYYY-MM-DD') || '.md'
              FROM generate_series(0, 14) d) p;

INSERT INTO memory_extractions (tenant_id, session_id, through_id, through_time, agent_id, user_id, trigger_source,
                                status, created_at)
SELECT 'big', 's' || g, gen_random_uuid(), now(), 'a' || (g % 1000), 'u' || (g % 1000), 'web',
       CASE WHEN g % 50 = 0 THEN 'failed' WHEN g <= 10 THEN 'pending' ELSE 'done' END, now() - interval '1 hour'
FROM generate_series(1, 200000) g;
INSERT INTO extraction_runs (tenant_id, agent_id, user_id, last_finished_at)
SELECT 'big', 'a' || g, 'u' || g, now() FROM generate_series(0, 999) g;
ANALYZE;

-- prune_finished_jobs (ops.rs), each housekeeping tick
\echo == prune retention sweep records: with retention_sweeps_scheduled_idx
BEGIN; EXPLAIN (ANALYZE, COSTS off) DELETE FROM retention_sweeps WHERE scheduled_at < now() - interval '30 days'; ROLLBACK;
\echo == prune retention sweep records: before
BEGIN; DROP INDEX retention_sweeps_scheduled_idx;
EXPLAIN (ANALYZE, COSTS off) DELETE FROM retention_sweeps WHERE scheduled_at < now() - interval '30 days'; ROLLBACK;

-- COMPACT_JOB_WAITS (conversation.rs), a context call past its trigger
PREPARE compact_waits(text, text, text) AS SELECT EXISTS (
    SELECT 1 FROM apalis.jobs
    WHERE job_type = $3
      AND (status IN ('Pending', 'Queued') OR (status = 'Failed' AND attempts < max_attempts))
      AND convert_from(job, 'UTF8')::jsonb @> jsonb_build_object('tenant_id', $1::text, 'session_id', $2::text));
\echo == a compact job waits: with apalis_jobs_live_idx
EXPLAIN (ANALYZE, COSTS off) EXECUTE compact_waits('big', 'long', 'compact');
\echo == a compact job waits: before
BEGIN; DROP INDEX apalis.apalis_jobs_live_idx; EXPLAIN (ANALYZE, COSTS off) EXECUTE compact_waits('big', 'long', 'compact'); ROLLBACK;

-- STRANDED (extraction.rs), each housekeeping tick while a request waits
PREPARE stranded(float8, bigint, text) AS
WITH live AS (
    SELECT convert_from(job, 'UTF8')::jsonb AS args FROM apalis.jobs
    WHERE job_type = $3
      AND (status IN ('Pending', 'Queued', 'Running') OR (status = 'Failed' AND attempts < max_attempts))
)
SELECT DISTINCT e.tenant_id, e.agent_id, e.user_id FROM memory_extractions e
WHERE e.status = 'pending' AND e.created_at < now() - make_interval(secs => $1)
  AND NOT EXISTS (
      SELECT 1 FROM live
      WHERE live.args @> jsonb_build_object('tenant_id', e.tenant_id, 'agent_id', e.agent_id, 'user_id', e.user_id))
LIMIT $2;
\echo == stranded extractions: with apalis_jobs_live_idx
EXPLAIN (ANALYZE, COSTS off) EXECUTE stranded(600, 100, 'extract');
\echo == stranded extractions: before
BEGIN; DROP INDEX apalis.apalis_jobs_live_idx; EXPLAIN (ANALYZE, COSTS off) EXECUTE stranded(600, 100, 'extract'); ROLLBACK;

-- prune_access_batches (typed.rs), each maintenance run
PREPARE oldest_access(text) AS SELECT min(run_at) FROM apalis.jobs WHERE job_type = $1
    AND (status IN ('Pending', 'Queued', 'Running') OR (status = 'Failed' AND attempts < max_attempts));
\echo == the oldest live access job: with apalis_jobs_live_idx
EXPLAIN (ANALYZE, COSTS off) EXECUTE oldest_access('access');
\echo == the oldest live access job: before
BEGIN; DROP INDEX apalis.apalis_jobs_live_idx; EXPLAIN (ANALYZE, COSTS off) EXECUTE oldest_access('access'); ROLLBACK;

-- SESSION_STATE (conversation.rs), every context call
PREPARE session_state(text, text) AS
SELECT c.through_id, c.through_time, c.summary_id, s.content AS summary,
       (SELECT sc.through_id FROM session_compactions sc
        WHERE sc.tenant_id = $1 AND sc.session_id = $2 AND sc.summary_id = c.summary_id
        ORDER BY sc.through_time, sc.through_id LIMIT 1) AS summary_through,
       r.trigger AS pending, r.requested_at AS pending_since
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT * FROM session_compactions WHERE tenant_id = $1 AND session_id = $2
    ORDER BY through_time DESC, through_id DESC LIMIT 1
) c ON true
LEFT JOIN memory_items s
    ON s.tenant_id = $1 AND s.id = c.summary_id AND s.session_id = $2 AND s.source_kind = 'session_summary'
   AND s.deleted_at IS NULL AND s.anonymized_at IS NULL
LEFT JOIN session_compaction_requests r ON r.tenant_id = $1 AND r.session_id = $2;
\echo == the state of a session: with session_compactions_summary_idx
EXPLAIN (ANALYZE, COSTS off) EXECUTE session_state('big', 'long');
\echo == the state of a session: before
BEGIN; DROP INDEX session_compactions_summary_idx; EXPLAIN (ANALYZE, COSTS off) EXECUTE session_state('big', 'long'); ROLLBACK;

-- DROP_UNHELD_SUMMARIES (conversation.rs), each compaction, under the tenant's text-count lock
PREPARE drop_unheld(text, text, uuid, uuid, text, text) AS
WITH dropped AS (
    UPDATE memory_items m SET deleted_at = now()
    WHERE m.tenant_id = $1 AND m.scope = 'session' AND m.session_id = $2 AND m.source_kind = 'session_summary'
      AND m.deleted_at IS NULL AND m.anonymized_at IS NULL
      AND ($3::uuid IS NULL OR m.id = $3) AND m.id IS DISTINCT FROM $4
      AND NOT EXISTS (
          SELECT 1 FROM session_compactions c WHERE c.tenant_id = $1 AND c.session_id = $2 AND c.summary_id = m.id)
    RETURNING m.id
), audit AS (
    INSERT INTO audit_log (tenant_id, event, item_id, reason, actor)
    SELECT $1, $5, id, $6, 'compaction' FROM dropped
)
SELECT id FROM dropped;
\echo == drop unheld summaries: with memory_items_live_summary_idx and session_compactions_summary_idx
BEGIN; EXPLAIN (ANALYZE, COSTS off) EXECUTE drop_unheld('big', 'long', NULL, NULL, 'memory.delete', 'compaction'); ROLLBACK;
\echo == drop unheld summaries: before
BEGIN; DROP INDEX memory_items_live_summary_idx; DROP INDEX session_compactions_summary_idx;
EXPLAIN (ANALYZE, COSTS off) EXECUTE drop_unheld('big', 'long', NULL, NULL, 'memory.delete', 'compaction'); ROLLBACK;

-- last_erasure (retention.rs), each `erase`
PREPARE last_erasure(text, text, text) AS
SELECT max(created_at) FROM audit_log WHERE tenant_id = $1 AND event = $2 AND details ->> 'user_sha256' = $3;
\echo == when a user was last erased: with audit_log_erasure_idx
EXPLAIN (ANALYZE, COSTS off) EXECUTE last_erasure('big', 'memory.erase', md5('14000'));
\echo == when a user was last erased: before
BEGIN; DROP INDEX audit_log_erasure_idx; EXPLAIN (ANALYZE, COSTS off) EXECUTE last_erasure('big', 'memory.erase', md5('14000')); ROLLBACK;

-- SCHEDULE (consolidation.rs), when the consolidation cron fires in a zone
PREPARE schedule_new(timestamptz, text) AS
WITH noted AS MATERIALIZED (
    SELECT DISTINCT tenant_id AS t FROM workspace_files
    WHERE user_id <> '' AND deleted_at IS NULL AND path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$'
), zone_tenants AS MATERIALIZED (SELECT t FROM noted WHERE tenant_time_zone(t) = $2)
INSERT INTO consolidation_state AS s (tenant_id, agent_id, user_id, last_scheduled_at, last_requested_at)
SELECT DISTINCT tenant_id, agent_id, user_id, $1::timestamptz, now() FROM workspace_files
WHERE user_id <> '' AND deleted_at IS NULL AND path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$'
  AND tenant_id IN (SELECT t FROM zone_tenants)
ON CONFLICT (tenant_id, agent_id, user_id) DO UPDATE SET last_scheduled_at = $1, last_requested_at = now()
WHERE s.last_scheduled_at IS NULL OR s.last_scheduled_at < $1
RETURNING tenant_id, agent_id, user_id;
PREPARE schedule_old(timestamptz, text) AS
INSERT INTO consolidation_state AS s (tenant_id, agent_id, user_id, last_scheduled_at, last_requested_at)
SELECT DISTINCT tenant_id, agent_id, user_id, $1::timestamptz, now() FROM workspace_files
WHERE user_id <> '' AND deleted_at IS NULL AND path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$'
  AND tenant_id IN (SELECT t FROM (SELECT DISTINCT tenant_id AS t FROM workspace_files) ts WHERE tenant_time_zone(t) = $2)
ON CONFLICT (tenant_id, agent_id, user_id) DO UPDATE SET last_scheduled_at = $1, last_requested_at = now()
WHERE s.last_scheduled_at IS NULL OR s.last_scheduled_at < $1
RETURNING tenant_id, agent_id, user_id;
\echo == the consolidation schedule: now (the tenants of the zone first, workspace_files_daily_note_idx)
BEGIN; EXPLAIN (ANALYZE, COSTS off) EXECUTE schedule_new(now(), 'UTC'); ROLLBACK;
\echo == the consolidation schedule: before (the earlier statement, without the index)
BEGIN; DROP INDEX workspace_files_daily_note_idx; EXPLAIN (ANALYZE, COSTS off) EXECUTE schedule_old(now(), 'UTC'); ROLLBACK;

-- OLD_NOTES (maintenance.rs), each maintenance run
PREPARE old_notes(text, bigint, text, text, text, text) AS
SELECT tenant_id, agent_id, user_id, path FROM workspace_files
WHERE user_id <> '' AND deleted_at IS NULL
  AND path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$' AND path < $1
  AND (tenant_id, agent_id, user_id, path) > ($3, $4, $5, $6)
ORDER BY tenant_id, agent_id, user_id, path
LIMIT $2;
\echo == old daily notes to archive: with workspace_files_daily_note_idx
EXPLAIN (ANALYZE, COSTS off) EXECUTE old_notes('memory/2026-08-01.md', 500, '', '', '', '');
\echo == old daily notes to archive: before
BEGIN; DROP INDEX workspace_files_daily_note_idx; EXPLAIN (ANALYZE, COSTS off) EXECUTE old_notes('memory/2026-08-01.md', 500, '', '', '', ''); ROLLBACK;

-- MEMORY_STATUS (extraction.rs), `mnemo-runbook memory status`
PREPARE status_new(text) AS
WITH requests AS (
    SELECT agent_id, user_id, count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'failed') AS failed
    FROM memory_extractions WHERE tenant_id = $1 GROUP BY agent_id, user_id
), pairs AS (
    SELECT agent_id, user_id FROM requests
    UNION SELECT agent_id, user_id FROM extraction_runs WHERE tenant_id = $1
    UNION SELECT agent_id, user_id FROM consolidation_state WHERE tenant_id = $1
)
SELECT p.agent_id, p.user_id, COALESCE(q.pending, 0) AS pending, COALESCE(q.failed, 0) AS failed,
       r.last_finished_at AS last_extraction, r.running_since AS extraction_running_since,
       c.watermark AS consolidation_watermark, c.last_finished_at AS last_consolidation,
       c.last_outcome AS last_consolidation_outcome, c.last_reason AS last_consolidation_reason,
       COALESCE(c.failures, 0) AS consolidation_failures
FROM pairs p
LEFT JOIN requests q ON q.agent_id = p.agent_id AND q.user_id = p.user_id
LEFT JOIN extraction_runs r ON r.tenant_id = $1 AND r.agent_id = p.agent_id AND r.user_id = p.user_id
LEFT JOIN consolidation_state c ON c.tenant_id = $1 AND c.agent_id = p.agent_id AND c.user_id = p.user_id
ORDER BY p.agent_id, p.user_id;
PREPARE status_old(text) AS
WITH pairs AS (
    SELECT agent_id, user_id FROM memory_extractions WHERE tenant_id = $1
    UNION SELECT agent_id, user_id FROM extraction_runs WHERE tenant_id = $1
    UNION SELECT agent_id, user_id FROM consolidation_state WHERE tenant_id = $1
)
SELECT p.agent_id, p.user_id,
       (SELECT count(*) FROM memory_extractions m WHERE m.tenant_id = $1 AND m.agent_id = p.agent_id
          AND m.user_id = p.user_id AND m.status = 'pending') AS pending,
       (SELECT count(*) FROM memory_extractions m WHERE m.tenant_id = $1 AND m.agent_id = p.agent_id
          AND m.user_id = p.user_id AND m.status = 'failed') AS failed,
       r.last_finished_at AS last_extraction, r.running_since AS extraction_running_since,
       c.watermark AS consolidation_watermark, c.last_finished_at AS last_consolidation,
       c.last_outcome AS last_consolidation_outcome, c.last_reason AS last_consolidation_reason,
       COALESCE(c.failures, 0) AS consolidation_failures
FROM pairs p
LEFT JOIN extraction_runs r ON r.tenant_id = $1 AND r.agent_id = p.agent_id AND r.user_id = p.user_id
LEFT JOIN consolidation_state c ON c.tenant_id = $1 AND c.agent_id = p.agent_id AND c.user_id = p.user_id
ORDER BY p.agent_id, p.user_id;
\echo == memory status of a tenant with 1,000 pairs: grouped once
EXPLAIN (ANALYZE, COSTS off) EXECUTE status_new('big');
\echo == memory status of a tenant with 1,000 pairs: before (two counts a pair)
EXPLAIN (ANALYZE, COSTS off) EXECUTE status_old('big');

-- RECORD_COMPACTION (conversation.rs), each compaction recorded, here one whose plan started at
-- the latest of the session's 3,000 records
PREPARE record_latest(text, text, uuid, timestamptz, int, text, text, uuid, text, text, timestamptz, uuid, uuid[]) AS
INSERT INTO session_compactions
    (tenant_id, session_id, through_id, through_time, messages, outcome, reason, summary_id, model, trigger,
     participants)
SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
       ARRAY(SELECT DISTINCT encode(sha256(convert_to(m.user_id, 'UTF8')), 'hex') FROM memory_items m
             WHERE m.tenant_id = $1 AND m.id = ANY($13::uuid[]) AND m.user_id IS NOT NULL)
WHERE NOT EXISTS (
    SELECT 1 FROM (SELECT through_time, through_id FROM session_compactions
                   WHERE tenant_id = $1 AND session_id = $2
                   ORDER BY through_time DESC, through_id DESC LIMIT 1) latest
    WHERE (through_time, through_id) >= ($4, $3) OR $11::timestamptz IS NULL
       OR (through_time, through_id) > ($11, $12)
)
ON CONFLICT (tenant_id, session_id, through_id) DO NOTHING;
PREPARE record_every(text, text, uuid, timestamptz, int, text, text, uuid, text, text, timestamptz, uuid, uuid[]) AS
INSERT INTO session_compactions
    (tenant_id, session_id, through_id, through_time, messages, outcome, reason, summary_id, model, trigger,
     participants)
SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
       ARRAY(SELECT DISTINCT encode(sha256(convert_to(m.user_id, 'UTF8')), 'hex') FROM memory_items m
             WHERE m.tenant_id = $1 AND m.id = ANY($13::uuid[]) AND m.user_id IS NOT NULL)
WHERE NOT EXISTS (
    SELECT 1 FROM session_compactions
    WHERE tenant_id = $1 AND session_id = $2
      AND ((through_time, through_id) >= ($4, $3) OR $11::timestamptz IS NULL
           OR (through_time, through_id) > ($11, $12))
)
ON CONFLICT (tenant_id, session_id, through_id) DO NOTHING;
SELECT through_time AS latest_time, through_id AS latest_id FROM session_compactions
WHERE tenant_id = 'big' AND session_id = 'long' ORDER BY through_time DESC, through_id DESC LIMIT 1 \gset
\echo == record a compaction: the latest record alone
BEGIN; EXPLAIN (ANALYZE, COSTS off) EXECUTE record_latest('big', 'long', gen_random_uuid(), now(), 30, 'summarized', NULL,
    NULL, 'm', 'messages', :'latest_time', :'latest_id', '{}'); ROLLBACK;
\echo == record a compaction: before (every record of the session)
BEGIN; EXPLAIN (ANALYZE, COSTS off) EXECUTE record_every('big', 'long', gen_random_uuid(), now(), 30, 'summarized', NULL,
    NULL, 'm', 'messages', :'latest_time', :'latest_id', '{}'); ROLLBACK;

-- PRUNE_SESSIONS (maintenance.rs), each maintenance run (every 6 hours by default): not changed,
-- measured for what a scan of every session row costs at this size
PREPARE prune_sessions(int, bigint) AS
SELECT m.tenant_id, m.id FROM memory_items m
WHERE m.scope = 'session' AND m.source_kind IN ('chat_message', 'tool_output', 'session_summary')
  AND m.deleted_at IS NULL AND m.anonymized_at IS NULL AND m.event_time < now() - make_interval(days => $1)
  AND NOT EXISTS (
      SELECT 1 FROM memory_items n
      WHERE n.tenant_id = m.tenant_id AND n.session_id = m.session_id AND n.scope = 'session'
        AND n.source_kind IN ('chat_message', 'tool_output') AND n.deleted_at IS NULL AND n.anonymized_at IS NULL
        AND n.event_time >= now() - make_interval(days => $1))
LIMIT $2;
\echo == rows of idle sessions to prune: none idle for 2 days, every row older
EXPLAIN (ANALYZE, COSTS off) EXECUTE prune_sessions(2, 1000);

-- ZONE_CLOCKS (time_zone.rs), every housekeeping tick (10 s): 10,000 tenants in 7 zones
INSERT INTO tenant_config (tenant_id, settings)
SELECT 't' || g, jsonb_build_object('time_zone',
       (ARRAY['Europe/Paris', 'America/New_York', 'Asia/Tokyo', 'UTC', 'Europe/Berlin', 'Australia/Sydney',
              'America/Los_Angeles'])[g % 7 + 1])
FROM generate_series(1, 10000) g
ON CONFLICT (tenant_id) DO UPDATE SET settings = tenant_config.settings || EXCLUDED.settings;
ANALYZE tenant_config;
PREPARE zone_clocks AS
SELECT zone, now() AT TIME ZONE zone FROM (
    SELECT tenant_time_zone(min(tenant_id)) AS zone FROM tenant_config WHERE settings ? 'time_zone'
    GROUP BY settings ->> 'time_zone'
    UNION SELECT 'UTC'
) zones ORDER BY zone;
PREPARE zone_clocks_before AS
SELECT zone, now() AT TIME ZONE zone FROM (
    SELECT tenant_time_zone(tenant_id) AS zone FROM tenant_config WHERE settings ? 'time_zone'
    UNION SELECT 'UTC'
) zones ORDER BY zone;
\echo == the clocks of the zones: each zone name checked once
EXPLAIN (ANALYZE, COSTS off) EXECUTE zone_clocks;
\echo == the clocks of the zones: before, checked once a tenant
EXPLAIN (ANALYZE, COSTS off) EXECUTE zone_clocks_before;
