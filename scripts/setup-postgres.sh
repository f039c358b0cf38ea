#!/usr/bin/env bash
# Installs PostgreSQL with pgvector, hstore and rum from the OS packages, creates mnemo's own
# cluster (own data directory, own port), its role and database, and starts it.
# Idempotent: a second run changes nothing; a stopped server is started again.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=env.sh
. "$here/env.sh"

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
as_postgres() { as_root runuser -u postgres -- "$@"; }

apt_updated=0
apt_install() {
  if [ "$apt_updated" -eq 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

# --- server -----------------------------------------------------------------------------------
if ! installed postgresql || ! installed postgresql-contrib; then
  log "installing PostgreSQL from the OS packages"
  apt_install postgresql postgresql-contrib
fi
pg_major=$(ls /usr/lib/postgresql | sort -n | tail -1)
pg_bin=/usr/lib/postgresql/$pg_major/bin
ext_dir=/usr/share/postgresql/$pg_major/extension

# rum gives OR-semantics full text a fast ranked scan (used by recall).
if [ ! -f "$ext_dir/rum.control" ]; then
  log "installing rum for PostgreSQL $pg_major"
  apt_install "postgresql-$pg_major-rum" || log "no rum package in the archive; recall uses GIN only"
fi

# --- pgvector ---------------------------------------------------------------------------------
# Debian 12 ships no pgvector binary; newer suites ship its source package. Build that source
# against the installed server headers, with deb-src entries derived from apt's own configuration
# (the archive's URIs and keyring, the running release and the releases after it).
debian_archive_uris() {
  local codename=$1
  # deb822 .sources stanzas that carry the running release's main suite
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v cn="$codename" '
      BEGIN { RS=""; FS="\n" }
      {
        uris=""; suites=""; signed=""
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[ \t]*/, "", uris) }
          if ($i ~ /^Suites:/) { suites = " " $i " "; sub(/^Suites:/, "", suites) }
          if ($i ~ /^Signed-By:/) { signed = $i; sub(/^Signed-By:[ \t]*/, "", signed) }
        }
        if (index(suites, " " cn " ") > 0) print uris "\t" signed
      }' "$f"
  done
  # one-line sources.list entries for the running release
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
    awk -v cn="$codename" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) break;
      if ($(i + 1) == cn) print $i "\t/usr/share/keyrings/debian-archive-keyring.gpg" }'
}

build_pgvector_from_source() {
  local codename suites work lists srclist uris signed
  codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
  suites="$codename $codename-backports"
  if [ -f /usr/share/distro-info/debian.csv ]; then
    # releases after this one that exist already (created before today), oldest first, then sid
    suites="$suites $(awk -F, -v cn="$codename" -v today="$(date +%F)" '
      found && $3 != "experimental" && $4 <= today { printf "%s ", $3 }
      $3 == cn { found = 1 }' /usr/share/distro-info/debian.csv)"
  fi
  work=$(mktemp -d -t mnemo-pgvector.XXXXXX)
  lists=$work/lists; mkdir -p "$lists/partial"
  srclist=$work/sources.list
  : >"$srclist"
  while IFS=$'\t' read -r uris signed; do
    [ -n "$uris" ] || continue
    for uri in $uris; do
      for suite in $suites; do
        echo "deb-src [signed-by=${signed:-/usr/share/keyrings/debian-archive-keyring.gpg}] $uri $suite main" >>"$srclist"
      done
    done
  done < <(debian_archive_uris "$codename" | sort -u)
  [ -s "$srclist" ] || die "could not derive a Debian archive from apt's configuration; install pgvector by hand"
  log "building pgvector from the distribution's source package ($(wc -l <"$srclist") deb-src entries)"
  apt_install "postgresql-server-dev-$pg_major" dpkg-dev build-essential
  local aptopts=(-o "Dir::Etc::sourcelist=$srclist" -o "Dir::Etc::sourceparts=-" -o "Dir::State::Lists=$lists"
    -o "APT::Sandbox::User=root")
  # A suite the mirror lacks only costs a warning; showsrc below decides.
  as_root apt-get "${aptopts[@]}" update -qq || true
  # Newest first; a mirror may list a version whose files it does not carry, so try the next.
  local versions v fetched=0
  versions=$(apt-cache "${aptopts[@]}" showsrc pgvector 2>/dev/null | awk '/^Version:/ { print $2 }' | sort -Vru)
  [ -n "$versions" ] || die "no pgvector source package in $suites"
  for v in $versions; do
    if (cd "$work" && as_root apt-get "${aptopts[@]}" source -qq "pgvector=$v" >/dev/null 2>&1); then fetched=1; break; fi
    log "pgvector $v could not be fetched; trying an older version"
  done
  [ "$fetched" = 1 ] || die "no pgvector source package could be fetched (tried: $(echo $versions))"
  local src
  src=$(find "$work" -maxdepth 1 -type d -name 'pgvector-*' | head -1)
  [ -n "$src" ] || die "apt-get source pgvector produced no source tree"
  # OPTFLAGS="" keeps the build portable (no -march=native).
  as_root make -s -C "$src" PG_CONFIG="$pg_bin/pg_config" OPTFLAGS="" >/dev/null
  as_root make -s -C "$src" PG_CONFIG="$pg_bin/pg_config" install >/dev/null
  rm -rf "$work"
}

if [ ! -f "$ext_dir/vector.control" ]; then
  if apt-cache show "postgresql-$pg_major-pgvector" >/dev/null 2>&1 ||
    { as_root apt-get update -qq && apt_updated=1 && apt-cache show "postgresql-$pg_major-pgvector" >/dev/null 2>&1; }; then
    log "installing pgvector from the OS packages"
    apt_install "postgresql-$pg_major-pgvector"
  else
    build_pgvector_from_source
  fi
fi
[ -f "$ext_dir/vector.control" ] || die "pgvector is not installed for PostgreSQL $pg_major"

# --- mnemo's cluster --------------------------------------------------------------------------
if ! pg_lsclusters -h | awk -v c="$MNEMO_PG_CLUSTER" '$2 == c { found = 1 } END { exit !found }'; then
  log "creating cluster $pg_major/$MNEMO_PG_CLUSTER on port $MNEMO_PG_PORT"
  as_root pg_createcluster "$pg_major" "$MNEMO_PG_CLUSTER" --port "$MNEMO_PG_PORT" >/dev/null
  conf=/etc/postgresql/$pg_major/$MNEMO_PG_CLUSTER
  as_root tee "$conf/conf.d/mnemo.conf" >/dev/null <<EOF
listen_addresses = '127.0.0.1'
unix_socket_directories = '$MNEMO_PG_SOCKET_DIR'
max_connections = 300
shared_buffers = 1GB
maintenance_work_mem = 1GB
work_mem = 16MB
max_parallel_maintenance_workers = 2
EOF
  as_root tee "$conf/pg_hba.conf" >/dev/null <<'EOF'
# TYPE  DATABASE  USER      ADDRESS        METHOD
local   all       postgres                 peer
local   all       all                      scram-sha-256
host    all       all       127.0.0.1/32   scram-sha-256
host    all       all       ::1/128        scram-sha-256
EOF
fi

port=$(pg_lsclusters -h | awk -v c="$MNEMO_PG_CLUSTER" '$2 == c { print $3 }')
[ "$port" = "$MNEMO_PG_PORT" ] || die "cluster $MNEMO_PG_CLUSTER listens on $port, not MNEMO_PG_PORT=$MNEMO_PG_PORT"
if ! pg_lsclusters -h | awk -v c="$MNEMO_PG_CLUSTER" '$2 == c && $4 == "online" { found = 1 } END { exit !found }'; then
  log "starting cluster $pg_major/$MNEMO_PG_CLUSTER"
  as_root install -d -o postgres -g postgres -m 2775 "$MNEMO_PG_SOCKET_DIR"
  as_root pg_ctlcluster "$pg_major" "$MNEMO_PG_CLUSTER" start
fi

# --- role, database, extensions ---------------------------------------------------------------
psql_admin() { as_postgres psql -X -q -v ON_ERROR_STOP=1 -h "$MNEMO_PG_SOCKET_DIR" -p "$MNEMO_PG_PORT" "$@"; }
psql_admin -d postgres -tA >/dev/null <<SQL
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '$MNEMO_PG_USER') THEN
    CREATE ROLE "$MNEMO_PG_USER" LOGIN CREATEDB PASSWORD '$MNEMO_PG_PASSWORD';
  END IF;
END \$\$;
SQL
# Extensions need a superuser: put them in template1, so every database mnemo creates
# (its own, and one per test) has them before its migrations run.
for db in template1 postgres; do
  psql_admin -d "$db" -c 'CREATE EXTENSION IF NOT EXISTS vector; CREATE EXTENSION IF NOT EXISTS hstore;' 2>/dev/null
  if [ -f "$ext_dir/rum.control" ]; then psql_admin -d "$db" -c 'CREATE EXTENSION IF NOT EXISTS rum;' 2>/dev/null; fi
done
if [ "$(psql_admin -d postgres -tA -c "SELECT count(*) FROM pg_database WHERE datname = '$MNEMO_PG_DB'")" = 0 ]; then
  psql_admin -d postgres -c "CREATE DATABASE \"$MNEMO_PG_DB\" OWNER \"$MNEMO_PG_USER\""
fi
vector_version=$(psql_admin -d "$MNEMO_PG_DB" -tA -c "SELECT extversion FROM pg_extension WHERE extname = 'vector'")
log "PostgreSQL $pg_major ($MNEMO_PG_CLUSTER) with pgvector $vector_version is up: $MNEMO_DATABASE_URL"
