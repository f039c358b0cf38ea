-- A row's full-text vector is computed when its first vector is stored, not when it is written:
-- to_tsvector was about a sixth of the database's time per written row, and a stored generated
-- column is computed again by every UPDATE of the row anyway (the embed worker's among them). The
-- index only holds embedded rows already (migration 024); recall stems the few rows not embedded
-- yet from their content. An anonymized row's vector stays empty (NULL now, '' before).
ALTER TABLE memory_items DROP COLUMN tsv;  -- and memory_items_tsv_idx with it
ALTER TABLE memory_items ADD COLUMN tsv tsvector GENERATED ALWAYS AS (
    CASE WHEN anonymized_at IS NULL AND embedded_model IS NOT NULL THEN to_tsvector('english', content) END
) STORED;
CREATE INDEX memory_items_tsv_idx ON memory_items USING rum (tsv rum_tsvector_ops)
    WHERE deleted_at IS NULL AND anonymized_at IS NULL AND embedded_model IS NOT NULL;
ALTER TABLE memory_items ALTER COLUMN tsv SET STATISTICS 1000;
