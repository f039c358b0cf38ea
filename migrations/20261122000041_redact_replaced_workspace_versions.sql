-- Retention reaches workspace files: a version replaced (or a file deleted) more than the soft
-- TTL ago has its text redacted, as a soft-deleted memory row is anonymized. The version row
-- stays (who changed the file, when, how), its content becomes '' and redacted_at says when.
-- The index holds only versions not yet redacted: a file's current one and those replaced
-- lately, so a sweep reads little more than one entry per file
-- (crates/mnemo-store/src/retention.rs, due_versions!). IF NOT EXISTS: a large database builds it
-- first, CONCURRENTLY (docs/runbook.md, "Upgrading a large database").
ALTER TABLE workspace_file_versions ADD COLUMN IF NOT EXISTS redacted_at timestamptz;

CREATE INDEX IF NOT EXISTS workspace_file_versions_unredacted_idx
    ON workspace_file_versions (tenant_id, agent_id, user_id, path, version) WHERE redacted_at IS NULL;
