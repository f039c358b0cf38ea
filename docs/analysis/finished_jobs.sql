-- The workers' queue gauges (every 5 s on each worker) and housekeeping's pruning of finished
-- jobs (every 10 s tick), before and after migration 047, over :n finished jobs of the last
-- half hour (none due for pruning at the default hour's retention; older jobs the scratch database
-- already holds are), 100 pending and 10 dead.
-- Run in a scratch database migrated by mnemo (the script makes migration 047's indexes if they
-- are not there):
--   psql "$URL" -v n=1000000 -f docs/analysis/finished_jobs.sql | grep -E '^==|Execution Time'
-- Everything is rolled back.
BEGIN;
INSERT INTO apalis.jobs (job, id, job_type, status, run_at, done_at)
SELECT convert_to('{"tenant_id":"acme","item_ids":[]}', 'UTF8'), 'done-' || i, 'embed', 'Done',
       now() - interval '30 minutes' * random(), now() - interval '30 minutes' * random()
FROM generate_series(1, :n) i;
INSERT INTO apalis.jobs (job, id, job_type, status, run_at)
SELECT convert_to('{}', 'UTF8'), 'pending-' || i, 'embed', 'Pending', now() FROM generate_series(1, 100) i;
INSERT INTO apalis.jobs (job, id, job_type, status, run_at, attempts, max_attempts)
SELECT convert_to('{}', 'UTF8'), 'dead-' || i, 'judge', 'Failed', now(), 3, 3 FROM generate_series(1, 10) i;
-- Migration 047's indexes, for a database migrated before it.
CREATE INDEX IF NOT EXISTS apalis_jobs_finished_idx ON apalis.jobs ((coalesce(done_at, run_at)))
    WHERE status = 'Done' OR status = 'Killed' OR (status = 'Failed' AND attempts >= max_attempts);
CREATE INDEX IF NOT EXISTS apalis_jobs_dead_idx ON apalis.jobs (job_type)
    WHERE status = 'Killed' OR (status = 'Failed' AND attempts >= max_attempts);
ANALYZE apalis.jobs;

SAVEPOINT before;
DROP INDEX IF EXISTS apalis.apalis_jobs_finished_idx;
DROP INDEX IF EXISTS apalis.apalis_jobs_dead_idx;
\echo == before: the gauges, one pass over every job
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF)
SELECT job_type AS queue,
       count(*) FILTER (WHERE status IN ('Pending', 'Queued')) AS pending,
       count(*) FILTER (WHERE status = 'Running') AS running,
       count(*) FILTER (WHERE status = 'Failed' AND attempts < max_attempts) AS failed,
       count(*) FILTER (WHERE status = 'Killed' OR (status = 'Failed' AND attempts >= max_attempts)) AS dead,
       count(*) FILTER (WHERE status = 'Done') AS done,
       extract(epoch FROM now() - min(run_at) FILTER (WHERE status = 'Pending' AND run_at <= now()))::float8
FROM apalis.jobs GROUP BY job_type ORDER BY job_type;
\echo == before: pruning
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF)
DELETE FROM apalis.jobs
WHERE (status = 'Done' OR status = 'Killed' OR (status = 'Failed' AND attempts >= max_attempts))
  AND coalesce(done_at, run_at) < now() - make_interval(secs => 3600);
ROLLBACK TO SAVEPOINT before;

\echo == now: the gauges, live jobs
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF)
SELECT job_type,
       count(*) FILTER (WHERE status IN ('Pending', 'Queued')),
       count(*) FILTER (WHERE status = 'Running'),
       count(*) FILTER (WHERE status = 'Failed'),
       extract(epoch FROM now() - min(run_at) FILTER (WHERE status = 'Pending' AND run_at <= now()))::float8
FROM apalis.jobs
WHERE status IN ('Pending', 'Queued', 'Running') OR (status = 'Failed' AND attempts < max_attempts)
GROUP BY job_type;
\echo == now: the gauges, dead jobs
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF)
SELECT job_type, count(*) FROM apalis.jobs
WHERE status = 'Killed' OR (status = 'Failed' AND attempts >= max_attempts) GROUP BY job_type;
\echo == now: pruning
EXPLAIN (ANALYZE, SUMMARY, COSTS OFF, TIMING OFF)
DELETE FROM apalis.jobs WHERE id IN (
    SELECT id FROM apalis.jobs
    WHERE (status = 'Done' OR status = 'Killed' OR (status = 'Failed' AND attempts >= max_attempts))
      AND coalesce(done_at, run_at) < now() - make_interval(secs => 3600)
    ORDER BY coalesce(done_at, run_at) LIMIT 20000);
ROLLBACK;
