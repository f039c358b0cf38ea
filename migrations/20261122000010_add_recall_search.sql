-- Keyword half of recall: PostgreSQL full text over the content, English stemming. An anonymized
-- row's full-text data is empty, whatever its content says.
CREATE EXTENSION IF NOT EXISTS rum;

ALTER TABLE memory_items ADD COLUMN tsv tsvector GENERATED ALWAYS AS (
    CASE WHEN anonymized_at IS NULL THEN to_tsvector('english', content) ELSE ''::tsvector END
) STORED;

-- Recall ORs the query's lexemes, so a question matches thousands of rows; RUM keeps positions in
-- the index and returns matches already ranked (`ORDER BY tsv <=> query`), where GIN would rank
-- every match from the heap.
CREATE INDEX memory_items_tsv_idx ON memory_items USING rum (tsv rum_tsvector_ops)
    WHERE deleted_at IS NULL AND anonymized_at IS NULL;

-- ANALYZE records the most common lexemes with their frequencies; recall drops the very common
-- ones from a query. A larger target tracks more of them.
ALTER TABLE memory_items ALTER COLUMN tsv SET STATISTICS 1000;

-- OR of many tsqueries, to build a query from a list of lexemes.
CREATE AGGREGATE tsquery_or_agg(tsquery) (SFUNC = tsquery_or, STYPE = tsquery);

-- Tenant-wide rows (document chunks) are found by tenant and kind through the source key; the
-- other classes have their identity indexes.

-- Vector half: HNSW indexes are per model (see Store::ensure_vector_index). A tenant's rows are a
-- filter on a shared index, so let the scan go on past ef_search until enough rows pass the
-- filter (pgvector 0.8 iterative scans); recall re-sorts what relaxed order returns.
DO $$
BEGIN
    -- Loads pgvector in this session so its settings are known when stored below.
    PERFORM '[1]'::vector;
    EXECUTE format('ALTER DATABASE %I SET hnsw.iterative_scan = relaxed_order', current_database());
    EXECUTE format('ALTER DATABASE %I SET hnsw.ef_search = 100', current_database());
END
$$;
