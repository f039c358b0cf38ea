-- One row per housekeeping tick: the worker that inserts it runs that tick, so the sweep fires
-- once per tick however many workers are alive. Old rows are pruned by the sweep itself.
CREATE TABLE housekeeping_ticks (
    tick        bigint      PRIMARY KEY,
    worker      text        NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    requeued    bigint,
    pruned_jobs bigint,
    removed_workers bigint,
    finished_at timestamptz
);
