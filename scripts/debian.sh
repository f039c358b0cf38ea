# shellcheck shell=bash
# Helpers for the scripts that install from Debian's archive. Sourced after env.sh, never run.
# Whatever archive they use comes from apt's own configuration, never a host named here.

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_updated=0
apt_install() {
  if [ "$apt_updated" -eq 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

debian_codename() { (. /etc/os-release && echo "$VERSION_CODENAME"); }

# The archive URIs apt uses for release $1, each with its keyring ("URI<tab>keyring" lines).
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
  { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } |
    awk -v cn="$codename" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) break;
      if ($(i + 1) == cn) print $i "\t/usr/share/keyrings/debian-archive-keyring.gpg" }'
}
