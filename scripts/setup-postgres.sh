#!/usr/bin/env bash
# Installs PostgreSQL with pgvector, hstore and rum from the OS packages, creates mnemo's own
# cluster (own data directory, own port), its role and database, and starts it.
# Idempotent: a second run changes nothing; a stopped server is started again.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=env.sh
. "$here/env.sh"

# shellcheck source=debian.sh
. "$here/debian.sh"
as_postgres() { as_root runuser -u postgres -- "$@"; }

# --- server -----------------------------------------------------------------------------------
if ! installed postgresql || ! installed postgresql-contrib; then
  log "installing PostgreSQL from the OS packages"
  apt_install postgresql postgresql-contrib
fi
pg_major=$(ls /usr/lib/postgresql | sort -n | tail -1)
ext_dir=/usr/share/postgresql/$pg_major/extension

# rum gives OR-semantics full text a fast ranked scan (recall's full-text index, migration 010,
# needs it: without it `migrate` would stop there).
if [ ! -f "$ext_dir/rum.control" ]; then
  log "installing rum for PostgreSQL $pg_major"
  apt_install "postgresql-$pg_major-rum" || die "no postgresql-$pg_major-rum package: mnemo's full-text index needs the rum extension"
fi

# --- pgvector ---------------------------------------------------------------------------------
# Debian 12 ships no pgvector binary: build-pgvector.sh builds the newer suites' source package.
if [ ! -f "$ext_dir/vector.control" ]; then
  if apt-cache show "postgresql-$pg_major-pgvector" >/dev/null 2>&1 ||
    { as_root apt-get update -qq && apt_updated=1 && apt-cache show "postgresql-$pg_major-pgvector" >/dev/null 2>&1; }; then
    log "installing pgvector from the OS packages"
    apt_install "postgresql-$pg_major-pgvector"
  else
    bash "$here/build-pgvector.sh" "$pg_major"
  fi
fi
[ -f "$ext_dir/vector.control" ] || die "pgvector is not installed for PostgreSQL $pg_major"

# --- mnemo's cluster --------------------------------------------------------------------------
exists() { pg_lsclusters -h | awk -v c="$MNEMO_PG_CLUSTER" '$2 == c { found = 1 } END { exit !found }'; }
online() { pg_lsclusters -h | awk -v c="$MNEMO_PG_CLUSTER" '$2 == c && $4 == "online" { found = 1 } END { exit !found }'; }
if ! exists; then
  log "creating cluster $pg_major/$MNEMO_PG_CLUSTER on port $MNEMO_PG_PORT"
  as_root pg_createcluster "$pg_major" "$MNEMO_PG_CLUSTER" --port "$MNEMO_PG_PORT" >/dev/null
fi
# The settings are written on every run, not only at creation: a first run cut off after
# pg_createcluster would otherwise leave Debian's defaults (peer authentication) for good.
# Shared buffers: a quarter of the memory, at most 1 GB.
conf=/etc/postgresql/$pg_major/$MNEMO_PG_CLUSTER
memory_mb=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
buffers_mb=$((memory_mb / 4 < 1024 ? memory_mb / 4 : 1024))
changed=0
# Writes stdin to $1 when it differs.
write_conf() {
  local text
  text=$(cat)
  if [ "$(as_root cat "$1" 2>/dev/null)" != "$text" ]; then
    printf '%s\n' "$text" | as_root tee "$1" >/dev/null
    changed=1
  fi
}
write_conf "$conf/conf.d/mnemo.conf" <<CONF
listen_addresses = '127.0.0.1'
unix_socket_directories = '$MNEMO_PG_SOCKET_DIR'
max_connections = 300
shared_buffers = ${buffers_mb}MB
maintenance_work_mem = ${buffers_mb}MB
work_mem = 16MB
max_parallel_maintenance_workers = 2
CONF
# The replication line is for scripts/setup-replica.sh (pg_basebackup as postgres).
write_conf "$conf/pg_hba.conf" <<'CONF'
# TYPE  DATABASE  USER      ADDRESS        METHOD
local   all       postgres                 peer
local   replication postgres               peer
local   all       all                      scram-sha-256
host    all       all       127.0.0.1/32   scram-sha-256
host    all       all       ::1/128        scram-sha-256
CONF
if [ "$changed" = 1 ] && online; then
  log "restarting cluster $pg_major/$MNEMO_PG_CLUSTER for its settings"
  as_root pg_ctlcluster "$pg_major" "$MNEMO_PG_CLUSTER" restart
fi

port=$(pg_lsclusters -h | awk -v c="$MNEMO_PG_CLUSTER" '$2 == c { print $3 }')
[ "$port" = "$MNEMO_PG_PORT" ] || die "cluster $MNEMO_PG_CLUSTER listens on $port, not MNEMO_PG_PORT=$MNEMO_PG_PORT"
if ! online; then
  log "starting cluster $pg_major/$MNEMO_PG_CLUSTER"
  as_root install -d -o postgres -g postgres -m 2775 "$MNEMO_PG_SOCKET_DIR"
  as_root pg_ctlcluster "$pg_major" "$MNEMO_PG_CLUSTER" start
fi

# --- role, database, extensions ---------------------------------------------------------------
psql_admin() { as_postgres psql -X -q -v ON_ERROR_STOP=1 -h "$MNEMO_PG_SOCKET_DIR" -p "$MNEMO_PG_PORT" "$@"; }
psql_admin -d postgres -tA >/dev/null <<SQL
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '$MNEMO_PG_USER') THEN
    CREATE ROLE "$MNEMO_PG_USER" LOGIN CREATEDB PASSWORD '$MNEMO_PG_PASSWORD';
  END IF;
  -- The API's role: it owns nothing and cannot bypass row-level security, so the tenant wall
  -- in the database holds for it (ARCHITECTURE.md, "Two roles"). Its grants are per database:
  -- mnemo-runbook grant-app-role.
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '$MNEMO_PG_APP_USER') THEN
    CREATE ROLE "$MNEMO_PG_APP_USER" LOGIN NOSUPERUSER NOBYPASSRLS PASSWORD '$MNEMO_PG_APP_PASSWORD';
  END IF;
  -- The owner may end the API role's sessions, as DROP DATABASE … WITH (FORCE) does when a
  -- passing test's database is dropped. (The reverse would open the walls: the API's role is
  -- never a member of the owner.)
  IF NOT pg_has_role('$MNEMO_PG_USER', '$MNEMO_PG_APP_USER', 'MEMBER') THEN
    GRANT "$MNEMO_PG_APP_USER" TO "$MNEMO_PG_USER";
  END IF;
END \$\$;
SQL
# Extensions need a superuser: put them in template1, so every database mnemo creates
# (its own, and one per test) has them before its migrations run.
for db in template1 postgres; do
  # Only "already exists" notices are quiet: a broken extension says why.
  psql_admin -d "$db" -c 'SET client_min_messages = warning; CREATE EXTENSION IF NOT EXISTS vector; CREATE EXTENSION IF NOT EXISTS hstore;'
  if [ -f "$ext_dir/rum.control" ]; then
    psql_admin -d "$db" -c 'SET client_min_messages = warning; CREATE EXTENSION IF NOT EXISTS rum;'
  fi
done
if [ "$(psql_admin -d postgres -tA -c "SELECT count(*) FROM pg_database WHERE datname = '$MNEMO_PG_DB'")" = 0 ]; then
  psql_admin -d postgres -c "CREATE DATABASE \"$MNEMO_PG_DB\" OWNER \"$MNEMO_PG_USER\""
fi
# Full-text matching marked leakproof (it has no side effects, and a row's content changes only
# its answer), so that row-level security lets keyword search use its index: otherwise the
# planner must check each row's tenant before matching, and scans the tenant's rows. Needs a
# superuser, as here; ARCHITECTURE.md, "Two roles".
for db in template1 "$MNEMO_PG_DB"; do
  psql_admin -d "$db" -c 'ALTER FUNCTION pg_catalog.ts_match_vq(tsvector, tsquery) LEAKPROOF'
done
vector_version=$(psql_admin -d "$MNEMO_PG_DB" -tA -c "SELECT extversion FROM pg_extension WHERE extname = 'vector'")
log "PostgreSQL $pg_major ($MNEMO_PG_CLUSTER) with pgvector $vector_version is up: $MNEMO_DATABASE_URL"
