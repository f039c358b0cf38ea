-- The rows a tenant shares (its tenant class: tenant-scoped rows and rows shared with the tenant),
-- found without reading the tenant's other rows. Recall counts them (up to a bound) to choose
-- between ranking them exactly and an HNSW scan: a tenant whose rows are all a session's or a
-- user's has none, and its recalls used to walk the HNSW index and then scan every row of the
-- tenant to find that out, a cost that grew with the tenant.
CREATE INDEX memory_items_tenant_class_idx ON memory_items (tenant_id)
    WHERE (scope = 'tenant' OR visibility = 'tenant') AND deleted_at IS NULL AND anonymized_at IS NULL;
