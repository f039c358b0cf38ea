-- Embedding progress of a row: the model whose vector matches its current content (NULL until
-- embedded), failed attempts so far, the permanent failure that stopped it (a label and detail,
-- never content), and when its job was last queued, so the housekeeping sweep can re-queue rows
-- that stay unembedded past a grace period.
ALTER TABLE memory_items
    ADD COLUMN embedded_model    text,
    ADD COLUMN embed_attempts    integer     NOT NULL DEFAULT 0,
    ADD COLUMN embed_error       text,
    ADD COLUMN embed_enqueued_at timestamptz NOT NULL DEFAULT now();

-- Rows waiting for a vector: small in steady state, so the sweep and the pending gauge stay cheap.
CREATE INDEX memory_items_embed_pending_idx ON memory_items (embedded_model, embed_enqueued_at)
    WHERE embed_error IS NULL AND deleted_at IS NULL AND anonymized_at IS NULL;
