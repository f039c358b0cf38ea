-- A conversation's rows (chat messages, tool outputs) carry who said them, the tool call they make
-- or answer, and their token count, made once at write time so that assembling a context window
-- never tokenizes history again. Nullable: other kinds have none, and rows written before this
-- migration read as a user message (chat) or a tool result (tool output) with no count.
ALTER TABLE memory_items
    ADD COLUMN role text CHECK (role IN ('user', 'assistant', 'tool', 'system')),
    ADD COLUMN tool_call_id text,
    ADD COLUMN tool_name text,
    ADD COLUMN token_count integer CHECK (token_count >= 0),
    -- The tokenizer that made token_count: a count by another one is made again when read.
    ADD COLUMN token_counter text;
