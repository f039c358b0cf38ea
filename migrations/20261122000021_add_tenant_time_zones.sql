-- A tenant's time zone: tenant_config.settings.time_zone, an IANA name (UTC when unset, or when
-- the name is not one PostgreSQL knows). It decides which day a daily note belongs to and when
-- the consolidation schedule fires. PostgreSQL's tz database does the arithmetic.
CREATE FUNCTION tenant_time_zone(tenant text) RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
    zone text;
BEGIN
    SELECT settings ->> 'time_zone' INTO zone FROM tenant_config WHERE tenant_id = tenant;
    IF zone IS NULL THEN
        RETURN 'UTC';
    END IF;
    PERFORM now() AT TIME ZONE zone;
    RETURN zone;
EXCEPTION WHEN invalid_parameter_value THEN
    RETURN 'UTC';
END $$;

-- The schedule fires at a wall-clock time in each zone: one claim per (zone, fire).
ALTER TABLE consolidation_fires ADD COLUMN zone text NOT NULL DEFAULT 'UTC';
ALTER TABLE consolidation_fires DROP CONSTRAINT consolidation_fires_pkey;
ALTER TABLE consolidation_fires ADD PRIMARY KEY (zone, fire);
