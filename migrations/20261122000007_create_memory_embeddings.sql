-- One vector per (row, model). Switching models fills the new model's vectors beside the old
-- ones, so nothing is lost and recall keeps serving from the model it uses. The dimension is
-- per model, hence the unconstrained `vector` type; search indexes are per model, as
-- expression indexes with the model's dimension.
CREATE TABLE memory_embeddings (
    tenant_id      text        NOT NULL,
    item_id        uuid        NOT NULL REFERENCES memory_items (id),
    model          text        NOT NULL,
    embedding      vector      NOT NULL,
    -- The content the vector was made from: a row whose content changed is embedded again.
    content_sha256 bytea       NOT NULL,
    embedded_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (item_id, model)
);

CREATE INDEX memory_embeddings_tenant_model_idx ON memory_embeddings (tenant_id, model);
