-- Per-tenant settings, e.g. settings.memory_retention.
CREATE TABLE tenant_config (
    tenant_id   text        PRIMARY KEY,
    settings    jsonb       NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(settings) = 'object'),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
