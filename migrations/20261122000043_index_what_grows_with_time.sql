-- Indexes for statements whose cost grew with tables that only grow (docs/benchmarks.md, "Plans
-- at scale"; docs/analysis/plans_at_scale.sql measures each with and without its index).
-- IF NOT EXISTS: a large database builds them first, CONCURRENTLY (docs/runbook.md, "Upgrading
-- a large database").

-- Housekeeping prunes sweep records by age every tick: without this it read every record
-- (one per tenant with retired rows per hour, kept 30 days).
CREATE INDEX IF NOT EXISTS retention_sweeps_scheduled_idx ON retention_sweeps (scheduled_at);

-- Jobs that will still run. "Does a compact job wait for this session" (every context call past
-- its trigger), stranded extractions and the access batches' pruning read only these, where
-- apalis' own indexes led them through every finished job of the queue.
CREATE INDEX IF NOT EXISTS apalis_jobs_live_idx ON apalis.jobs (job_type, run_at)
    WHERE status IN ('Pending', 'Queued', 'Running') OR (status = 'Failed' AND attempts < max_attempts);

-- The compaction that first recorded a summary (read by every context call), and whether any
-- recorded compaction holds a summary: by the summary, not by every compaction of the session.
CREATE INDEX IF NOT EXISTS session_compactions_summary_idx
    ON session_compactions (tenant_id, session_id, summary_id, through_time, through_id);

-- A session's live summaries, which compaction reads under the tenant's text-count lock.
CREATE INDEX IF NOT EXISTS memory_items_live_summary_idx ON memory_items (tenant_id, session_id)
    WHERE source_kind = 'session_summary' AND deleted_at IS NULL AND anonymized_at IS NULL;

-- When a user was last erased, and whether an erasure was left unfinished.
CREATE INDEX IF NOT EXISTS audit_log_erasure_idx ON audit_log (tenant_id, (details ->> 'user_sha256'), created_at)
    WHERE event IN ('memory.erase', 'memory.erase.begun');

-- Live daily notes: consolidation's schedule and the archiving of old notes read these, not
-- every file and archived note of every tenant.
CREATE INDEX IF NOT EXISTS workspace_files_daily_note_idx ON workspace_files (tenant_id, agent_id, user_id, path)
    WHERE user_id <> '' AND deleted_at IS NULL AND path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$';
