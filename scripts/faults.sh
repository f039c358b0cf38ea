#!/usr/bin/env bash
# The fault suite (docs/benchmarks.md, "Faults"), about 24 minutes: each fault injected again and
# again under a steady write and recall load, then the checks (mnemo-bench faults). Restarting
# PostgreSQL runs pg_ctlcluster on the project's cluster, as root (or through sudo).
# Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
bash scripts/setup-postgres.sh
cargo build --release --locked -p mnemo-bench -p mnemo-runbook -p mnemo-worker -p mnemo-server
bench="${CARGO_TARGET_DIR:-target}/release/mnemo-bench"

log "fault: kill -9 of the worker, 50 times"
"$bench" faults --fault worker-kill --kills 50 --every 3

pg_version=$(pg_lsclusters -h | awk -v c="$MNEMO_PG_CLUSTER" '$2 == c { print $1 }')
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
for mode in fast immediate; do
  log "fault: PostgreSQL restarted ($mode shutdown), 3 times"
  "$bench" faults --fault postgres-restart --kills 3 --every 10 \
    --restart-command "$sudo pg_ctlcluster $pg_version $MNEMO_PG_CLUSTER restart -m $mode"
done

log "fault: the embedding endpoint failing, hanging, answering garbage, 60 s each"
"$bench" faults --fault embedder-outage --kills 4 --every 3 --outage 60

log "fault: the judge's chat endpoint failing, hanging, answering garbage, 60 s each"
"$bench" faults --fault chat-outage --kills 4 --every 3 --outage 60

# A full disk: a throwaway cluster of its own (a replica of the main one would replay the
# tablespace into the same directory), with a tablespace on a small tmpfs that a ballast file
# fills. Removed afterwards, also on failure.
small_cluster=mnemo_faults
small_port=${MNEMO_FAULTS_PG_PORT:-55434}
remove_small_disk() {
  if pg_lsclusters -h | awk -v c="$small_cluster" '$2 == c { found = 1 } END { exit !found }'; then
    $sudo pg_dropcluster --stop "$pg_version" "$small_cluster"
  fi
  if mountpoint -q "$small_disk"; then $sudo umount "$small_disk"; fi
  rmdir "$small_disk"
}
if pg_lsclusters -h | awk -v c="$small_cluster" '$2 == c { found = 1 } END { exit !found }'; then
  $sudo pg_dropcluster --stop "$pg_version" "$small_cluster" # left by an interrupted run
fi
# Outside the checkout: PostgreSQL must be able to walk to it, and a home directory may be 0700.
small_disk=$(mktemp -d -t mnemo-faults.XXXXXX)
trap remove_small_disk EXIT
$sudo mount -t tmpfs -o "size=256m,mode=0755,uid=$(id -u),gid=$(id -g)" mnemo-small-disk "$small_disk"
$sudo install -d -o postgres -g postgres -m 0700 "$small_disk/pg"
install -d "$small_disk/ballast"
small_url="postgres://${MNEMO_PG_USER}:${MNEMO_PG_PASSWORD}@localhost:${small_port}/${MNEMO_PG_DB}?host=${MNEMO_PG_SOCKET_DIR}"
MNEMO_PG_CLUSTER=$small_cluster MNEMO_PG_PORT=$small_port MNEMO_DATABASE_URL=$small_url bash scripts/setup-postgres.sh
$sudo runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -h "$MNEMO_PG_SOCKET_DIR" -p "$small_port" -d postgres \
  -c "CREATE TABLESPACE mnemo_faults LOCATION '$small_disk/pg'" -c "GRANT CREATE ON TABLESPACE mnemo_faults TO $MNEMO_PG_USER"
log "fault: the database's disk full for 30 s, 3 times"
MNEMO_DATABASE_URL=$small_url "$bench" faults --fault disk-full --kills 3 --every 10 --outage 30 \
  --tablespace mnemo_faults --ballast "$small_disk/ballast/fill"
