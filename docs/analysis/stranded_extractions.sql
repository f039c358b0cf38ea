-- The stranded-extraction check (housekeeping, every tick) with the containment anti-join it
-- had and the hash anti-join it has now, over N pending conversations older than the grace
-- and N live extract jobs (each of another (agent, user), so every pending row is stranded
-- and the anti-join reads every live job). Run in a scratch database migrated by mnemo:
--   psql "$URL" -v n=2000 -f docs/analysis/stranded_extractions.sql
-- Everything is rolled back.
BEGIN;
INSERT INTO memory_extractions (tenant_id, session_id, through_id, through_time, agent_id, user_id, trigger_source, created_at)
SELECT 'acme', 's' || i, gen_random_uuid(), now(), 'helper', 'u' || i, 'web', now() - interval '1 hour'
FROM generate_series(1, :n) i;
INSERT INTO apalis.jobs (job, id, job_type, status, run_at)
SELECT convert_to(jsonb_build_object('tenant_id', 'acme', 'agent_id', 'helper', 'user_id', 'v' || i)::text, 'UTF8'),
       'bench-' || i, 'extract', 'Pending', now() + interval '1 hour'
FROM generate_series(1, :n) i;
ANALYZE memory_extractions;
ANALYZE apalis.jobs;
\echo before: a containment test per pair
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF)
WITH live AS (
    SELECT convert_from(job, 'UTF8')::jsonb AS args FROM apalis.jobs
    WHERE job_type = 'extract'
      AND (status IN ('Pending', 'Queued', 'Running') OR (status = 'Failed' AND attempts < max_attempts))
)
SELECT DISTINCT e.tenant_id, e.agent_id, e.user_id FROM memory_extractions e
WHERE e.status = 'pending' AND e.created_at < now() - make_interval(secs => 600)
  AND NOT EXISTS (
      SELECT 1 FROM live
      WHERE live.args @> jsonb_build_object('tenant_id', e.tenant_id, 'agent_id', e.agent_id, 'user_id', e.user_id))
LIMIT 1000;
\echo now: the live jobs read once, a hash anti-join
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF)
WITH live AS MATERIALIZED (
    SELECT DISTINCT args ->> 'tenant_id' AS tenant_id, args ->> 'agent_id' AS agent_id, args ->> 'user_id' AS user_id
    FROM (SELECT convert_from(job, 'UTF8')::jsonb AS args FROM apalis.jobs
          WHERE job_type = 'extract'
            AND (status IN ('Pending', 'Queued', 'Running') OR (status = 'Failed' AND attempts < max_attempts))) j
)
SELECT DISTINCT e.tenant_id, e.agent_id, e.user_id FROM memory_extractions e
WHERE e.status = 'pending' AND e.created_at < now() - make_interval(secs => 600)
  AND NOT EXISTS (
      SELECT 1 FROM live
      WHERE live.tenant_id = e.tenant_id AND live.agent_id = e.agent_id AND live.user_id = e.user_id)
LIMIT 1000;
ROLLBACK;
