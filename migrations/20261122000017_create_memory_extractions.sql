-- Extraction after a conversation. Each completed conversation is one row, keyed by its session
-- and last message, so a retried or duplicated completion asks once; rows wait as `pending`
-- until an extraction for their (agent, user) takes them, which is how a conversation that
-- arrives during a cooldown or a running extraction is coalesced into the next run, never lost.
CREATE TABLE memory_extractions (
    tenant_id      text        NOT NULL,
    session_id     text        NOT NULL,
    through_id     uuid        NOT NULL,
    through_time   timestamptz NOT NULL,
    agent_id       text        NOT NULL,
    user_id        text        NOT NULL,
    trigger_source text        NOT NULL,
    status         text        NOT NULL DEFAULT 'pending'
                   CHECK (status IN ('pending', 'done', 'failed', 'disabled')),
    -- The model's short reason, or a failure's label. Never content.
    reason         text,
    attempts       integer     NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz,
    PRIMARY KEY (tenant_id, session_id, through_id)
);

CREATE INDEX memory_extractions_pending_idx ON memory_extractions (tenant_id, agent_id, user_id)
    WHERE status = 'pending';

-- One extraction at a time per (agent, user), and the cooldown after it, held here so they hold
-- across worker processes and restarts. A run older than the stale limit is presumed dead.
CREATE TABLE extraction_runs (
    tenant_id        text NOT NULL,
    agent_id         text NOT NULL,
    user_id          text NOT NULL,
    running_since    timestamptz,
    running_by       text,
    last_finished_at timestamptz,
    PRIMARY KEY (tenant_id, agent_id, user_id)
);
