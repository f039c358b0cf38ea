-- Maintenance may delete faded episodic facts whose decay fell below MNEMO_DECAY_DELETE_FLOOR
-- (off by default): it looks for faded ones unused since a time, across tenants, and counts them.
CREATE INDEX IF NOT EXISTS memory_items_faded_idx ON memory_items ((COALESCE(last_accessed_at, event_time)))
    WHERE layer = 'episodic' AND source_kind = 'fact' AND scope <> 'session' AND faded_at IS NOT NULL
      AND deleted_at IS NULL AND anonymized_at IS NULL;

ALTER TABLE maintenance_runs ADD COLUMN forgotten bigint NOT NULL DEFAULT 0;
