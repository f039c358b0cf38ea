#!/usr/bin/env bash
# The Python environment of the tests that use official third-party clients (the MCP client).
# Creates .mnemo/venv and installs tests/python-requirements.txt into it, through pip's own
# configuration. Idempotent: nothing is installed again while the requirements are unchanged.
# Prints the environment's python.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=env.sh
. "$here/env.sh"

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
venv=$mnemo_root/.mnemo/venv
requirements=$mnemo_root/tests/python-requirements.txt

if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  log "installing python3 and python3-venv from the OS packages"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null
fi
stamp=$venv/.requirements.sha256
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "creating the test Python environment in .mnemo/venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements" >&2
  echo "$want" >"$stamp"
fi
echo "$venv/bin/python"
