-- A user's MEMORY.md and daily notes are recallable: each live file is kept as rows of kind
-- workspace_note in the user's class, replaced (old pieces soft-deleted) in the transaction that
-- changes the file. The index finds a file's live pieces.
ALTER TABLE memory_items DROP CONSTRAINT memory_items_source_kind_check;
ALTER TABLE memory_items ADD CONSTRAINT memory_items_source_kind_check
    CHECK (source_kind IN ('chat_message', 'tool_output', 'document_chunk', 'fact', 'session_summary', 'workspace_note'));

CREATE INDEX memory_items_workspace_note_idx ON memory_items (tenant_id, user_id, agent_id, (metadata ->> 'path'))
    WHERE source_kind = 'workspace_note' AND deleted_at IS NULL;
