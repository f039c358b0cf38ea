-- When a row's current run of embedding failures began (NULL while it is not failing). A row is
-- given up only after failing for as long as its retry schedule promises to wait, however many
-- of its retries an endpoint that answers now and then brings forward. Bookkeeping, like
-- embed_attempts: no change of state.
ALTER TABLE memory_items ADD COLUMN embed_failing_since timestamptz;
