# Local defaults shared by the project's scripts. Sourced, never run.
# Every value can be overridden from the environment.
mnemo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
: "${MNEMO_PG_CLUSTER:=mnemo}"
: "${MNEMO_PG_PORT:=55432}"
: "${MNEMO_PG_SOCKET_DIR:=/var/run/postgresql}"
: "${MNEMO_PG_USER:=mnemo}"
: "${MNEMO_PG_PASSWORD:=mnemo}"
: "${MNEMO_PG_DB:=mnemo}"
# Whether the caller named the databases: scripts that run the API beside a worker need both.
mnemo_database_given=${MNEMO_DATABASE_URL:+yes}
mnemo_app_database_given=${MNEMO_APP_DATABASE_URL:+yes}
# A Unix socket: sqlx 0.9 no longer sets TCP_NODELAY, which costs ~40 ms per round trip over TCP.
: "${MNEMO_DATABASE_URL:=postgres://${MNEMO_PG_USER}:${MNEMO_PG_PASSWORD}@localhost:${MNEMO_PG_PORT}/${MNEMO_PG_DB}?host=${MNEMO_PG_SOCKET_DIR}}"
export MNEMO_DATABASE_URL
# The API's own role on the same database: not the tables' owner, so row-level security applies.
: "${MNEMO_PG_APP_USER:=mnemo_app}"
: "${MNEMO_PG_APP_PASSWORD:=mnemo_app}"
: "${MNEMO_APP_DATABASE_URL:=postgres://${MNEMO_PG_APP_USER}:${MNEMO_PG_APP_PASSWORD}@localhost:${MNEMO_PG_PORT}/${MNEMO_PG_DB}?host=${MNEMO_PG_SOCKET_DIR}}"
export MNEMO_APP_DATABASE_URL
# A streaming replica of that cluster (scripts/setup-replica.sh), for MNEMO_READ_DATABASE_URL.
: "${MNEMO_PG_REPLICA_CLUSTER:=mnemo_replica}"
: "${MNEMO_PG_REPLICA_PORT:=55433}"
: "${MNEMO_REPLICA_DATABASE_URL:=postgres://${MNEMO_PG_USER}:${MNEMO_PG_PASSWORD}@localhost:${MNEMO_PG_REPLICA_PORT}/${MNEMO_PG_DB}?host=${MNEMO_PG_SOCKET_DIR}}"
export MNEMO_REPLICA_DATABASE_URL
: "${MNEMO_LOCAL_MODEL_DIR:=$mnemo_root/models/${MNEMO_EMBED_MODEL:-all-MiniLM-L6-v2}}"
export MNEMO_LOCAL_MODEL_DIR
# A development secret only; production sets its own (see README).
: "${MNEMO_JWT_SECRET:=mnemo-local-development-secret-change-me}"
export MNEMO_JWT_SECRET

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# The toolchain the build needs: cargo at the workspace's rust-version, and a C compiler and
# linker (Debian's build-essential, installed when missing). Rust itself comes from the machine
# (rustup or the image): no script downloads it.
check_toolchain() {
  local wanted have
  wanted=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' "$mnemo_root/Cargo.toml")
  command -v cargo >/dev/null || die "cargo is not installed: mnemo needs Rust $wanted or later (rustup)"
  have=$(cargo --version | awk '{print $2}')
  [ "$(printf '%s\n%s\n' "$wanted" "$have" | sort -V | head -1)" = "$wanted" ] ||
    die "cargo $have is older than the Rust $wanted mnemo needs (rustup update)"
  if ! command -v cc >/dev/null; then
    . "$mnemo_root/scripts/debian.sh"
    log "installing a C compiler and linker (build-essential)"
    apt_install build-essential
  fi
}
