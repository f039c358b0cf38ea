#!/usr/bin/env bash
# Sets everything up and runs mnemo on the local PostgreSQL with the local embedding model:
# installs and starts the database, fetches the model, builds, applies migrations, and runs the
# API server and a worker pool until ctrl-c. Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh

check_toolchain
# Both or neither: the API would otherwise serve the local database while the worker and the
# migrations use the one given.
if [ "$mnemo_database_given" != "$mnemo_app_database_given" ]; then
  die "set both MNEMO_DATABASE_URL (the tables' owner: migrations, the worker) and MNEMO_APP_DATABASE_URL (role $MNEMO_PG_APP_USER on the same database: the API, which row-level security holds; this script grants it), or neither"
fi
bash scripts/setup-postgres.sh
[ "${MNEMO_EMBED_PROVIDER:-local}" != local ] || bash scripts/fetch-model.sh
log "building mnemo"
cargo build --bins --locked
bin=${CARGO_TARGET_DIR:-target}/debug
"$bin/mnemo-runbook" migrate
# The role the server connects as: the user named in MNEMO_APP_DATABASE_URL, when it names one.
app_role=$MNEMO_PG_APP_USER
app_url=${MNEMO_APP_DATABASE_URL#*://}
case ${app_url%%/*} in *@*) app_role=${app_url%%[:@]*} ;; esac
"$bin/mnemo-runbook" grant-app-role "$app_role"

: "${MNEMO_LISTEN:=127.0.0.1:8080}"
: "${MNEMO_WORKER_LISTEN:=127.0.0.1:9464}"
export MNEMO_LISTEN MNEMO_WORKER_LISTEN

"$bin/mnemo-worker" &
worker=$!
# The API connects as its own role, which row-level security holds; the worker as the owner.
MNEMO_DATABASE_URL=$MNEMO_APP_DATABASE_URL "$bin/mnemo-server" &
server=$!
# Whatever stops first, or ctrl-c, stops both; each finishes its in-flight work on SIGTERM.
trap 'kill -TERM $server $worker 2>/dev/null; wait' INT TERM EXIT

cat >&2 <<INFO

  mnemo API:      http://$MNEMO_LISTEN
  worker metrics: http://$MNEMO_WORKER_LISTEN/metrics
  database:       $MNEMO_DATABASE_URL (the API as $MNEMO_PG_APP_USER)
  a token:        MNEMO_JWT_SECRET='$MNEMO_JWT_SECRET' $bin/mnemo-runbook token --tenant demo --user alice --session s1
  status:         $bin/mnemo-runbook status
  stop:           ctrl-c

INFO
wait -n
