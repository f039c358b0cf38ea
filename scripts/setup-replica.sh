#!/usr/bin/env bash
# A streaming replica of mnemo's cluster (scripts/setup-postgres.sh) on the same machine: its own
# cluster and port, made by pg_basebackup and kept current through a physical replication slot.
# Recall reads from it when MNEMO_READ_DATABASE_URL names it; tests/replica.rs uses it.
# Idempotent: a streaming replica is left alone, a stopped one started, a broken one (its slot
# lost, or no longer streaming) made again.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=env.sh
. "$here/env.sh"

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
as_postgres() { as_root runuser -u postgres -- "$@"; }

pg_major=$(pg_lsclusters -h | awk -v c="$MNEMO_PG_CLUSTER" '$2 == c { print $1 }')
[ -n "$pg_major" ] || die "no cluster $MNEMO_PG_CLUSTER: run scripts/setup-postgres.sh first"
pg_bin=/usr/lib/postgresql/$pg_major/bin
primary_conf=/etc/postgresql/$pg_major/$MNEMO_PG_CLUSTER
replica_conf=/etc/postgresql/$pg_major/$MNEMO_PG_REPLICA_CLUSTER
replica_data=/var/lib/postgresql/$pg_major/$MNEMO_PG_REPLICA_CLUSTER
slot=$MNEMO_PG_REPLICA_CLUSTER
primary_sql() { as_postgres psql -X -q -tA -v ON_ERROR_STOP=1 -h "$MNEMO_PG_SOCKET_DIR" -p "$MNEMO_PG_PORT" -d postgres -c "$1"; }

# --- the primary allows it ----------------------------------------------------------------------
reload=0
grep -Eq '^local[[:space:]]+replication[[:space:]]+postgres' "$primary_conf/pg_hba.conf" ||
  die "$primary_conf/pg_hba.conf does not let postgres replicate: run scripts/setup-postgres.sh"
if [ ! -f "$primary_conf/conf.d/replication.conf" ]; then
  # A stopped replica's slot keeps WAL on the primary; past this much the slot is given up and
  # the next run of this script makes the replica again.
  echo "max_slot_wal_keep_size = 2GB" | as_root tee "$primary_conf/conf.d/replication.conf" >/dev/null
  reload=1
fi
[ "$reload" = 0 ] || as_root pg_ctlcluster "$pg_major" "$MNEMO_PG_CLUSTER" reload
# tests/replica.rs makes the replica fall behind by pausing its replay; the grant sits in
# template1, so only the databases made from it afterwards (the tests' own) carry it.
as_postgres psql -X -q -v ON_ERROR_STOP=1 -h "$MNEMO_PG_SOCKET_DIR" -p "$MNEMO_PG_PORT" -d template1 -c \
  "GRANT EXECUTE ON FUNCTION pg_wal_replay_pause(), pg_wal_replay_resume() TO \"$MNEMO_PG_USER\""

streaming() { [ "$(primary_sql "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '$slot' AND active")" = 1 ]; }
slot_state() { primary_sql "SELECT coalesce((SELECT wal_status FROM pg_replication_slots WHERE slot_name = '$slot'), 'none')"; }
exists() { pg_lsclusters -h | awk -v c="$MNEMO_PG_REPLICA_CLUSTER" '$2 == c { found = 1 } END { exit !found }'; }
online() { pg_lsclusters -h | awk -v c="$MNEMO_PG_REPLICA_CLUSTER" '$2 == c && $4 ~ /online/ { found = 1 } END { exit !found }'; }
wait_streaming() {
  for _ in $(seq 60); do streaming && return 0; sleep 0.5; done
  return 1
}

create() {
  log "making replica $pg_major/$MNEMO_PG_REPLICA_CLUSTER on port $MNEMO_PG_REPLICA_PORT (pg_basebackup)"
  if exists; then as_root pg_dropcluster --stop "$pg_major" "$MNEMO_PG_REPLICA_CLUSTER"; fi
  primary_sql "SELECT pg_drop_replication_slot('$slot') FROM pg_replication_slots WHERE slot_name = '$slot' AND NOT active" >/dev/null
  as_root pg_createcluster "$pg_major" "$MNEMO_PG_REPLICA_CLUSTER" --port "$MNEMO_PG_REPLICA_PORT" >/dev/null
  as_root rm -rf "$replica_data"
  as_root install -d -o postgres -g postgres -m 700 "$replica_data"
  as_postgres "$pg_bin/pg_basebackup" -h "$MNEMO_PG_SOCKET_DIR" -p "$MNEMO_PG_PORT" -U postgres -D "$replica_data" \
    --write-recovery-conf --create-slot --slot "$slot" --wal-method stream --checkpoint fast
  as_root cp "$primary_conf/pg_hba.conf" "$replica_conf/pg_hba.conf"
  # The primary's settings (a standby needs max_connections at least the primary's), with less
  # memory; feedback keeps the primary from vacuuming rows a long read here still sees.
  as_root cp "$primary_conf/conf.d/mnemo.conf" "$replica_conf/conf.d/mnemo.conf"
  as_root tee "$replica_conf/conf.d/replica.conf" >/dev/null <<CONF
shared_buffers = 256MB
hot_standby_feedback = on
CONF
  as_root pg_ctlcluster "$pg_major" "$MNEMO_PG_REPLICA_CLUSTER" start
}

if ! exists || [ "$(slot_state)" = lost ] || [ "$(slot_state)" = none ]; then
  create
elif ! online; then
  log "starting replica $pg_major/$MNEMO_PG_REPLICA_CLUSTER"
  as_root install -d -o postgres -g postgres -m 2775 "$MNEMO_PG_SOCKET_DIR"
  # A cluster left half made (an interrupted base backup) does not start: made again below.
  as_root pg_ctlcluster "$pg_major" "$MNEMO_PG_REPLICA_CLUSTER" start || log "the replica does not start"
fi
if ! wait_streaming; then
  log "the replica does not stream; making it again"
  create
  wait_streaming || die "replica $MNEMO_PG_REPLICA_CLUSTER does not stream from $MNEMO_PG_CLUSTER (see /var/log/postgresql)"
fi
log "replica $pg_major/$MNEMO_PG_REPLICA_CLUSTER streams from $MNEMO_PG_CLUSTER: $MNEMO_REPLICA_DATABASE_URL"
