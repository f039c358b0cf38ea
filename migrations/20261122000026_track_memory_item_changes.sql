-- When a row's state last changed, so `mnemo-runbook export --since` also carries rows retired,
-- superseded, anonymized, revived or faded after they were written, not only rows written since.
-- Rows already stored take the time of this migration: an export since an earlier time holds
-- them all, which is more than it needs and never less.
ALTER TABLE memory_items ADD COLUMN changed_at timestamptz NOT NULL DEFAULT now();

-- A trigger keeps it, so no statement can forget to. Bookkeeping is not a change of state: the
-- embed and judge queues' columns and access counts (the copy an import makes keeps its own),
-- and the generated full-text vector. Any other column, a future one included, is. An UPDATE
-- that sets the time itself (an import carrying its source's) keeps it.
CREATE FUNCTION memory_items_mark_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bookkeeping CONSTANT text[] := ARRAY['changed_at', 'tsv', 'embedded_model', 'embed_attempts', 'embed_error',
        'embed_enqueued_at', 'judge_enqueued_at', 'last_accessed_at', 'access_count'];
BEGIN
    IF NEW.changed_at IS NOT DISTINCT FROM OLD.changed_at
       AND to_jsonb(NEW) - bookkeeping IS DISTINCT FROM to_jsonb(OLD) - bookkeeping THEN
        NEW.changed_at := now();
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER memory_items_changed BEFORE UPDATE ON memory_items
    FOR EACH ROW EXECUTE FUNCTION memory_items_mark_changed();
