-- Recall joins a bounded set of rows (a session's newest 1,000, a small tenant class, a user's
-- facts) to their vectors. At PostgreSQL's default random_page_cost (4, a spinning disk's) the
-- planner priced 1,000 key lookups above a sequential scan of the whole vector table until that
-- table held about 45,000 rows, so below that size every recall hashed every vector of every
-- tenant: a soak's recall p99 grew from 21 to 62 ms in its first five minutes (7,000 rows), and
-- the same statement ran in 13-35 ms against 7-12 ms with lookups. The tables and their indexes
-- are read from memory or SSD, which 1.1 prices (the usual setting for SSD); by the planner's
-- arithmetic a sequential scan then wins only below about 12,000 rows, where it is cheap anyway.
-- Per database, like the HNSW settings of migration 010; an operator may set it again for their
-- storage.
DO $$
BEGIN
    EXECUTE format('ALTER DATABASE %I SET random_page_cost = 1.1', current_database());
END
$$;
