-- When a row's state last changed, so `mnemo-runbook export --since` also carries rows retired,
-- superseded, anonymized, revived or faded after they were written, not only rows written since.
-- Rows already stored take the time of this migration: an export since an earlier time holds
-- them all, which is more than it needs and never less.
ALTER TABLE memory_items ADD COLUMN changed_at timestamptz NOT NULL DEFAULT now();

CREATE FUNCTION memory_items_mark_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.changed_at := now();
    RETURN NEW;
END
$$;

-- A trigger keeps it, so no statement can forget to. The state is every column but the keys and
-- the bookkeeping: the embed and judge queues' columns, access counts (a copy keeps its own),
-- the generated full-text vector. The WHEN clause is evaluated without calling the function,
-- so the embed worker's updates cost nothing here. An UPDATE that sets the time itself (an
-- import carrying its source's) keeps it. A column added later is named here or in the
-- bookkeeping list of tests/portability.rs, which fails until it is.
CREATE TRIGGER memory_items_changed BEFORE UPDATE ON memory_items FOR EACH ROW
WHEN (OLD.changed_at IS NOT DISTINCT FROM NEW.changed_at AND
    (OLD.scope, OLD.session_id, OLD.user_id, OLD.agent_id, OLD.source_kind, OLD.source_ref,
     OLD.content, OLD.content_sha256, OLD.tool_output_key, OLD.metadata, OLD.event_time,
     OLD.created_at, OLD.fact_key, OLD.judge_at, OLD.judge_outcome, OLD.superseded_by,
     OLD.superseded_at, OLD.valid_from, OLD.valid_to, OLD.deleted_at, OLD.anonymized_at, OLD.role,
     OLD.tool_call_id, OLD.tool_name, OLD.token_count, OLD.token_counter, OLD.layer, OLD.category,
     OLD.importance, OLD.confidence, OLD.tags, OLD.origin, OLD.visibility, OLD.allowed_roles,
     OLD.fingerprint, OLD.faded_at)
    IS DISTINCT FROM
    (NEW.scope, NEW.session_id, NEW.user_id, NEW.agent_id, NEW.source_kind, NEW.source_ref,
     NEW.content, NEW.content_sha256, NEW.tool_output_key, NEW.metadata, NEW.event_time,
     NEW.created_at, NEW.fact_key, NEW.judge_at, NEW.judge_outcome, NEW.superseded_by,
     NEW.superseded_at, NEW.valid_from, NEW.valid_to, NEW.deleted_at, NEW.anonymized_at, NEW.role,
     NEW.tool_call_id, NEW.tool_name, NEW.token_count, NEW.token_counter, NEW.layer, NEW.category,
     NEW.importance, NEW.confidence, NEW.tags, NEW.origin, NEW.visibility, NEW.allowed_roles,
     NEW.fingerprint, NEW.faded_at))
EXECUTE FUNCTION memory_items_mark_changed();
