-- Keyword search ranks its candidates by BM25, which weighs each word of the question by how few
-- of the tenant's rows hold it (RUM's own ranking has no such weight: a question's rare word
-- counted no more than a common one). These tables hold, per tenant, how many rows with full
-- text hold each lexeme, and how many such rows there are with how many lexemes in all.
--
-- A row has full text from its first vector until it is anonymized (migration 028), and its
-- content never changes in between. So the embed worker adds a row's lexemes in the transaction
-- that first computes its full text (Store::save_vectors), and anonymization takes them away in
-- its own (retention and erasure): a word no remaining row holds is forgotten with the last one.
-- `mnemo_count_tenant_text` counts a tenant again from its rows, for loads that store rows with
-- their full text already (bulk loads, imports) and for the rows stored before this migration.
-- Every change to a tenant's counts first takes the tenant's advisory lock
-- (`mnemo_lock_text_counts`, in a statement of its own), so each sees the last one committed: a
-- row is counted once, and a recount beside a running embed worker neither collides with it nor
-- loses its rows.
CREATE TABLE tenant_lexemes (
    tenant_id text NOT NULL,
    lexeme text NOT NULL,
    documents bigint NOT NULL,
    PRIMARY KEY (tenant_id, lexeme)
);
CREATE TABLE tenant_text (
    tenant_id text PRIMARY KEY,
    documents bigint NOT NULL,
    lexemes bigint NOT NULL
);

-- The tenant wall of migration 029.
DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['tenant_lexemes', 'tenant_text'] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format(
            'CREATE POLICY tenant_wall ON %I USING (tenant_id = ANY ((SELECT mnemo_tenants())::text[]))'
            ' WITH CHECK (tenant_id = ANY ((SELECT mnemo_tenants())::text[]))', t);
    END LOOP;
END $$;

CREATE FUNCTION mnemo_lock_text_counts(tenant text) RETURNS void LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(hashtextextended('text counts' || chr(31) || tenant, 0));
$$;

-- VOLATILE (the default): each statement below takes a new snapshot, after the lock.
CREATE FUNCTION mnemo_count_tenant_text(tenant text) RETURNS void LANGUAGE sql AS $$
    SELECT mnemo_lock_text_counts(tenant);
    DELETE FROM tenant_lexemes WHERE tenant_id = tenant;
    INSERT INTO tenant_lexemes (tenant_id, lexeme, documents)
        SELECT tenant, l, count(*) FROM memory_items m CROSS JOIN unnest(tsvector_to_array(m.tsv)) AS l
        WHERE m.tenant_id = tenant AND m.tsv IS NOT NULL
        GROUP BY l;
    INSERT INTO tenant_text (tenant_id, documents, lexemes)
        SELECT tenant, count(*), coalesce(sum(length(m.tsv)), 0) FROM memory_items m
        WHERE m.tenant_id = tenant AND m.tsv IS NOT NULL
    ON CONFLICT (tenant_id) DO UPDATE SET documents = EXCLUDED.documents, lexemes = EXCLUDED.lexemes;
$$;

SELECT mnemo_count_tenant_text(t.tenant_id) FROM (SELECT DISTINCT tenant_id FROM memory_items) t;
