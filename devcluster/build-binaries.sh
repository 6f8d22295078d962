#!/usr/bin/env bash
# Builds the devcluster binaries (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, helm) from the pinned wrapper modules in devcluster/go*.
#
# Binaries are cached per machine under $DEVCLUSTER_CACHE (default
# ~/.cache/rollout-devcluster/<key>/bin) where <key> is a digest of the pins and
# the Go version: a rebuild happens only when a pin changes.
# Prints the bin directory as its last line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
K8S_VERSION="v1.37.2"

if ! command -v go >/dev/null 2>&1; then
  echo "error: Go is not installed or not on PATH; devcluster builds its control plane from Go modules." >&2
  echo "       Install Go >= 1.26 (https://go.dev/doc/install) and run 'make cluster-binaries' again." >&2
  exit 2
fi

go_version="$(go env GOVERSION)"
key="$(cat "$here/go.mod" "$here/go.sum" "$here/go/etcd/go.mod" "$here/go/etcd/go.sum" \
  "$here/go/helm/go.mod" "$here/go/helm/go.sum" "$here/build-binaries.sh" \
  | { cat; echo "$go_version"; } | sha256sum | cut -c1-16)"
cache_root="${DEVCLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-devcluster}"
bin="$cache_root/$key/bin"
mkdir -p "$bin"

export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=mod"
# The 2-core machines this runs on do best with one package build at a time per core.
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"

build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit=release-$K8S_VERSION -X $pkg.buildDate=$build_date"
done

build() {  # name, module dir, package, ldflags
  local name="$1" dir="$2" pkg="$3" flags="$4"
  if [ -x "$bin/$name" ]; then
    echo "[devcluster] $name: cached ($bin/$name)" >&2
    return
  fi
  echo "[devcluster] $name: building $pkg (first build on this machine takes minutes) ..." >&2
  local start=$SECONDS
  (cd "$dir" && go build -trimpath -ldflags "-s -w $flags" -o "$bin/$name.tmp" "$pkg")
  mv "$bin/$name.tmp" "$bin/$name"
  echo "[devcluster] $name: built in $((SECONDS - start)) s" >&2
}

build etcd "$here/go/etcd" go.etcd.io/etcd/server/v3 ""
build kube-apiserver "$here" k8s.io/kubernetes/cmd/kube-apiserver "$ldflags"
build kube-controller-manager "$here" k8s.io/kubernetes/cmd/kube-controller-manager "$ldflags"
build kube-scheduler "$here" k8s.io/kubernetes/cmd/kube-scheduler "$ldflags"
build kubectl "$here" k8s.io/kubernetes/cmd/kubectl "$ldflags"
build helm "$here/go/helm" helm.sh/helm/v3/cmd/helm "-X helm.sh/helm/v3/internal/version.version=v3.22.0"
echo "$bin"
