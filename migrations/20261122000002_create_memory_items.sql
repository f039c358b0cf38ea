-- One row per remembered thing. Every key and index leads with tenant_id, so the table can be
-- distributed by tenant without a redesign.
CREATE TABLE memory_items (
    id              uuid        PRIMARY KEY,
    tenant_id       text        NOT NULL,
    scope           text        NOT NULL CHECK (scope IN ('session', 'tenant', 'user', 'agent')),
    session_id      text,
    user_id         text,
    agent_id        text,
    source_kind     text        NOT NULL
        CHECK (source_kind IN ('chat_message', 'tool_output', 'document_chunk', 'fact', 'session_summary')),
    source_ref      text        NOT NULL,
    -- At most 16 KiB; longer tool outputs keep a preview here and the whole in tool_outputs.
    content         text        NOT NULL CHECK (octet_length(content) <= 16384),
    -- sha256 of everything the caller sent (for an elided tool output, the full payload): a
    -- retried write is recognised, a different payload under the same source_ref is refused.
    content_sha256  bytea       NOT NULL,
    tool_output_key text,
    metadata        jsonb       NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(metadata) = 'object'),
    event_time      timestamptz NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),

    -- fact state
    fact_key        text,
    judge_at        timestamptz,
    judge_outcome   text,
    superseded_by   uuid        REFERENCES memory_items (id),
    superseded_at   timestamptz,
    valid_from      timestamptz,
    valid_to        timestamptz,

    -- retention state
    deleted_at      timestamptz,
    anonymized_at   timestamptz,

    CONSTRAINT memory_items_source_key UNIQUE (tenant_id, source_kind, source_ref),
    CONSTRAINT memory_items_scope_identity CHECK (
        anonymized_at IS NOT NULL
        OR (scope = 'session' AND session_id IS NOT NULL)
        OR (scope = 'tenant' AND session_id IS NULL)
        OR (scope = 'user' AND user_id IS NOT NULL AND session_id IS NULL)
        OR (scope = 'agent' AND agent_id IS NOT NULL AND session_id IS NULL)
    ),
    CONSTRAINT memory_items_facts_only_have_fact_state CHECK (
        source_kind = 'fact' OR (fact_key IS NULL AND superseded_by IS NULL)
    )
);

CREATE INDEX memory_items_session_idx ON memory_items (tenant_id, session_id, event_time)
    WHERE scope = 'session';
CREATE INDEX memory_items_user_idx ON memory_items (tenant_id, user_id) WHERE user_id IS NOT NULL;
CREATE INDEX memory_items_agent_idx ON memory_items (tenant_id, agent_id) WHERE agent_id IS NOT NULL;
