-- Consolidation of an (agent, user)'s daily notes into MEMORY.md. One row per pair: the
-- watermark (notes changed after it have not been consolidated yet; it moves only when a run
-- succeeds), the run held now (one at a time, across workers), when one was last asked for (to
-- throttle the requests extraction makes), and how the last run ended (a label, never content).
CREATE TABLE consolidation_state (
    tenant_id         text NOT NULL,
    agent_id          text NOT NULL,
    user_id           text NOT NULL,
    watermark         timestamptz NOT NULL DEFAULT '1970-01-01 00:00:00+00',
    running_since     timestamptz,
    running_by        text,
    last_requested_at timestamptz,
    -- The schedule's fire time last acted on (MNEMO_CONSOLIDATE_CRON).
    last_scheduled_at timestamptz,
    last_finished_at  timestamptz,
    last_outcome      text,
    last_reason       text,
    PRIMARY KEY (tenant_id, agent_id, user_id)
);

-- Each fire of the consolidation schedule, claimed by the one worker that schedules it, so the
-- scan for pairs with daily notes runs once per fire, not on every housekeeping tick.
CREATE TABLE consolidation_fires (
    fire      timestamptz PRIMARY KEY,
    scheduled integer     NOT NULL DEFAULT 0,
    at        timestamptz NOT NULL DEFAULT now()
);
