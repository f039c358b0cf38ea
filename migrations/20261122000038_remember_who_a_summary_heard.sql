-- The users whose messages a compaction's summary was made from, as the sha256 of their ids (as
-- the erasure's audit row names them). A summary holds every speaker's words under one writer's
-- stamp, and is carried into each later summary of the session; the user's erasure finds the
-- sessions to take summaries from here even after their own messages there were anonymized (by
-- a retention sweep, or deleted by them). Records made before this migration name nobody.
ALTER TABLE session_compactions ADD COLUMN IF NOT EXISTS participants text[] NOT NULL DEFAULT '{}';
