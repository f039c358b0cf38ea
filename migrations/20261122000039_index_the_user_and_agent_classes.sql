-- A user's and an agent's own rows (facts, workspace notes, pieces of their files), which recall
-- ranks exactly. memory_items_user_idx and memory_items_agent_idx also hold every chat message
-- and tool output of that user or agent (a session's rows carry both), so a user with 200,000
-- messages made each recall read all of them to find a few dozen facts (137-145 ms a class,
-- against 0.5-0.6 ms with these; docs/benchmarks.md). The agent class's shared rows have
-- memory_items_shared_idx. IF NOT EXISTS: a large database builds them first, CONCURRENTLY
-- (docs/runbook.md, "Upgrading a large database").
CREATE INDEX IF NOT EXISTS memory_items_user_class_idx ON memory_items (tenant_id, user_id) WHERE scope = 'user';
CREATE INDEX IF NOT EXISTS memory_items_agent_class_idx ON memory_items (tenant_id, agent_id) WHERE scope = 'agent';
