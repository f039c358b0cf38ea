#!/usr/bin/env bash
# On the first start (an empty $PGDATA): a cluster whose role POSTGRES_USER owns the database
# POSTGRES_DB, with the extensions in template1 as setup-postgres.sh makes them on a host, so the
# role needs no superuser, and the API's role POSTGRES_APP_USER, held by row-level security. Then
# PostgreSQL in the foreground, reachable over the network by password.
# The set-up is idempotent and marked done only at its end: a first start killed midway (a
# `docker stop` during initialisation) finishes it on the next start.
set -euo pipefail
: "${POSTGRES_USER:?}" "${POSTGRES_PASSWORD:?}" "${POSTGRES_DB:=$POSTGRES_USER}"
: "${POSTGRES_APP_USER:?}" "${POSTGRES_APP_PASSWORD:?}"
done_mark=$PGDATA/.mnemo-set-up
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  initdb -D "$PGDATA" -U postgres --encoding=UTF8 --locale=C.UTF-8 --auth-local=peer --auth-host=scram-sha-256 >/dev/null
fi
if [ ! -f "$done_mark" ]; then
  grep -q "^listen_addresses = '\*'" "$PGDATA/postgresql.conf" || echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
  grep -q '^host all all 0.0.0.0/0 scram-sha-256' "$PGDATA/pg_hba.conf" ||
    printf 'host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n' >>"$PGDATA/pg_hba.conf"
  # A private socket and no TCP while setting up, so the health check (and mnemo) wait for the
  # real start.
  init_socket=$(mktemp -d)
  pg_ctl -D "$PGDATA" -w -o "-c listen_addresses='' -k $init_socket" start >/dev/null
  psql -X -q -v ON_ERROR_STOP=1 -h "$init_socket" -U postgres -d postgres \
    -v user="$POSTGRES_USER" -v password="$POSTGRES_PASSWORD" -v db="$POSTGRES_DB" \
    -v app_user="$POSTGRES_APP_USER" -v app_password="$POSTGRES_APP_PASSWORD" <<'SQL'
\connect template1
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS vector;
CREATE EXTENSION IF NOT EXISTS hstore;
CREATE EXTENSION IF NOT EXISTS rum;
-- As setup-postgres.sh says: so that keyword search keeps its index under row-level security.
ALTER FUNCTION pg_catalog.ts_match_vq(tsvector, tsquery) LEAKPROOF;
\connect postgres
SELECT format('CREATE ROLE %I LOGIN CREATEDB PASSWORD %L', :'user', :'password')
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'user') \gexec
SELECT format('CREATE ROLE %I LOGIN NOSUPERUSER NOBYPASSRLS PASSWORD %L', :'app_user', :'app_password')
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'app_user') \gexec
SELECT format('CREATE DATABASE %I OWNER %I', :'db', :'user')
WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = :'db') \gexec
SQL
  pg_ctl -D "$PGDATA" -w -m fast stop >/dev/null
  rmdir "$init_socket"
  touch "$done_mark"
fi
exec postgres -D "$PGDATA"
