-- The full-text index holds each row's tenant beside its lexemes. Keyword search names one
-- tenant, but an index of lexemes alone gave it every tenant's rows holding the question's words,
-- and the tenant was checked row by row after: a small tenant's recall paid for a large
-- neighbour's matches (docs/benchmarks.md, "A neighbour's rows in the full-text index"). Now the
-- index intersects the tenant's entries with the lexemes' before reading a row. IF EXISTS and IF
-- NOT EXISTS: a large database builds the new index first, CONCURRENTLY (docs/runbook.md,
-- "Upgrading a large database").
CREATE INDEX IF NOT EXISTS memory_items_tenant_text_idx ON memory_items
    USING rum (tenant_id rum_text_ops, tsv rum_tsvector_ops)
    WHERE deleted_at IS NULL AND anonymized_at IS NULL AND embedded_model IS NOT NULL;
DROP INDEX IF EXISTS memory_items_tsv_idx;
