-- A failed attempt at a conversation's extraction changes its row (attempts, reason) but no time
-- of it, so an export --since left it out and an import kept the copy's older count. It is dated
-- now (mnemo-store's MARK and MARK_FAILED); no default, so no rewrite.
ALTER TABLE memory_extractions ADD COLUMN IF NOT EXISTS attempted_at timestamptz;
