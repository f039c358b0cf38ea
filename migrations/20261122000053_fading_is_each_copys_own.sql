-- Fading no longer marks a row changed. A row fades, and comes back when recalled, by the access
-- clock of the database it is in, which is each copy's own (last_accessed_at and access_count
-- are bookkeeping). When a fade counted as a change, a copy that faded a row after its source
-- deleted or superseded it kept its own row at the next `export --since`: the file's change
-- looked older. The same trigger as migration 26's, without faded_at, replaced in place (a
-- SHARE ROW EXCLUSIVE lock: reads go on; DROP TRIGGER would take ACCESS EXCLUSIVE).
CREATE OR REPLACE TRIGGER memory_items_changed BEFORE UPDATE ON memory_items FOR EACH ROW
WHEN (OLD.changed_at IS NOT DISTINCT FROM NEW.changed_at AND
    (OLD.scope, OLD.session_id, OLD.user_id, OLD.agent_id, OLD.source_kind, OLD.source_ref,
     OLD.content, OLD.content_sha256, OLD.tool_output_key, OLD.metadata, OLD.event_time,
     OLD.created_at, OLD.fact_key, OLD.judge_at, OLD.judge_outcome, OLD.superseded_by,
     OLD.superseded_at, OLD.valid_from, OLD.valid_to, OLD.deleted_at, OLD.anonymized_at, OLD.role,
     OLD.tool_call_id, OLD.tool_name, OLD.token_count, OLD.token_counter, OLD.layer, OLD.category,
     OLD.importance, OLD.confidence, OLD.tags, OLD.origin, OLD.visibility, OLD.allowed_roles,
     OLD.fingerprint)
    IS DISTINCT FROM
    (NEW.scope, NEW.session_id, NEW.user_id, NEW.agent_id, NEW.source_kind, NEW.source_ref,
     NEW.content, NEW.content_sha256, NEW.tool_output_key, NEW.metadata, NEW.event_time,
     NEW.created_at, NEW.fact_key, NEW.judge_at, NEW.judge_outcome, NEW.superseded_by,
     NEW.superseded_at, NEW.valid_from, NEW.valid_to, NEW.deleted_at, NEW.anonymized_at, NEW.role,
     NEW.tool_call_id, NEW.tool_name, NEW.token_count, NEW.token_counter, NEW.layer, NEW.category,
     NEW.importance, NEW.confidence, NEW.tags, NEW.origin, NEW.visibility, NEW.allowed_roles,
     NEW.fingerprint))
EXECUTE FUNCTION memory_items_mark_changed();
