#!/usr/bin/env bash
# Builds the Kueue controller manager for devcluster (`up --kueue`) from the pinned wrapper
# module devcluster/go/kueue, and copies the module's own CRDs (config/components/crd/bases/)
# and webhook manifests (config/components/webhook/manifests.yaml) next to it.
#
# Cached per machine under $DEVCLUSTER_CACHE (default ~/.cache/rollout-devcluster/kueue-<key>/),
# <key> a digest of the pin, this script and the Go version: a rebuild happens only when the pin
# changes. Prints the directory (bin/kueue, crds/, webhook.yaml) as its last line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mod="$here/go/kueue"

if ! command -v go >/dev/null 2>&1; then
  echo "error: Go is not installed or not on PATH; devcluster builds Kueue from Go modules." >&2
  echo "       Install Go >= 1.26 (https://go.dev/doc/install) and run 'make kueue-binaries' again." >&2
  exit 2
fi

go_version="$(go env GOVERSION)"
key="$(cat "$mod/go.mod" "$mod/go.sum" "$mod/tools.go" "$here/build-kueue.sh" \
  | { cat; echo "$go_version"; } | sha256sum | cut -c1-16)"
cache_root="${DEVCLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-devcluster}"
out="$cache_root/kueue-$key"
mkdir -p "$out/bin"

export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=mod"
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"

version="$(awk '$1 == "require" && $2 == "sigs.k8s.io/kueue" {print $3}' "$mod/go.mod")"
if [ -x "$out/bin/kueue" ] && [ -d "$out/crds" ]; then
  echo "[devcluster] kueue $version: cached ($out/bin/kueue)" >&2
else
  echo "[devcluster] kueue $version: building sigs.k8s.io/kueue/cmd/kueue (first build on this machine takes minutes) ..." >&2
  start=$SECONDS
  (cd "$mod" && go build -trimpath \
    -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$version" \
    -o "$out/bin/kueue.tmp" sigs.k8s.io/kueue/cmd/kueue)
  src="$(cd "$mod" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
  rm -rf "$out/crds.tmp" && mkdir -p "$out/crds.tmp"
  cp "$src"/config/components/crd/bases/*.yaml "$out/crds.tmp/"
  cp "$src/config/components/webhook/manifests.yaml" "$out/webhook.yaml"
  chmod -R u+w "$out/crds.tmp" "$out/webhook.yaml"
  rm -rf "$out/crds" && mv "$out/crds.tmp" "$out/crds"
  mv "$out/bin/kueue.tmp" "$out/bin/kueue"
  echo "[devcluster] kueue $version: built in $((SECONDS - start)) s" >&2
fi
echo "$out"
