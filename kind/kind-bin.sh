# Sourced by kind/up-docker.sh and kind/down-docker.sh (the Docker path, docs/kind.md): sets
# $kind_bin, the kind on PATH, else kind (the pin of kind/env.sh) built once with `go install`
# into the cache. kind alone: on this path kind's own node image holds everything else, so the
# podman path's tools (kubeadm, CoreDNS, ptp; kind/build-tools.sh) are not built. Nothing of
# kind/env.sh is sourced here: its podman settings (KIND_EXPERIMENTAL_PROVIDER) are not for Docker.
# shellcheck shell=bash
kind_version="$(sed -n 's/^KIND_VERSION="\(.*\)"$/\1/p' "$here/env.sh")"
kind_bin="$(command -v kind || true)"
if [ -z "$kind_bin" ]; then
  kind_bin="${KIND_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-kind}/kind-$kind_version/kind"
  if [ ! -x "$kind_bin" ]; then
    command -v go >/dev/null || { echo "error: neither kind nor Go (to build it) is installed" >&2; exit 2; }
    echo "[kind] kind: go install sigs.k8s.io/kind@$kind_version ..." >&2
    GOBIN="$(dirname "$kind_bin")" go install "sigs.k8s.io/kind@$kind_version"
  fi
fi
