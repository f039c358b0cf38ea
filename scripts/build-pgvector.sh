#!/usr/bin/env bash
# Builds and installs pgvector for PostgreSQL $1 (default: the newest installed) from Debian's
# source package. Debian 12 ships no pgvector binary; newer suites ship its source. The deb-src
# entries are derived from apt's own configuration (the archive's URIs and keyring, the running
# release and the releases after it). Used by setup-postgres.sh and docker/postgres.Dockerfile.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=env.sh
. "$here/env.sh"
# shellcheck source=debian.sh
. "$here/debian.sh"

pg_major=${1:-$(ls /usr/lib/postgresql | sort -n | tail -1)}
pg_bin=/usr/lib/postgresql/$pg_major/bin
apt_install "postgresql-server-dev-$pg_major" dpkg-dev build-essential distro-info-data

codename=$(debian_codename)
suites="$codename $codename-backports"
# releases after this one that exist already (created before today), oldest first, then sid
suites="$suites $(awk -F, -v cn="$codename" -v today="$(date +%F)" '
  found && $3 != "experimental" && $4 <= today { printf "%s ", $3 }
  $3 == cn { found = 1 }' /usr/share/distro-info/debian.csv)"
work=$(mktemp -d -t mnemo-pgvector.XXXXXX)
# The sources were fetched and built as root.
trap 'as_root rm -rf "$work"' EXIT
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
aptopts=(-o "Dir::Etc::sourcelist=$srclist" -o "Dir::Etc::sourceparts=-" -o "Dir::State::Lists=$lists"
  -o "APT::Sandbox::User=root")
# A suite the mirror lacks only costs a warning; showsrc below decides.
as_root apt-get "${aptopts[@]}" update -qq || true
# Newest first; a mirror may list a version whose files it does not carry, so try the next.
versions=$(apt-cache "${aptopts[@]}" showsrc pgvector 2>/dev/null | awk '/^Version:/ { print $2 }' | sort -Vru)
[ -n "$versions" ] || die "no pgvector source package in $suites"
fetched=0
for v in $versions; do
  if (cd "$work" && as_root apt-get "${aptopts[@]}" source -qq "pgvector=$v" >/dev/null 2>&1); then fetched=1; break; fi
  log "pgvector $v could not be fetched; trying an older version"
done
[ "$fetched" = 1 ] || die "no pgvector source package could be fetched (tried: $(echo $versions))"
src=$(find "$work" -maxdepth 1 -type d -name 'pgvector-*' | head -1)
[ -n "$src" ] || die "apt-get source pgvector produced no source tree"
# OPTFLAGS="" keeps the build portable (no -march=native).
as_root make -s -C "$src" PG_CONFIG="$pg_bin/pg_config" OPTFLAGS="" >/dev/null
as_root make -s -C "$src" PG_CONFIG="$pg_bin/pg_config" install >/dev/null
