-- The full-text index holds lexemes alone again, as before migration 48. With the tenant beside
-- the lexemes, RUM read a large tenant's whole entry (one posting per row of the tenant) at every
-- keyword scan: at 1,000,000 rows of one tenant, search alone went from 15 ms to 82 ms at p50
-- (docs/benchmarks.md, "One tenant's vectors beside another's"). Migration 48 had mended a small
-- tenant beside a large neighbour whose rows hold the question's words (90 ms for one statement
-- under a generic plan); that cost is back, and is written down there. IF EXISTS and IF NOT
-- EXISTS: a large database builds this index first, CONCURRENTLY (docs/runbook.md, "Upgrading a
-- large database").
CREATE INDEX IF NOT EXISTS memory_items_tsv_idx ON memory_items
    USING rum (tsv rum_tsvector_ops)
    WHERE deleted_at IS NULL AND anonymized_at IS NULL AND embedded_model IS NOT NULL;
DROP INDEX IF EXISTS memory_items_tenant_text_idx;
