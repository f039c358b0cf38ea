-- The full-text (RUM) index took 85–90% of a write's cost in the database (docs/benchmarks.md,
-- "Where a write's time goes"). A row now enters it when the embed worker stores its first vector:
-- that UPDATE changes an indexed column, so it writes new entries in every index anyway. Recall
-- ranks a tenant's rows that are not in it yet from the heap (the index below), so a write is
-- found by keyword as soon as it is acknowledged.
DROP INDEX memory_items_tsv_idx;
CREATE INDEX memory_items_tsv_idx ON memory_items USING rum (tsv rum_tsvector_ops)
    WHERE deleted_at IS NULL AND anonymized_at IS NULL AND embedded_model IS NOT NULL;

CREATE INDEX memory_items_unindexed_idx ON memory_items (tenant_id, created_at)
    WHERE deleted_at IS NULL AND anonymized_at IS NULL AND embedded_model IS NULL;
