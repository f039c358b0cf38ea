-- One row per decision (supersede, revive, judge fail-open, judge cleared, anonymize, sweep
-- refused). Ids, codes and counts only: never content.
CREATE TABLE audit_log (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id       text        NOT NULL,
    event           text        NOT NULL,
    item_id         uuid,
    related_item_id uuid,
    reason          text,
    actor           text        NOT NULL,
    details         jsonb       NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(details) = 'object'),
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX audit_log_tenant_time_idx ON audit_log (tenant_id, created_at);
CREATE INDEX audit_log_item_idx ON audit_log (tenant_id, item_id) WHERE item_id IS NOT NULL;
