-- A memory's decay runs from its last recall or, never recalled, from its event_time, but from
-- its write at the latest: a fact dated ahead (an appointment next year) stayed fully fresh, and
-- was never faded nor forgotten, until that date came. Fading and forgetting find their rows by
-- the new clock (decay_clock! in mnemo-store). New names, IF NOT EXISTS and IF EXISTS: a large
-- database builds these first, CONCURRENTLY (docs/runbook.md, "Upgrading a large database").
CREATE INDEX IF NOT EXISTS memory_items_fading_idx
    ON memory_items ((COALESCE(last_accessed_at, LEAST(event_time, created_at))))
    WHERE layer = 'episodic' AND scope <> 'session' AND faded_at IS NULL
      AND deleted_at IS NULL AND anonymized_at IS NULL;
CREATE INDEX IF NOT EXISTS memory_items_forgetting_idx
    ON memory_items ((COALESCE(last_accessed_at, LEAST(event_time, created_at))))
    WHERE layer = 'episodic' AND source_kind = 'fact' AND scope <> 'session' AND faded_at IS NOT NULL
      AND deleted_at IS NULL AND anonymized_at IS NULL;
DROP INDEX IF EXISTS memory_items_fade_idx;
DROP INDEX IF EXISTS memory_items_faded_idx;
