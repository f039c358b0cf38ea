-- The tenant class by event time as well, so that recall finds the rows of a period a question
-- names ("on 13 October 2023") without reading the class's other rows. Counting the class (what
-- the index was made for) reads the same index by its first column.
DROP INDEX memory_items_tenant_class_idx;
CREATE INDEX memory_items_tenant_class_idx ON memory_items (tenant_id, event_time)
    WHERE (scope = 'tenant' OR visibility = 'tenant') AND deleted_at IS NULL AND anonymized_at IS NULL;
