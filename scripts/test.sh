#!/usr/bin/env bash
# The whole test suite: sets up the local PostgreSQL if needed, checks formatting and lints,
# checks the dependencies against the advisory database and the licence policy, builds the binaries the end-to-end tests start, and runs every test. Exits non-zero on any
# failure. Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite runs on the default local model, whichever one this shell names.
unset MNEMO_EMBED_PROVIDER MNEMO_EMBED_MODEL MNEMO_LOCAL_MODEL_DIR
. scripts/env.sh

check_toolchain
bash scripts/setup-postgres.sh
bash scripts/setup-replica.sh
bash scripts/fetch-model.sh
MNEMO_TEST_PYTHON=$(bash scripts/setup-python.sh)
export MNEMO_TEST_PYTHON

log "dropping test databases left by earlier runs"
psql -X -q -d "$MNEMO_DATABASE_URL" -tA -c \
  "SELECT datname FROM pg_database WHERE datname LIKE 'mnemo\_test\_%'" |
  while read -r db; do
    # An autovacuum worker on it cannot be stopped by mnemo's role: leave it for the next run.
    psql -X -q -d "$MNEMO_DATABASE_URL" -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" 2>/dev/null ||
      echo "    $db is busy; it will be dropped next run"
  done

log "cargo fmt --check"
cargo fmt --all --check
log "cargo clippy -- -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
log "supply chain: advisories, licences, sources (deny.toml)"
bash scripts/supply-chain.sh
log "building binaries for the end-to-end tests"
cargo build --workspace --bins --locked
log "running tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast "$@"
else
  cargo test --workspace --locked --no-fail-fast "$@"
fi
