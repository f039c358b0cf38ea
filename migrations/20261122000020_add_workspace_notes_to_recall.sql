-- A user's MEMORY.md and daily notes are recallable: each live file is kept as rows of kind
-- workspace_note in the user's class, replaced (old pieces soft-deleted) in the transaction that
-- changes the file. The index finds a file's live pieces.
--
-- The wider CHECK is added NOT VALID: every existing row passed the narrower one it replaces, so
-- there is nothing to validate, and the table is not scanned under the migration's lock. On a
-- large table, build the index CONCURRENTLY before migrating (docs/runbook.md, "Upgrading a
-- large database"); IF NOT EXISTS then skips it here.
ALTER TABLE memory_items DROP CONSTRAINT memory_items_source_kind_check;
ALTER TABLE memory_items ADD CONSTRAINT memory_items_source_kind_check
    CHECK (source_kind IN ('chat_message', 'tool_output', 'document_chunk', 'fact', 'session_summary', 'workspace_note'))
    NOT VALID;

CREATE INDEX IF NOT EXISTS memory_items_workspace_note_idx
    ON memory_items (tenant_id, user_id, agent_id, (metadata ->> 'path'))
    WHERE source_kind = 'workspace_note' AND deleted_at IS NULL;
