#!/usr/bin/env bash
# Builds the tools the kind cluster needs beyond devcluster's binaries, from pinned Go modules:
# kind itself (sigs.k8s.io/kind, `go install`), kubeadm (k8s.io/kubernetes/cmd/kubeadm from
# devcluster's wrapper module, sharing its build cache), CoreDNS at the version kubeadm deploys
# (kind/go/coredns) and the CNI ptp plugin (devcluster/go/cni). kindnetd, kind's default CNI, is
# a nested module the Go module proxy does not serve, so the cluster runs ptp + host-local with
# routes set by kind/up.sh instead (docs/kind.md).
#
# Cached under $KIND_CACHE/tools-<key>/bin (default ~/.cache/rollout-kind), <key> a digest of the
# pins, this script and the Go version. Prints the bin directory as its last line.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source=kind/env.sh
source "$here/env.sh"

command -v go >/dev/null || { echo "error: Go is not installed (Go >= 1.26 builds kind's tools)" >&2; exit 2; }
key="$( { cat "$here/build-tools.sh" "$root/devcluster/go.mod" "$root/devcluster/go.sum" \
          "$root/devcluster/go/cni/go.mod" "$root/devcluster/go/cni/go.sum" \
          "$here/go/coredns/go.mod" "$here/go/coredns/go.sum"; echo "$KIND_VERSION"; go env GOVERSION; } \
        | sha256sum | cut -c1-16)"
bin="$kind_cache/tools-$key/bin"
mkdir -p "$bin"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod"
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit=release-$K8S_VERSION"
done

build() {  # name, module dir, package, ldflags
  local name="$1" dir="$2" pkg="$3" flags="$4"
  if [ -x "$bin/$name" ]; then echo "[kind] $name: cached" >&2; return; fi
  echo "[kind] $name: building $pkg ..." >&2
  local start=$SECONDS
  (cd "$dir" && go build -trimpath -ldflags "-s -w $flags" -o "$bin/$name.tmp" "$pkg")
  mv "$bin/$name.tmp" "$bin/$name"
  echo "[kind] $name: built in $((SECONDS - start)) s" >&2
}

if [ ! -x "$bin/kind" ]; then
  echo "[kind] kind: go install sigs.k8s.io/kind@$KIND_VERSION ..." >&2
  start=$SECONDS
  GOBIN="$bin/.kind" go install "sigs.k8s.io/kind@$KIND_VERSION"
  mv "$bin/.kind/kind" "$bin/kind" && rmdir "$bin/.kind"
  echo "[kind] kind: built in $((SECONDS - start)) s" >&2
fi
# kubeadm from a copy of devcluster's wrapper module: the same pins and build cache, while the
# go.sum entries kubeadm adds stay out of devcluster/ (they would change its binaries' cache key).
kubeadm_module="$kind_cache/tools-$key/kubeadm-module"
rm -rf "$kubeadm_module" && mkdir -p "$kubeadm_module"
cp "$root/devcluster/go.mod" "$root/devcluster/go.sum" "$root/devcluster/tools.go" "$kubeadm_module/"
build kubeadm "$kubeadm_module" k8s.io/kubernetes/cmd/kubeadm "$ldflags"
build coredns "$here/go/coredns" github.com/coredns/coredns ""
build cni/ptp "$root/devcluster/go/cni" github.com/containernetworking/plugins/plugins/main/ptp ""
echo "$bin"
