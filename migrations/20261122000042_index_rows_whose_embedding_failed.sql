-- Rows whose embedding failed for good, for the backlog gauge every worker reads every 5 s and
-- `status`: memory_items_embed_pending_idx holds only rows whose embedding did not fail, so
-- counting these read the whole table. Few rows, so a small index. IF NOT EXISTS: a large
-- database builds it first, CONCURRENTLY (docs/runbook.md, "Upgrading a large database").
CREATE INDEX IF NOT EXISTS memory_items_embed_failed_idx ON memory_items (embedded_model)
    WHERE embed_error IS NOT NULL AND deleted_at IS NULL AND anonymized_at IS NULL;
