-- The contradiction judge's state. A fact is pending while it is live, embedded and not yet
-- judged; `judge_enqueued_at` is when its judge job was last queued, so housekeeping can
-- re-queue a row whose job was lost (a job that failed for good, a database outage).
ALTER TABLE memory_items ADD COLUMN judge_enqueued_at timestamptz;

ALTER TABLE memory_items ADD CONSTRAINT memory_items_judge_outcome CHECK (
    judge_outcome IN ('no_candidates', 'kept', 'superseded', 'fail_open', 'disabled')
);

-- Small in steady state: the pending count, its oldest age and the re-queue sweep stay cheap.
CREATE INDEX memory_items_judge_pending_idx ON memory_items (judge_enqueued_at)
    WHERE source_kind = 'fact' AND judge_at IS NULL AND embedded_model IS NOT NULL
      AND superseded_by IS NULL AND deleted_at IS NULL AND anonymized_at IS NULL;

-- Recent outcomes, for `mnemo-runbook judge status` and the fail-open list.
CREATE INDEX memory_items_judged_idx ON memory_items (judge_at, judge_outcome)
    WHERE source_kind = 'fact' AND judge_at IS NOT NULL;

-- One row per judge batch: its size and timings, no ids and no content. `mnemo-runbook judge
-- tune` reads the recent ones to recommend a batch size.
CREATE TABLE judge_batches (
    id            bigint           GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    worker        text             NOT NULL,
    batch_size    integer          NOT NULL,
    rows_judged   integer          NOT NULL,
    model_calls   integer          NOT NULL,
    wall_ms       double precision NOT NULL,
    model_ms_sum  double precision NOT NULL,
    model_ms_max  double precision NOT NULL,
    finished_at   timestamptz      NOT NULL DEFAULT now()
);

CREATE INDEX judge_batches_finished_idx ON judge_batches (finished_at);
