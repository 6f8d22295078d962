#!/usr/bin/env bash
# Builds the S3-compatible server that the object-storage tests and the bucket demo run against:
# versitygw (its posix backend: one process, objects as files under a data directory, conditional
# writes with `If-None-Match: *`) from the pinned wrapper module devcluster/go/s3.
#
# Cached per machine under $DEVCLUSTER_CACHE (default ~/.cache/rollout-devcluster/s3-<key>/bin),
# <key> a digest of the pin, this script and the Go version: a rebuild happens only when the pin
# changes. Prints the bin directory (bin/versitygw) as its last line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mod="$here/go/s3"

if ! command -v go >/dev/null 2>&1; then
  echo "error: Go is not installed or not on PATH; the tests' S3 server is built from Go modules." >&2
  echo "       Install Go >= 1.26 (https://go.dev/doc/install) and run 'make s3-server' again." >&2
  exit 2
fi

go_version="$(go env GOVERSION)"
key="$(cat "$mod/go.mod" "$mod/go.sum" "$mod/tools.go" "$here/build-s3.sh" \
  | { cat; echo "$go_version"; } | sha256sum | cut -c1-16)"
cache_root="${DEVCLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-devcluster}"
bin="$cache_root/s3-$key/bin"
mkdir -p "$bin"

export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=mod"
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"

version="$(awk '$1 == "require" && $2 == "github.com/versity/versitygw" {print $3}' "$mod/go.mod")"
if [ -x "$bin/versitygw" ]; then
  echo "[devcluster] versitygw $version: cached ($bin/versitygw)" >&2
else
  echo "[devcluster] versitygw $version: building github.com/versity/versitygw/cmd/versitygw ..." >&2
  start=$SECONDS
  (cd "$mod" && go build -trimpath \
    -ldflags "-s -w -X main.Version=$version" \
    -o "$bin/versitygw.tmp" github.com/versity/versitygw/cmd/versitygw)
  mv "$bin/versitygw.tmp" "$bin/versitygw"
  echo "[devcluster] versitygw $version: built in $((SECONDS - start)) s" >&2
fi
echo "$bin"
