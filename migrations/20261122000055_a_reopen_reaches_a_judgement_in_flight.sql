-- A judgement that sends newer facts to be judged again (an extracted fact is valid from when
-- it was said, often before facts already judged) counts one on each, pending ones too. A
-- judgement is applied only to a fact counted as when it was read, so one in flight while an
-- older fact was judged (it never saw that fact) is dropped, and the job queued with the reopen
-- judges the fact again. A new column with a constant default: no table rewrite.
ALTER TABLE memory_items ADD COLUMN IF NOT EXISTS judge_reopens integer NOT NULL DEFAULT 0;
