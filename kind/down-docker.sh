#!/usr/bin/env bash
# `make kind-down` after kind/up-docker.sh: deletes the kind cluster (its node containers and
# volumes); the shared records folder under .kind/ stays for inspection. docs/kind.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
state="${KIND_STATE:-$root/.kind}"
# shellcheck source=kind/kind-bin.sh
source "$here/kind-bin.sh"
"$kind_bin" delete cluster --name "${KIND_CLUSTER:-rollout}"
rm -f "$state/docker" "$state/kubeconfig"
