-- What a user's (and an agent's) class costs recall when that user has many messages: the
-- statement recall's vector half runs for those classes (crates/mnemo-store/src/search.rs,
-- `exact`), without and with migration 039's indexes. Synthetic rows: 200,000 chat messages of
-- one user and agent (a session's rows carry both), 50 facts of each, random 384-component
-- vectors. In a scratch database of the current schema:
--   createdb scratch; MNEMO_DATABASE_URL=.../scratch mnemo-runbook migrate
--   psql .../scratch -f docs/analysis/identity_class_scan.sql
\set ON_ERROR_STOP on
INSERT INTO memory_items (id, tenant_id, scope, session_id, user_id, agent_id, source_kind, source_ref, content,
                          content_sha256, event_time, embedded_model, role)
SELECT gen_random_uuid(), 't', 'session', 's' || (g % 1000), 'u', 'a', 'chat_message', 'm' || g, 'message ' || g,
       sha256(('m' || g)::bytea), now() - make_interval(secs => g), 'x', 'user'
FROM generate_series(1, 200000) g;
INSERT INTO memory_items (id, tenant_id, scope, user_id, agent_id, source_kind, source_ref, content, content_sha256,
                          event_time, embedded_model)
SELECT gen_random_uuid(), 't', 'user', 'u', 'a', 'fact', 'uf' || g, 'user fact ' || g, sha256(('uf' || g)::bytea),
       now(), 'x'
FROM generate_series(1, 50) g;
INSERT INTO memory_items (id, tenant_id, scope, agent_id, source_kind, source_ref, content, content_sha256,
                          event_time, embedded_model, visibility)
SELECT gen_random_uuid(), 't', 'agent', 'a', 'fact', 'af' || g, 'agent fact ' || g, sha256(('af' || g)::bytea),
       now(), 'x', 'agent'
FROM generate_series(1, 50) g;
INSERT INTO memory_embeddings (tenant_id, item_id, model, embedding, content_sha256)
SELECT m.tenant_id, m.id, 'x',
       (SELECT array_agg(random()::real) FROM generate_series(1, 384) WHERE m.id IS NOT NULL)::vector,
       m.content_sha256
FROM memory_items m;

PREPARE user_class(vector) AS
SELECT m.id, (e.embedding::vector(384) <=> $1::vector(384)) AS d
FROM memory_items m
JOIN memory_embeddings e ON e.tenant_id = m.tenant_id AND e.item_id = m.id AND e.model = 'x'
WHERE m.user_id = 'u' AND m.scope = 'user' AND (m.source_kind <> 'workspace_note' OR m.agent_id = 'a')
  AND m.deleted_at IS NULL AND m.anonymized_at IS NULL AND m.tenant_id = 't'
ORDER BY (e.embedding::vector(384) <=> $1::vector(384)) + 0 LIMIT 50;
PREPARE agent_class(vector) AS
SELECT m.id, (e.embedding::vector(384) <=> $1::vector(384)) AS d
FROM memory_items m
JOIN memory_embeddings e ON e.tenant_id = m.tenant_id AND e.item_id = m.id AND e.model = 'x'
WHERE m.agent_id = 'a'
  AND (m.scope = 'agent' OR (m.scope = 'user' AND m.visibility <> 'private' AND m.user_id IS DISTINCT FROM 'v'))
  AND m.deleted_at IS NULL AND m.anonymized_at IS NULL AND m.tenant_id = 't'
ORDER BY (e.embedding::vector(384) <=> $1::vector(384)) + 0 LIMIT 50;
SELECT (SELECT array_agg(random()::real) FROM generate_series(1, 384))::vector AS q \gset

\echo 'without migration 039''s indexes'
BEGIN;
DROP INDEX memory_items_user_class_idx, memory_items_agent_class_idx;
ANALYZE memory_items;
EXPLAIN (ANALYZE, COSTS OFF) EXECUTE user_class(:'q');
EXPLAIN (ANALYZE, COSTS OFF) EXECUTE agent_class(:'q');
ROLLBACK;
\echo 'with them'
ANALYZE memory_items;
EXPLAIN (ANALYZE, COSTS OFF) EXECUTE user_class(:'q');
EXPLAIN (ANALYZE, COSTS OFF) EXECUTE agent_class(:'q');
