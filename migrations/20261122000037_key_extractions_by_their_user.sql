-- A completed conversation is asked for once per (agent, user): two users of one session who each
-- complete it at the same last message each get their extraction (keyed by the session and last
-- message alone, the second was dropped as already asked).
ALTER TABLE memory_extractions DROP CONSTRAINT memory_extractions_pkey;
ALTER TABLE memory_extractions ADD PRIMARY KEY (tenant_id, session_id, through_id, agent_id, user_id);
