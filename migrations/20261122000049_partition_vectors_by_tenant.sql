-- Vectors in 16 partitions by a hash of the tenant, each partition with its own HNSW index. A
-- class's HNSW scan filtered to one tenant walked the one graph every tenant shared, past the
-- other tenants' nearer rows: a 20,000-row tenant beside a 500,000-row one took 43 ms at p50 for
-- the search alone, the HNSW scan 33 ms of it (docs/benchmarks.md, "One tenant's vectors beside
-- another's"). Now the scan walks its partition's graph, shared only with the tenants hashed there.
-- Every key already leads with tenant_id (migration 13), so the keys stay as they were.
--
-- It copies every vector and builds each model's HNSW index again (every index named
-- memory_embeddings_hnsw_*; other indexes made by hand on the table are not kept), with both
-- memory tables locked: recall and writes of memories wait until it commits, on a replica too.
-- docs/runbook.md ("Upgrading a large database") says how long that is.
--
-- Both tables are locked first, in the order other statements take them (memory_items, then
-- memory_embeddings), without waiting in their queue: dropping the old table's foreign key locks
-- memory_items, and taken in the middle that lock would deadlock with any statement holding
-- memory_items while waiting for the vectors. Busy tables are tried again for a minute.
DO $$
BEGIN
    FOR attempt IN 1..120 LOOP
        BEGIN
            LOCK TABLE memory_items, memory_embeddings IN ACCESS EXCLUSIVE MODE NOWAIT;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            PERFORM pg_sleep(0.5);
        END;
    END LOOP;
    RAISE EXCEPTION 'migration 49 locks memory_items and memory_embeddings, which stayed in use for a minute (a long export, import or transaction?): run it again when they are free';
END $$;

CREATE TEMP TABLE vector_indexes ON COMMIT DROP AS
SELECT pg_get_indexdef(i.indexrelid) AS definition
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = 'memory_embeddings'::regclass AND c.relname LIKE 'memory_embeddings\_hnsw\_%';

ALTER TABLE memory_embeddings RENAME TO memory_embeddings_unpartitioned;
CREATE TABLE memory_embeddings (LIKE memory_embeddings_unpartitioned INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY HASH (tenant_id);
-- Each partition walled as the table is (a statement naming a partition skips the table's policy).
DO $$
BEGIN
    FOR i IN 0..15 LOOP
        EXECUTE format('CREATE TABLE memory_embeddings_p%s PARTITION OF memory_embeddings
                        FOR VALUES WITH (MODULUS 16, REMAINDER %s)', i, i);
        EXECUTE format('ALTER TABLE memory_embeddings_p%s ENABLE ROW LEVEL SECURITY', i);
        EXECUTE format('CREATE POLICY tenant_wall ON memory_embeddings_p%s
                        USING (tenant_id = ANY ((SELECT mnemo_tenants())::text[]))
                        WITH CHECK (tenant_id = ANY ((SELECT mnemo_tenants())::text[]))', i);
    END LOOP;
END $$;
INSERT INTO memory_embeddings SELECT * FROM memory_embeddings_unpartitioned;
DROP TABLE memory_embeddings_unpartitioned;

ALTER TABLE memory_embeddings ADD CONSTRAINT memory_embeddings_pkey PRIMARY KEY (tenant_id, item_id, model);
ALTER TABLE memory_embeddings ADD CONSTRAINT memory_embeddings_item_id_fkey
    FOREIGN KEY (tenant_id, item_id) REFERENCES memory_items (tenant_id, id);
CREATE INDEX memory_embeddings_tenant_model_idx ON memory_embeddings (tenant_id, model);
CREATE INDEX memory_embeddings_previous_idx ON memory_embeddings (tenant_id, previous_id)
    WHERE previous_id IS NOT NULL;
ALTER TABLE memory_embeddings ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_wall ON memory_embeddings USING (tenant_id = ANY ((SELECT mnemo_tenants())::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT mnemo_tenants())::text[]));

-- Each model's HNSW index as it was (on the partitioned table: one per partition).
DO $$
DECLARE
    d text;
BEGIN
    FOR d IN SELECT definition FROM vector_indexes LOOP
        EXECUTE d;
    END LOOP;
END $$;

ANALYZE memory_embeddings;
