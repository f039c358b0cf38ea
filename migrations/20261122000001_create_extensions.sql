-- pgvector for embeddings; hstore is needed by apalis' job tables. On a server where mnemo's
-- role is not a superuser, an administrator creates these once (scripts/setup-postgres.sh puts
-- them in template1), and IF NOT EXISTS makes this a no-op.
CREATE EXTENSION IF NOT EXISTS vector;
CREATE EXTENSION IF NOT EXISTS hstore;
