-- Full tool output payloads too long for a memory row, behind a tout_… key.
CREATE TABLE tool_outputs (
    tenant_id   text        NOT NULL,
    key         text        NOT NULL,
    item_id     uuid        NOT NULL REFERENCES memory_items (id),
    content     text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, key)
);

CREATE INDEX tool_outputs_item_idx ON tool_outputs (tenant_id, item_id);
