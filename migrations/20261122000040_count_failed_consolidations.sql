-- Consolidation runs that failed in a row (0 after one that did not). A failed run leaves its
-- notes to the next, which shows the model the same notes: a model that fails on them (or answers
-- past the budget) would be paid again at each request an extraction makes. Those requests wait
-- twice as long after each failure (crates/mnemo-store/src/consolidation.rs, REQUEST).
ALTER TABLE consolidation_state ADD COLUMN failures integer NOT NULL DEFAULT 0;
