-- Background maintenance (archiving old daily notes, pruning old session messages) runs once
-- per interval across all workers: the worker that inserts the interval's row does the work.
CREATE TABLE maintenance_runs (
    tick        bigint      PRIMARY KEY,
    worker      text        NOT NULL,
    archived    integer     NOT NULL DEFAULT 0,
    pruned      integer     NOT NULL DEFAULT 0,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);
