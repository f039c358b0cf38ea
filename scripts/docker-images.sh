#!/usr/bin/env bash
# The images docker-compose.yml runs, for a machine that cannot pull from a public image
# registry but has a Debian archive. Installs Docker's engine from the OS packages if there is
# none (and starts dockerd when none answers), then builds
#   $MNEMO_BASE_IMAGE      Debian, debootstrapped from the archive apt is configured with; built
#                          once and kept (docker rmi it to build it again)
#   $MNEMO_POSTGRES_IMAGE  docker/postgres.Dockerfile on that base
#   $MNEMO_IMAGE           docker/runtime.Dockerfile on that base: the release binaries built
#                          here with cargo (honours CARGO_TARGET_DIR) and the local model
# Idempotent: when nothing changed, the builds come from Docker's cache.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=env.sh
. "$here/env.sh"
# shellcheck source=debian.sh
. "$here/debian.sh"
cd "$mnemo_root"

codename=$(debian_codename)
: "${MNEMO_BASE_IMAGE:=mnemo-base:$codename}"
: "${MNEMO_POSTGRES_IMAGE:=mnemo-postgres}"
: "${MNEMO_IMAGE:=mnemo}"

# --- engine -----------------------------------------------------------------------------------
if ! as_root docker info >/dev/null 2>&1; then
  if ! command -v dockerd >/dev/null; then
    log "installing Docker's engine (docker.io) from the OS packages"
    apt_install docker.io
  fi
  # No init system starts it here: run it in the background, logging under .mnemo/.
  mkdir -p .mnemo
  log "starting dockerd (log: .mnemo/dockerd.log)"
  as_root setsid nohup dockerd >>.mnemo/dockerd.log 2>&1 </dev/null &
  for _ in $(seq 60); do as_root docker info >/dev/null 2>&1 && break; sleep 1; done
  as_root docker info >/dev/null 2>&1 || die "dockerd did not start; see .mnemo/dockerd.log"
fi

# Builds tag $1 from Dockerfile $2 and context $3, then removes the image the tag named before
# (and with it the layers only it used).
build() {
  local tag=$1 dockerfile=$2 context=$3 old
  old=$(as_root docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
  log "building $tag"
  as_root docker build -q -f "$dockerfile" --build-arg BASE_IMAGE="$MNEMO_BASE_IMAGE" -t "$tag" "$context" >/dev/null
  if [ -n "$old" ] && [ "$old" != "$(as_root docker image inspect -f '{{.Id}}' "$tag")" ]; then
    as_root docker rmi "$old" >/dev/null 2>&1 || true
  fi
}

# --- base -------------------------------------------------------------------------------------
if ! as_root docker image inspect "$MNEMO_BASE_IMAGE" >/dev/null 2>&1; then
  installed debootstrap || apt_install debootstrap
  mirror=$(debian_archive_uris "$codename" | awk -F'\t' 'NR == 1 { split($1, u, " "); print u[1] }')
  [ -n "$mirror" ] || die "could not derive a Debian archive for $codename from apt's configuration"
  log "debootstrapping $codename from $mirror into $MNEMO_BASE_IMAGE (about a minute)"
  rootfs=$(mktemp -d -t mnemo-base.XXXXXX)
  trap 'as_root rm -rf "$rootfs"' EXIT
  as_root debootstrap --variant=minbase "$codename" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 ||
    { tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; die "debootstrap failed"; }
  rm -f "$rootfs.log"
  # The host's name and resolver stay behind: Docker gives each container its own.
  as_root rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs/etc/hostname" "$rootfs/etc/resolv.conf"
  as_root tar -C "$rootfs" -c . | as_root docker import --change 'CMD ["bash"]' - "$MNEMO_BASE_IMAGE" >/dev/null
  as_root rm -rf "$rootfs"
  trap - EXIT
fi

# --- postgres ---------------------------------------------------------------------------------
build "$MNEMO_POSTGRES_IMAGE" docker/postgres.Dockerfile .

# --- mnemo ------------------------------------------------------------------------------------
bash scripts/fetch-model.sh
log "building the release binaries"
cargo build --release --locked -p mnemo-server -p mnemo-worker -p mnemo-runbook
bin=${CARGO_TARGET_DIR:-target}/release
# A context of only what the image gets (hard links where the filesystem allows).
mkdir -p .mnemo
context=$(mktemp -d -p .mnemo docker-context.XXXXXX)
trap 'rm -rf "$context"' EXIT
for b in mnemo-server mnemo-worker mnemo-runbook; do
  cp -l "$bin/$b" "$context/" 2>/dev/null || cp "$bin/$b" "$context/"
done
mkdir "$context/models"
cp -r "$MNEMO_LOCAL_MODEL_DIR" "$context/models/all-MiniLM-L6-v2"
build "$MNEMO_IMAGE" docker/runtime.Dockerfile "$context"
