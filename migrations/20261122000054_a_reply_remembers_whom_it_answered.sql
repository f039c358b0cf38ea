-- A chat row carrying no user (an agent's reply written with a service token) is the user's it
-- follows: extraction reads it as theirs, and their erasure takes it (it may repeat what they
-- said). When retention anonymizes that user's message, the message names its user and session
-- no more, and the reply would follow the user before it: read as theirs, out of reach of the
-- erasure of the user it answered. So the anonymization marks each such reply with the sha256 of
-- the user it answered (as the erasure's audit row names a user); an anonymization of the reply
-- itself, or an erasure, clears it. Replies to messages anonymized before this migration stay
-- unmarked (their user is gone).
ALTER TABLE memory_items ADD COLUMN IF NOT EXISTS reply_to_user_sha256 text;

-- Few rows, so a small index; the erasure of a user finds the replies marked with their hash by
-- it. IF NOT EXISTS: a large database builds it first, CONCURRENTLY (docs/runbook.md,
-- "Upgrading a large database").
CREATE INDEX IF NOT EXISTS memory_items_reply_to_user_idx ON memory_items (tenant_id, reply_to_user_sha256)
    WHERE reply_to_user_sha256 IS NOT NULL;

-- The session rows carrying no user, in conversation order: the anonymization looks here first
-- whether a message has any row after it that could be a reply, one probe, so that a sweep of a
-- tenant whose every row carries a user pays nothing more. IF NOT EXISTS, as above.
CREATE INDEX IF NOT EXISTS memory_items_unowned_turns_idx ON memory_items (tenant_id, session_id, event_time, id)
    WHERE user_id IS NULL AND scope = 'session' AND source_kind IN ('chat_message', 'tool_output')
      AND anonymized_at IS NULL;

-- The mark is the row's state: an export --since carries it (migration 53's trigger, with it).
CREATE OR REPLACE TRIGGER memory_items_changed BEFORE UPDATE ON memory_items FOR EACH ROW
WHEN (OLD.changed_at IS NOT DISTINCT FROM NEW.changed_at AND
    (OLD.scope, OLD.session_id, OLD.user_id, OLD.agent_id, OLD.source_kind, OLD.source_ref,
     OLD.content, OLD.content_sha256, OLD.tool_output_key, OLD.metadata, OLD.event_time,
     OLD.created_at, OLD.fact_key, OLD.judge_at, OLD.judge_outcome, OLD.superseded_by,
     OLD.superseded_at, OLD.valid_from, OLD.valid_to, OLD.deleted_at, OLD.anonymized_at, OLD.role,
     OLD.tool_call_id, OLD.tool_name, OLD.token_count, OLD.token_counter, OLD.layer, OLD.category,
     OLD.importance, OLD.confidence, OLD.tags, OLD.origin, OLD.visibility, OLD.allowed_roles,
     OLD.fingerprint, OLD.reply_to_user_sha256)
    IS DISTINCT FROM
    (NEW.scope, NEW.session_id, NEW.user_id, NEW.agent_id, NEW.source_kind, NEW.source_ref,
     NEW.content, NEW.content_sha256, NEW.tool_output_key, NEW.metadata, NEW.event_time,
     NEW.created_at, NEW.fact_key, NEW.judge_at, NEW.judge_outcome, NEW.superseded_by,
     NEW.superseded_at, NEW.valid_from, NEW.valid_to, NEW.deleted_at, NEW.anonymized_at, NEW.role,
     NEW.tool_call_id, NEW.tool_name, NEW.token_count, NEW.token_counter, NEW.layer, NEW.category,
     NEW.importance, NEW.confidence, NEW.tags, NEW.origin, NEW.visibility, NEW.allowed_roles,
     NEW.fingerprint, NEW.reply_to_user_sha256))
EXECUTE FUNCTION memory_items_mark_changed();
