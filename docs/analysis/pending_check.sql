-- What recall pays to say whether rows of the searched classes still wait for a vector (it is
-- `degraded` then; crates/mnemo-store/src/search.rs, `pending_sql`), before and after it read
-- the tenant's rows without a vector through their own index. Synthetic rows: tenant 'quiet'
-- has a session of 50,000 embedded messages; tenant 'busy' a session of 1,000 embedded messages
-- and 300,000 just imported elsewhere that the embed workers have not reached. The model is 'm'.
-- In a scratch database of the current schema:
--   createdb scratch; MNEMO_DATABASE_URL=.../scratch mnemo-runbook migrate
--   psql .../scratch -f docs/analysis/pending_check.sql
-- Each statement runs six times in each plan mode; the last lines show `Execution Time`.
\set ON_ERROR_STOP on
INSERT INTO memory_items (id, tenant_id, scope, session_id, user_id, agent_id, source_kind, source_ref, content,
                          content_sha256, event_time, embedded_model, role)
SELECT gen_random_uuid(), 'quiet', 'session', 'long', 'u', 'a', 'chat_message', 'q' || g, 'message ' || g,
       sha256(('q' || g)::bytea), now() - make_interval(secs => g), 'm', 'user'
FROM generate_series(1, 50000) g
UNION ALL
SELECT gen_random_uuid(), 'busy', 'session', 'done', 'u', 'a', 'chat_message', 'd' || g, 'message ' || g,
       sha256(('d' || g)::bytea), now() - make_interval(secs => g), 'm', 'user'
FROM generate_series(1, 1000) g
UNION ALL
SELECT gen_random_uuid(), 'busy', 'session', 's' || (g % 500), 'u' || (g % 50), 'a', 'chat_message', 'b' || g,
       'message ' || g, sha256(('b' || g)::bytea), now() - make_interval(secs => g), NULL, 'user'
FROM generate_series(1, 300000) g;
ANALYZE memory_items;

-- The searched classes, as `class_filter` writes them; `$7`–`$10` as `LIVE` uses them.
\set classes '(($2::text IS NOT NULL AND m.session_id = $2 AND m.scope = ''session'') OR ($4::text IS NOT NULL AND m.user_id = $4 AND m.scope = ''user'' AND (m.source_kind <> ''workspace_note'' OR m.agent_id = $6::text)) OR ($5::text IS NOT NULL AND m.agent_id = $5 AND (m.scope = ''agent'' OR (m.scope = ''user'' AND m.visibility <> ''private'' AND m.user_id IS DISTINCT FROM $10::text))) OR ($3 AND (m.scope = ''tenant'' OR (m.visibility = ''tenant'' AND NOT COALESCE(m.scope = ''user'' AND m.user_id = $10::text, false) AND NOT COALESCE(m.agent_id = $5::text, false)))))'
\set live 'm.deleted_at IS NULL AND m.anonymized_at IS NULL AND ($8 OR m.superseded_by IS NULL) AND m.tenant_id = $1 AND m.source_kind = ANY($7) AND (m.allowed_roles = ''{}'' OR m.allowed_roles && $9::text[] OR (m.scope = ''user'' AND m.user_id = $10::text))'

PREPARE before(text, text, bool, text, text, text, text[], bool, text[], text) AS
SELECT EXISTS (
    SELECT 1 FROM memory_items m
    WHERE m.embed_error IS NULL AND :live
      AND (m.embedded_model IS NULL OR m.embedded_model < 'm' OR m.embedded_model > 'm') AND :classes
);
PREPARE now(text, text, bool, text, text, text, text[], bool, text[], text) AS
SELECT EXISTS (
    SELECT 1 FROM memory_items
    WHERE tenant_id = $1 AND deleted_at IS NULL AND anonymized_at IS NULL AND embedded_model IS NULL
    OFFSET 4096
) OR EXISTS (
    SELECT 1 FROM (SELECT * FROM memory_items
                   WHERE tenant_id = $1 AND deleted_at IS NULL AND anonymized_at IS NULL AND embedded_model IS NULL
                   ORDER BY created_at DESC LIMIT 4096) m
    WHERE m.embed_error IS NULL AND :live AND :classes
) OR EXISTS (
    SELECT 1 FROM memory_items m
    WHERE m.embed_error IS NULL AND :live AND (m.embedded_model < 'm' OR m.embedded_model > 'm') AND :classes
);

\set kinds '''{chat_message,tool_output,document_chunk,fact,session_summary,workspace_note}'''
\set quiet '(''quiet'', ''long'', true, ''u'', ''a'', ''a'', ' :kinds ', false, ''{}'', ''u'')'
\set busy '(''busy'', ''done'', true, ''u'', ''a'', ''a'', ' :kinds ', false, ''{}'', ''u'')'

\timing on
SET plan_cache_mode = auto;
\echo '== auto plans: the quiet tenant''s long session, before, then now'
EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet;
EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet;
\echo '== auto plans: the busy tenant''s embedded session while its import waits, before, then now'
EXECUTE before :busy; EXECUTE before :busy; EXECUTE before :busy; EXECUTE before :busy; EXECUTE before :busy; EXECUTE before :busy;
EXECUTE now :busy; EXECUTE now :busy; EXECUTE now :busy; EXECUTE now :busy; EXECUTE now :busy; EXECUTE now :busy;
SET plan_cache_mode = force_generic_plan;
\echo '== generic plans: the quiet tenant''s long session, before, then now'
EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet;
EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet;
\echo '== generic plans: the busy tenant''s embedded session while its import waits, before, then now'
EXECUTE before :busy; EXECUTE before :busy; EXECUTE before :busy; EXECUTE before :busy; EXECUTE before :busy; EXECUTE before :busy;
EXECUTE now :busy; EXECUTE now :busy; EXECUTE now :busy; EXECUTE now :busy; EXECUTE now :busy; EXECUTE now :busy;

\echo '== a model switch: the busy tenant''s import embedded by another model, the quiet tenant asks'
UPDATE memory_items SET embedded_model = 'old' WHERE tenant_id = 'busy' AND embedded_model IS NULL;
ANALYZE memory_items;
SET plan_cache_mode = auto;
EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet; EXECUTE before :quiet;
EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet; EXECUTE now :quiet;
