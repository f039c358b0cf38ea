#!/usr/bin/env bash
# The fault suite (docs/benchmarks.md, "Faults"), about 21 minutes: each fault injected again and
# again under a steady write and recall load, then the checks (mnemo-bench faults). Restarting
# PostgreSQL runs pg_ctlcluster on the project's cluster, as root (or through sudo).
# Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
bash scripts/setup-postgres.sh
cargo build --release --locked -p mnemo-bench -p mnemo-runbook -p mnemo-worker
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
