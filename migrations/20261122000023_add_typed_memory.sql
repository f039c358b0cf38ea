-- Typed long-term memory: layer, category, importance, confidence, tags, origin, relations,
-- access control beyond the owner, and the signals recall ranks by (last access, decay).
--
-- Every new column has a constant default or none, so adding them rewrites no row, but the new
-- CHECK constraints scan the table once. The UPDATEs below rewrite agent facts and tenant rows
-- (document chunks: on a document-heavy database, most of the table) to give them the visibility
-- their class already had, and daily notes to make them episodic; conversation rows keep the
-- default layer, which nothing reads for them (packs put them in working memory).

ALTER TABLE memory_items
    ADD COLUMN layer text NOT NULL DEFAULT 'semantic'
        CONSTRAINT memory_items_layer CHECK (layer IN ('episodic', 'semantic', 'procedural')),
    ADD COLUMN category text
        CONSTRAINT memory_items_category
        CHECK (category IN ('preference', 'fact', 'goal', 'skill', 'event', 'constraint')),
    ADD COLUMN importance real CONSTRAINT memory_items_importance CHECK (importance BETWEEN 0 AND 1),
    ADD COLUMN confidence real CONSTRAINT memory_items_confidence CHECK (confidence BETWEEN 0 AND 1),
    ADD COLUMN tags text[] NOT NULL DEFAULT '{}' CONSTRAINT memory_items_tags CHECK (cardinality(tags) <= 16),
    ADD COLUMN origin text
        CONSTRAINT memory_items_origin CHECK (origin IN ('user', 'extraction', 'consolidation', 'api')),
    -- Who besides the row's owner may read it (see README, "Access control").
    ADD COLUMN visibility text NOT NULL DEFAULT 'private'
        CONSTRAINT memory_items_visibility CHECK (visibility IN ('private', 'agent', 'tenant')),
    -- Empty: any token that may see the row; otherwise only a token holding one of these roles.
    ADD COLUMN allowed_roles text[] NOT NULL DEFAULT '{}'
        CONSTRAINT memory_items_allowed_roles CHECK (cardinality(allowed_roles) <= 8),
    -- Set by the access job from recall, never by the recall statement itself.
    ADD COLUMN last_accessed_at timestamptz,
    ADD COLUMN access_count integer NOT NULL DEFAULT 0,
    -- sha256 (16 bytes, hex) of the content's words, lowercased: promotion's "the same memory".
    ADD COLUMN fingerprint text,
    -- Set by the decay job when an episodic row's decay fell below the floor: no longer packed,
    -- still recalled by an explicit query.
    ADD COLUMN faded_at timestamptz;

UPDATE memory_items SET visibility = 'agent' WHERE scope = 'agent';
UPDATE memory_items SET visibility = 'tenant' WHERE scope = 'tenant';
UPDATE memory_items SET layer = 'episodic'
WHERE source_kind = 'workspace_note' AND metadata ->> 'path' <> 'MEMORY.md';

-- Visibility only widens what a row's class already allows.
ALTER TABLE memory_items ADD CONSTRAINT memory_items_visibility_widens CHECK (
    (scope = 'session' AND visibility = 'private')
    OR scope = 'user'
    OR (scope = 'agent' AND visibility <> 'private')
    OR (scope = 'tenant' AND visibility = 'tenant')
);

-- Shared rows of an agent's users (visibility agent or tenant) are found through the agent.
CREATE INDEX memory_items_shared_idx ON memory_items (tenant_id, agent_id)
    WHERE visibility <> 'private' AND scope = 'user';

-- Promotion looks for the same fingerprint in one bucket.
CREATE INDEX memory_items_fingerprint_idx ON memory_items (tenant_id, fingerprint)
    WHERE layer = 'episodic' AND fingerprint IS NOT NULL;

-- Fading looks for episodic memories unused since a time, across tenants.
CREATE INDEX memory_items_fade_idx ON memory_items ((COALESCE(last_accessed_at, event_time)))
    WHERE layer = 'episodic' AND scope <> 'session' AND faded_at IS NULL
      AND deleted_at IS NULL AND anonymized_at IS NULL;

-- One memory pointing at another of the same tenant: the foreign keys carry the tenant, so a
-- relation can never cross tenants, and neither end can be missing.
CREATE TABLE memory_relations (
    tenant_id   text        NOT NULL,
    item_id     uuid        NOT NULL,
    relation    text        NOT NULL CHECK (relation IN ('related_to', 'derived_from')),
    target_id   uuid        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, item_id, relation, target_id),
    FOREIGN KEY (tenant_id, item_id) REFERENCES memory_items (tenant_id, id),
    FOREIGN KEY (tenant_id, target_id) REFERENCES memory_items (tenant_id, id),
    CHECK (item_id <> target_id)
);
CREATE INDEX memory_relations_target_idx ON memory_relations (tenant_id, target_id);

-- The sessions a memory was stated in: an episodic memory seen in two sessions is promoted.
CREATE TABLE memory_sightings (
    tenant_id   text        NOT NULL,
    item_id     uuid        NOT NULL,
    session_id  text        NOT NULL,
    -- Who stated it: an erasure of that user removes the sighting.
    user_id     text,
    seen_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, item_id, session_id),
    FOREIGN KEY (tenant_id, item_id) REFERENCES memory_items (tenant_id, id)
);

-- Access batches already applied: a retried access job counts nothing twice.
CREATE TABLE access_batches (
    tenant_id   text        NOT NULL,
    id          uuid        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, id)
);
CREATE INDEX access_batches_applied_idx ON access_batches (applied_at);

-- What each maintenance run promoted and faded.
ALTER TABLE maintenance_runs
    ADD COLUMN promoted bigint NOT NULL DEFAULT 0,
    ADD COLUMN faded bigint NOT NULL DEFAULT 0;
