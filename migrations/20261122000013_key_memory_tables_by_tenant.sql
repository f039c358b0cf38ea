-- Every primary, unique and foreign key of tenant data leads with tenant_id, so the tables can be
-- distributed by tenant (Citus requires the distribution column in each of them). memory_items
-- was keyed by (id), memory_embeddings by (item_id, model) and audit_log by (id); all three now
-- lead with the tenant, and
-- the foreign keys that point at memory_items name the tenant too (a supersede, a tool output
-- and a vector always stay inside one tenant, and now the database says so).
--
-- Online on a large table: this migration runs in one transaction, and building the two unique
-- indexes is what takes time (the rest only swaps constraints). On a large live database, build
-- them first without blocking writes, then run the migration, which finds them and reuses them:
--   CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS memory_items_tenant_pkey ON memory_items (tenant_id, id);
--   CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS memory_embeddings_tenant_pkey
--       ON memory_embeddings (tenant_id, item_id, model);
--   CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS audit_log_tenant_pkey ON audit_log (tenant_id, id);
-- (check that none is left INVALID by a failed build: drop and rebuild it if so). What remains
-- is validating the foreign keys, one index lookup per referencing row, while writes wait for
-- this transaction; docs/runbook.md ("Upgrading a large database") has the steps.

CREATE UNIQUE INDEX IF NOT EXISTS memory_items_tenant_pkey ON memory_items (tenant_id, id);
CREATE UNIQUE INDEX IF NOT EXISTS memory_embeddings_tenant_pkey ON memory_embeddings (tenant_id, item_id, model);
CREATE UNIQUE INDEX IF NOT EXISTS audit_log_tenant_pkey ON audit_log (tenant_id, id);

ALTER TABLE memory_items DROP CONSTRAINT memory_items_superseded_by_fkey;
ALTER TABLE tool_outputs DROP CONSTRAINT tool_outputs_item_id_fkey;
ALTER TABLE memory_embeddings DROP CONSTRAINT memory_embeddings_item_id_fkey;
ALTER TABLE memory_embeddings DROP CONSTRAINT memory_embeddings_pkey;
ALTER TABLE memory_items DROP CONSTRAINT memory_items_pkey;
ALTER TABLE audit_log DROP CONSTRAINT audit_log_pkey;

ALTER TABLE memory_items ADD CONSTRAINT memory_items_pkey PRIMARY KEY USING INDEX memory_items_tenant_pkey;
ALTER TABLE memory_embeddings
    ADD CONSTRAINT memory_embeddings_pkey PRIMARY KEY USING INDEX memory_embeddings_tenant_pkey;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_pkey PRIMARY KEY USING INDEX audit_log_tenant_pkey;

ALTER TABLE memory_items ADD CONSTRAINT memory_items_superseded_by_fkey
    FOREIGN KEY (tenant_id, superseded_by) REFERENCES memory_items (tenant_id, id);
ALTER TABLE tool_outputs ADD CONSTRAINT tool_outputs_item_id_fkey
    FOREIGN KEY (tenant_id, item_id) REFERENCES memory_items (tenant_id, id);
ALTER TABLE memory_embeddings ADD CONSTRAINT memory_embeddings_item_id_fkey
    FOREIGN KEY (tenant_id, item_id) REFERENCES memory_items (tenant_id, id);
