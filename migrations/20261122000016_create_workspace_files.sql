-- An agent's workspace files: per tenant and agent, and per user for files about a user
-- (PROFILE.md, MEMORY.md, memory/…; user_id is '' for the agent's own files). The current state
-- of each file is a row here; every state it ever had, the current one included, is a row of
-- workspace_file_versions, so any change can be seen and undone. Deleting is soft.
CREATE TABLE workspace_files (
    tenant_id  text        NOT NULL,
    agent_id   text        NOT NULL,
    user_id    text        NOT NULL DEFAULT '',
    path       text        NOT NULL,
    id         uuid        NOT NULL,
    content    text        NOT NULL,
    size_bytes integer     NOT NULL CHECK (size_bytes >= 0),
    enabled    boolean     NOT NULL,
    sort_order integer     NOT NULL,
    version    integer     NOT NULL CHECK (version > 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    deleted_at timestamptz,
    PRIMARY KEY (tenant_id, agent_id, user_id, path)
);

CREATE TABLE workspace_file_versions (
    tenant_id  text        NOT NULL,
    agent_id   text        NOT NULL,
    user_id    text        NOT NULL,
    path       text        NOT NULL,
    version    integer     NOT NULL,
    content    text        NOT NULL,
    enabled    boolean     NOT NULL,
    sort_order integer     NOT NULL,
    deleted    boolean     NOT NULL,
    -- api, extraction, consolidation, maintenance or runbook.
    actor      text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, agent_id, user_id, path, version),
    FOREIGN KEY (tenant_id, agent_id, user_id, path) REFERENCES workspace_files (tenant_id, agent_id, user_id, path)
);
