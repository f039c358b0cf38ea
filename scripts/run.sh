#!/usr/bin/env bash
# Sets everything up and runs mnemo on the local PostgreSQL with the local embedding model:
# installs and starts the database, fetches the model, builds, applies migrations, and runs the
# API server and a worker pool until ctrl-c. Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh

bash scripts/setup-postgres.sh
bash scripts/fetch-model.sh
log "building mnemo"
cargo build --bins --locked
bin=${CARGO_TARGET_DIR:-target}/debug
"$bin/mnemo-runbook" migrate

: "${MNEMO_LISTEN:=127.0.0.1:8080}"
: "${MNEMO_WORKER_LISTEN:=127.0.0.1:9464}"
export MNEMO_LISTEN MNEMO_WORKER_LISTEN

"$bin/mnemo-worker" &
worker=$!
"$bin/mnemo-server" &
server=$!
# Whatever stops first, or ctrl-c, stops both; each finishes its in-flight work on SIGTERM.
trap 'kill -TERM $server $worker 2>/dev/null; wait' INT TERM EXIT

cat >&2 <<INFO

  mnemo API:      http://$MNEMO_LISTEN
  worker metrics: http://$MNEMO_WORKER_LISTEN/metrics
  database:       $MNEMO_DATABASE_URL
  a token:        MNEMO_JWT_SECRET='$MNEMO_JWT_SECRET' $bin/mnemo-runbook token --tenant demo --user alice --session s1
  status:         $bin/mnemo-runbook status
  stop:           ctrl-c

INFO
wait -n
