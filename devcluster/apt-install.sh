#!/usr/bin/env bash
# apt-install.sh LABEL PACKAGE...: install those of the Debian packages not installed yet, from
# the package lists as they are, else after `apt-get update`. The Makefile runs it under a lock
# (APT_INSTALL), so that build targets made at the same time never run two apt-gets at once.
set -euo pipefail
label=$1
shift
missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "[$label] installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
install "${missing[@]}" || { apt-get update -qq && install "${missing[@]}"; }
