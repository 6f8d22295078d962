#!/usr/bin/env bash
# Builds the local base image for the project's Dockerfile: Debian 12 (bookworm) with Python 3.11
# and its venv module, made by mmdebstrap from Debian packages, because registry base images
# (the Dockerfile's default, the official python image) cannot be pulled on these machines.
#
# The root filesystem is a tar cached under $ROLLOUT_IMAGE_CACHE/base-<key>/rootfs.tar, where
# <key> is a digest of this recipe and of the apt sources it installs from; it is rebuilt only
# when either changes. Packages come from the machine's own apt sources (the file in
# $ROLLOUT_BASE_SOURCES, default: the first Debian sources file apt uses here), so the base is
# made from the same mirror the machine's apt-get uses.
#
# Prints the cache directory as its last line (rootfs.tar and Containerfile in it).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SUITE="bookworm"
# python-is-python3: the Dockerfile (written for the official image) calls `python`;
# passwd (part of minbase) gives it groupadd and useradd.
PACKAGES="python3,python3-venv,python-is-python3"

cache_root="${ROLLOUT_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-images}"

sources="${ROLLOUT_BASE_SOURCES:-}"
if [ -z "$sources" ]; then
  for candidate in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    if [ -s "$candidate" ]; then sources="$candidate"; break; fi
  done
fi
if [ -z "$sources" ] || [ ! -s "$sources" ]; then
  echo "error: no apt sources file to build the base image from (looked at" \
    "/etc/apt/sources.list.d/debian.sources and /etc/apt/sources.list);" \
    "set ROLLOUT_BASE_SOURCES to a Debian sources file naming the $SUITE suite." >&2
  exit 2
fi
if ! command -v mmdebstrap >/dev/null 2>&1; then
  echo "error: mmdebstrap is not installed; 'make image' installs it (apt-get install mmdebstrap)." >&2
  exit 2
fi

# The Containerfile that turns the root filesystem into an image (the official python image sets
# LANG the same way; PATH is Debian's default).
containerfile='FROM scratch
ADD rootfs.tar /
ENV LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CMD ["python3"]
'

key="$(cat "$here/build-base.sh" "$sources" | sha256sum | cut -c1-16)"
dir="$cache_root/base-$key"
mkdir -p "$cache_root"

if [ -s "$dir/rootfs.tar" ]; then
  echo "[image] base: cached ($dir/rootfs.tar)" >&2
else
  echo "[image] base: mmdebstrap $SUITE with $PACKAGES (first build on this machine takes minutes) ..." >&2
  start=$SECONDS
  tmp="$cache_root/.base-$key.tmp"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  mmdebstrap --quiet --variant=minbase --include="$PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --format=tar "$SUITE" "$tmp/rootfs.tar" "$sources" >&2
  printf '%s' "$containerfile" > "$tmp/Containerfile"
  rm -rf "$dir"
  mv "$tmp" "$dir"
  echo "[image] base: built in $((SECONDS - start)) s" >&2
fi
echo "$dir"
