#!/usr/bin/env bash
# Sets everything up and runs mnemo on the local PostgreSQL: installs and starts the database,
# builds, applies migrations, and serves the API until ctrl-c. Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh

bash scripts/setup-postgres.sh
log "building mnemo"
cargo build --bins --locked
bin=${CARGO_TARGET_DIR:-target}/debug
"$bin/mnemo-runbook" migrate

: "${MNEMO_LISTEN:=127.0.0.1:8080}"
export MNEMO_LISTEN
cat >&2 <<INFO

  mnemo is starting on http://$MNEMO_LISTEN
  database: $MNEMO_DATABASE_URL
  a token:  MNEMO_JWT_SECRET='$MNEMO_JWT_SECRET' $bin/mnemo-runbook token --tenant demo --user alice --session s1
  stop:     ctrl-c

INFO
exec "$bin/mnemo-server"
