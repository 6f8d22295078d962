#!/usr/bin/env bash
# Builds the container node's binaries for devcluster (`up --node-runtime containerd`):
# kubelet and kube-proxy from the same pinned k8s.io/kubernetes wrapper module as the control
# plane (devcluster/go.mod, sharing its GOCACHE, so they mostly link already-built packages),
# containerd, containerd-shim-runc-v2 and ctr (devcluster/go/containerd), the CNI plugins
# bridge, host-local, loopback and portmap (devcluster/go/cni) and the sandbox's pause process
# (devcluster/go/pause), and kube-whoami, the test image's in-cluster client (devcluster/go/whoami).
# runc, iptables, conntrack and busybox come from Debian packages that
# `make node-binaries` installs when missing.
#
# Binaries are cached per machine under $DEVCLUSTER_CACHE (default
# ~/.cache/rollout-devcluster/node-<key>/bin), <key> a digest of the pins, this script and the
# Go version: a rebuild happens only when a pin changes. Prints the bin directory as its last line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
K8S_VERSION="v1.37.2"

if ! command -v go >/dev/null 2>&1; then
  echo "error: Go is not installed or not on PATH; devcluster builds its node from Go modules." >&2
  echo "       Install Go >= 1.26 (https://go.dev/doc/install) and run 'make node-binaries' again." >&2
  exit 2
fi

go_version="$(go env GOVERSION)"
key="$(cat "$here/go.mod" "$here/go.sum" \
  "$here/go/containerd/go.mod" "$here/go/containerd/go.sum" \
  "$here/go/cni/go.mod" "$here/go/cni/go.sum" \
  "$here/go/pause/go.mod" "$here/go/pause/main.go" \
  "$here/go/whoami/go.mod" "$here/go/whoami/main.go" "$here/build-node-binaries.sh" \
  | { cat; echo "$go_version"; } | sha256sum | cut -c1-16)"
cache_root="${DEVCLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-devcluster}"
bin="$cache_root/node-$key/bin"
mkdir -p "$bin/cni"

export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:-} -mod=mod"
export GOMAXPROCS="${GOMAXPROCS:-$(nproc)}"

build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit=release-$K8S_VERSION -X $pkg.buildDate=$build_date"
done
containerd_version="$(awk '$1 == "require" && $2 == "github.com/containerd/containerd/v2" {print $3}' "$here/go/containerd/go.mod")"
containerd_flags="-X github.com/containerd/containerd/v2/version.Version=$containerd_version"
containerd_flags+=" -X github.com/containerd/containerd/v2/version.Revision=release-$containerd_version"

build() {  # name (relative to bin), module dir, package, ldflags
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

build kubelet "$here" k8s.io/kubernetes/cmd/kubelet "$ldflags"
build kube-proxy "$here" k8s.io/kubernetes/cmd/kube-proxy "$ldflags"
build containerd "$here/go/containerd" github.com/containerd/containerd/v2/cmd/containerd "$containerd_flags"
build containerd-shim-runc-v2 "$here/go/containerd" \
  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 "$containerd_flags"
build ctr "$here/go/containerd" github.com/containerd/containerd/v2/cmd/ctr "$containerd_flags"
for plugin in main/bridge ipam/host-local main/loopback meta/portmap; do
  build "cni/${plugin#*/}" "$here/go/cni" "github.com/containernetworking/plugins/plugins/$plugin" ""
done
build pause "$here/go/pause" . ""
build kube-whoami "$here/go/whoami" . ""
echo "$bin"
