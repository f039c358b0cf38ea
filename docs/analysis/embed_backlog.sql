-- What the embed backlog gauge (every worker, every 5 s) and housekeeping's re-queue cost, before
-- and after they read `embedded_model` as three ranges instead of `<>` (migration 42 beside).
-- Run on a scratch database migrated by `mnemo-runbook migrate`:
--   psql "$URL" -f docs/analysis/embed_backlog.sql
-- 100,000 embedded rows, two waiting for a vector, one given up.
INSERT INTO memory_items (id, tenant_id, scope, source_kind, source_ref, content, content_sha256,
                          embedded_model, user_id, event_time, embed_enqueued_at)
SELECT gen_random_uuid(), 't' || (g % 10), 'user', 'fact', 'backlog-' || g, 'c' || g, sha256(('c' || g)::bytea),
       'all-MiniLM-L6-v2', 'u1', now(), now() - interval '1 hour'
FROM generate_series(1, 100000) g;
UPDATE memory_items SET embedded_model = NULL WHERE source_ref IN ('backlog-1', 'backlog-2');
UPDATE memory_items SET embedded_model = NULL, embed_error = 'x' WHERE source_ref = 'backlog-3';
ANALYZE memory_items;
\echo 'gauge, before'
EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF)
SELECT count(*) FILTER (WHERE embed_error IS NULL),
       extract(epoch FROM now() - min(created_at) FILTER (WHERE embed_error IS NULL))::float8,
       count(*) FILTER (WHERE embed_error IS NOT NULL)
FROM memory_items
WHERE deleted_at IS NULL AND anonymized_at IS NULL AND (embedded_model IS NULL OR embedded_model <> 'all-MiniLM-L6-v2');
\echo 'gauge, after'
EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF)
SELECT w.n, w.oldest, f.n
FROM (SELECT count(*) AS n, extract(epoch FROM now() - min(created_at))::float8 AS oldest FROM memory_items
      WHERE embed_error IS NULL AND deleted_at IS NULL AND anonymized_at IS NULL
        AND (embedded_model IS NULL OR embedded_model < 'all-MiniLM-L6-v2' OR embedded_model > 'all-MiniLM-L6-v2')) w,
     (SELECT count(*) AS n FROM memory_items
      WHERE embed_error IS NOT NULL AND deleted_at IS NULL AND anonymized_at IS NULL
        AND (embedded_model IS NULL OR embedded_model < 'all-MiniLM-L6-v2' OR embedded_model > 'all-MiniLM-L6-v2')) f;
\echo 're-queue, before'
EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF)
SELECT tenant_id, id FROM memory_items
WHERE embed_error IS NULL AND deleted_at IS NULL AND anonymized_at IS NULL
  AND (embedded_model IS NULL OR embedded_model <> 'all-MiniLM-L6-v2')
  AND embed_enqueued_at < now() - make_interval(secs => 60)
ORDER BY embed_enqueued_at LIMIT 10000;
\echo 're-queue, after'
EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF)
SELECT tenant_id, id FROM memory_items
WHERE embed_error IS NULL AND deleted_at IS NULL AND anonymized_at IS NULL
  AND (embedded_model IS NULL OR embedded_model < 'all-MiniLM-L6-v2' OR embedded_model > 'all-MiniLM-L6-v2')
  AND embed_enqueued_at < now() - make_interval(secs => 60)
ORDER BY embed_enqueued_at LIMIT 10000;
