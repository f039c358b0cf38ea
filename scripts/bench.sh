#!/usr/bin/env bash
# Runs a mnemo-bench scenario on the local PostgreSQL with an optimised build:
#   scripts/bench.sh writes [--concurrency 1,4,16,64] [--seconds 5] [--rounds 3] [--json]
# Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
bash scripts/setup-postgres.sh
cargo build --release --locked -p mnemo-bench -p mnemo-runbook -p mnemo-worker -p mnemo-server
exec "${CARGO_TARGET_DIR:-target}/release/mnemo-bench" "$@"
