-- Finished jobs, which housekeeping prunes by age every tick, and dead ones, which every
-- worker's queue gauges count every few seconds: both read the whole jobs table without these
-- (an hour of every job's worth; docs/benchmarks.md, "Finished jobs"). Dead jobs are few; the
-- finished ones' index costs each job one entry when it ends. IF NOT EXISTS: a large database
-- builds them first, CONCURRENTLY (docs/runbook.md, "Upgrading a large database").
CREATE INDEX IF NOT EXISTS apalis_jobs_finished_idx ON apalis.jobs ((coalesce(done_at, run_at)))
    WHERE status = 'Done' OR status = 'Killed' OR (status = 'Failed' AND attempts >= max_attempts);
CREATE INDEX IF NOT EXISTS apalis_jobs_dead_idx ON apalis.jobs (job_type)
    WHERE status = 'Killed' OR (status = 'Failed' AND attempts >= max_attempts);
