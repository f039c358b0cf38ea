-- Retention. Rows waiting to be anonymized (soft-deleted or superseded, content still there): the
-- sweep finds its candidates here, and the scheduler the tenants that have any.
CREATE INDEX memory_items_retired_idx ON memory_items (tenant_id, id)
    WHERE anonymized_at IS NULL AND (deleted_at IS NOT NULL OR superseded_at IS NOT NULL);

-- One row per (tenant, tick) sweep: inserting it is what schedules the tenant's sweep for that
-- tick, so each tenant is swept once per tick however many workers run. Counts only.
CREATE TABLE retention_sweeps (
    tenant_id   text        NOT NULL,
    tick        bigint      NOT NULL,
    scheduled_at timestamptz NOT NULL DEFAULT now(),
    worker      text,
    started_at  timestamptz,
    finished_at timestamptz,
    -- done, dry_run or refused
    result      text,
    anonymized  bigint,
    PRIMARY KEY (tenant_id, tick)
);

CREATE INDEX retention_sweeps_tick_idx ON retention_sweeps (tick);
