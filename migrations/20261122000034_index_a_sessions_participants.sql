-- A session's messages by participant: the `name` a user or assistant message was written with
-- (kept in tool_name, which holds the tool's name on tool messages). Recall ranks a session's
-- vector half within the one participant a question names, and finds that participant's
-- messages here without reading the session's others.
CREATE INDEX memory_items_participant_idx ON memory_items (tenant_id, session_id, lower(tool_name))
    WHERE tool_name IS NOT NULL AND role IN ('user', 'assistant') AND scope = 'session'
      AND deleted_at IS NULL AND anonymized_at IS NULL;
