-- apalis' migrations leave two pairs of identical indexes on its jobs table: every embed job
-- written with a memory paid for both. One of each pair stays.
DROP INDEX IF EXISTS apalis.lidx;
DROP INDEX IF EXISTS apalis.unique_job_id;
