-- A second tenant wall, behind every statement's own tenant filter: a role that is not the
-- tables' owner (the API's role, see ARCHITECTURE.md) sees and writes only the rows of the
-- tenants named in the session setting `mnemo.tenants` (a text[] literal the store sets when it
-- takes a connection for a tenant; several for a group commit). Without the setting it sees
-- nothing. The owner (migrations, workers, the runbook) is not subject to it: no FORCE.
--
-- The setting is read once per statement through an InitPlan (the scalar sub-select, cast so
-- that ANY takes it as an array rather than as a set of rows), not once per row.
CREATE FUNCTION mnemo_tenants() RETURNS text[]
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT coalesce(nullif(current_setting('mnemo.tenants', true), ''), '{}')::text[] $$;

DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY[
        'access_batches', 'audit_log', 'consolidation_state', 'extraction_runs', 'memory_embeddings',
        'memory_extractions', 'memory_items', 'memory_relations', 'memory_sightings', 'retention_sweeps',
        'session_compaction_requests', 'session_compactions', 'tenant_config', 'tool_outputs',
        'workspace_file_versions', 'workspace_files'
    ] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format(
            'CREATE POLICY tenant_wall ON %I USING (tenant_id = ANY ((SELECT mnemo_tenants())::text[]))'
            ' WITH CHECK (tenant_id = ANY ((SELECT mnemo_tenants())::text[]))', t);
    END LOOP;
END $$;

-- Keyword search leaves out the lexemes common over all rows, read from the statistics ANALYZE
-- keeps; pg_stats hides them from a role under row-level security (they are drawn from every
-- tenant's rows), so the owner reads them for it: frequencies only, never a row.
CREATE FUNCTION mnemo_common_lexemes(fraction float8, max_rows float8) RETURNS TABLE (lexeme text, freq real)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path FROM CURRENT
    AS $$
    SELECT x.lexeme, x.freq
    FROM pg_stats s
    CROSS JOIN LATERAL unnest(s.most_common_elems::text::text[], s.most_common_elem_freqs) AS x(lexeme, freq)
    WHERE s.schemaname = current_schema() AND s.tablename = 'memory_items' AND s.attname = 'tsv'
      AND x.lexeme IS NOT NULL
      AND (x.freq > fraction
           OR x.freq * (SELECT greatest(reltuples, 0) FROM pg_class WHERE oid = 'memory_items'::regclass) > max_rows)
    $$;
