#!/usr/bin/env bash
# Supply-chain checks with cargo-deny and the policy in deny.toml: known vulnerabilities, and
# unmaintained or yanked crates, from the RustSec advisory database; licences; crate sources.
# A finding fails unless deny.toml explains it. Offline: the advisory database is the snapshot
# in MNEMO_ADVISORY_DB (by default ../shared/advisory-db, beside the project); without one the
# advisory check is skipped with a note and the others still run. cargo-deny is installed once,
# pinned, into .mnemo/tools. Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh

version=0.20.2
tools=.mnemo/tools
deny="$tools/bin/cargo-deny"
if [ ! -x "$deny" ] || [ "$("$deny" --version 2>/dev/null)" != "cargo-deny $version" ]; then
  log "installing cargo-deny $version (once; about 4 minutes on two cores)"
  cargo install --quiet --locked --version "$version" --root "$tools" cargo-deny
fi

# cargo-deny reads the crate graph from cargo metadata, which needs every target's manifests
# (fetched from the registry once); the checks themselves then run offline.
cargo metadata --format-version 1 --locked >.mnemo/metadata.json
run_deny() { "$deny" --offline --metadata-path .mnemo/metadata.json --color never "$@"; }

checks=(bans licenses sources)
snapshot=${MNEMO_ADVISORY_DB:-../shared/advisory-db}
if [ -d "$snapshot/crates" ]; then
  # cargo-deny opens each database as a git checkout in a folder of deny.toml's db-path named
  # after the database's URL: ask it which folder, and make the snapshot that checkout (again
  # whenever the snapshot changes).
  folder=$(run_deny -L debug check advisories 2>&1 |
    sed -n "s/.*Opening advisory database at '\(.*\)'.*/\1/p" | head -1 || true)
  [ -n "$folder" ] || die "cargo-deny did not say where it looks for the advisory database"
  stamp=$(cat "$snapshot/SNAPSHOT.md" 2>/dev/null | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$folder/.mnemo-snapshot" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$folder" && mkdir -p "$folder"
    cp -R "$snapshot/." "$folder/"
    git -C "$folder" init -q
    git -C "$folder" add -A
    git -C "$folder" -c user.name=mnemo -c user.email=mnemo@localhost commit -q -m "advisory snapshot"
    echo "$stamp" >"$folder/.mnemo-snapshot"
  fi
  log "advisories from $(grep -o 'committed [0-9-]*' "$snapshot/SNAPSHOT.md" 2>/dev/null || echo "the snapshot in $snapshot")"
  checks+=(advisories)
else
  log "no advisory database snapshot in $snapshot (set MNEMO_ADVISORY_DB): advisories not checked"
fi
log "cargo deny check ${checks[*]}"
run_deny check "${checks[@]}"
