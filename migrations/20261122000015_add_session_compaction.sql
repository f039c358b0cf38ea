-- Compaction of a session's conversation. Each row records one compaction: the messages it
-- covered (those after the previous compaction, through `through_id`), how it ended, and the
-- summary in effect after it (a truncation keeps the previous one). Keyed by the last message
-- covered, so a retried or duplicated job records once. The messages themselves are never
-- touched: compaction only moves where a context window starts.
CREATE TABLE session_compactions (
    tenant_id text NOT NULL,
    session_id text NOT NULL,
    through_id uuid NOT NULL,
    through_time timestamptz NOT NULL,
    messages integer NOT NULL CHECK (messages > 0),
    outcome text NOT NULL CHECK (outcome IN ('summarized', 'truncated')),
    -- Why a truncation: `no_model`, or the model failure's label. Never content.
    reason text,
    -- A memory_items row (session_summary). No foreign key: erasure may remove the row, and
    -- then the window has no summary, as it would have had none.
    summary_id uuid,
    model text,
    trigger text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id, through_id),
    CHECK ((outcome = 'summarized') = (reason IS NULL))
);

CREATE INDEX session_compactions_latest_idx
    ON session_compactions (tenant_id, session_id, through_time DESC, through_id DESC);

-- A compaction asked for and not yet done: one per session, so a busy session queues one job,
-- not one per context call. The job removes it when it has recorded its compaction.
CREATE TABLE session_compaction_requests (
    tenant_id text NOT NULL,
    session_id text NOT NULL,
    trigger text NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id)
);

-- A session's live conversation in its one order: context calls read its newest messages
-- backwards from here, and count what follows a compaction, without sorting or visiting rows
-- that are not messages. On a large table build it CONCURRENTLY first (docs/runbook.md).
CREATE INDEX IF NOT EXISTS memory_items_conversation_idx ON memory_items (tenant_id, session_id, event_time, id)
    WHERE scope = 'session' AND source_kind IN ('chat_message', 'tool_output')
      AND deleted_at IS NULL AND anonymized_at IS NULL;
