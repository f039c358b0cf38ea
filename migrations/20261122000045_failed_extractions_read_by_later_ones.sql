-- A conversation whose extraction failed for good is now where the next one of its session
-- starts reading, and an operator's request asks for it again, for its own messages. Before,
-- the next conversation read across it: one followed by a done one of the same session and
-- (agent, user) had its messages read (in part) already, and asking for it again would show them
-- twice. It is marked done.
UPDATE memory_extractions f
SET status = 'done', reason = 'read_by_later', finished_at = COALESCE(f.finished_at, now())
WHERE f.status = 'failed'
  AND EXISTS (SELECT 1 FROM memory_extractions d
              WHERE d.tenant_id = f.tenant_id AND d.session_id = f.session_id AND d.agent_id = f.agent_id
                AND d.user_id = f.user_id AND d.status = 'done'
                AND (d.through_time, d.through_id) > (f.through_time, f.through_id));
