-- Which version of each daily note consolidation has read, per (agent, user): a note is new to
-- consolidation when its version is above the one recorded here. A timestamp watermark alone
-- missed a note whose transaction began before a run's read and committed after it (its
-- updated_at fell below the watermark). The watermark stays, for operators: the newest change
-- consolidated. Entries are kept only for live daily notes.
ALTER TABLE consolidation_state ADD COLUMN consolidated jsonb NOT NULL DEFAULT '{}'::jsonb
    CHECK (jsonb_typeof(consolidated) = 'object');

UPDATE consolidation_state s SET consolidated = COALESCE((
    SELECT jsonb_object_agg(w.path, w.version) FROM workspace_files w
    WHERE w.tenant_id = s.tenant_id AND w.agent_id = s.agent_id AND w.user_id = s.user_id
      AND w.deleted_at IS NULL AND w.path ~ '^memory/[0-9]{4}-[0-9]{2}-[0-9]{2}[.]md$'
      AND w.updated_at <= s.watermark
), '{}'::jsonb);
