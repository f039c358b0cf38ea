-- The turn whose words a chat message's vector was made with (the session's message before it,
-- embedded with it), so that anonymizing that turn drops the vectors holding its words and
-- embeds their rows again. NULL: made from the row's content alone. The nil uuid: not known, as
-- for every vector made before this migration (a constant default: no rewrite of the table);
-- anonymization then takes the turn's next message to be made with it.
ALTER TABLE memory_embeddings
    ADD COLUMN IF NOT EXISTS previous_id uuid DEFAULT '00000000-0000-0000-0000-000000000000';
CREATE INDEX IF NOT EXISTS memory_embeddings_previous_idx ON memory_embeddings (tenant_id, previous_id)
    WHERE previous_id IS NOT NULL;
