-- When housekeeping asks the judge again about a fact whose judgement failed open in a way that
-- may pass (the endpoint down, overloaded or too slow), after a wait that doubles with each of
-- its failures; NULL when it is not to be asked again automatically.
ALTER TABLE memory_items ADD COLUMN IF NOT EXISTS judge_retry_at timestamptz;

-- Housekeeping reads only the live facts failed open with a wait; the index holds none of the
-- others, so one retired while it waited leaves it. IF NOT EXISTS: a large database builds it
-- first, CONCURRENTLY (docs/runbook.md, "Upgrading a large database").
CREATE INDEX IF NOT EXISTS memory_items_judge_retry_idx ON memory_items (judge_retry_at)
    WHERE judge_retry_at IS NOT NULL AND judge_outcome = 'fail_open' AND source_kind = 'fact'
      AND superseded_by IS NULL AND deleted_at IS NULL AND anonymized_at IS NULL;
