#!/usr/bin/env bash
# `make kind` on a machine with Docker: kind's standard path. kind's own node image
# (kindest/node, pulled), its default CNI (kindnetd), one control plane and $KIND_WORKERS workers
# with the shared records folder mounted into every node as on the podman path, the project's
# image from `docker build` loaded with `kind load docker-image`, the device plugin DaemonSet and
# the operator by Helm. `make kind-down` (kind/down-docker.sh) deletes the cluster. docs/kind.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
KIND_CLUSTER="${KIND_CLUSTER:-rollout}"
KIND_WORKERS="${KIND_WORKERS:-2}"
state="${KIND_STATE:-$root/.kind}"
shared="${KIND_SHARED:-$state/shared}"
# shellcheck source=kind/kind-bin.sh
source "$here/kind-bin.sh"
cp_bin="$root/.bin/devcluster"
export KUBECONFIG="$state/kubeconfig"
mkdir -p "$state" "$shared"
chmod 1777 "$shared"
touch "$state/docker"
{
  printf 'kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nname: %s\nnodes:\n' "$KIND_CLUSTER"
  roles=(control-plane)
  for _ in $(seq "$KIND_WORKERS"); do roles+=(worker); done
  for role in "${roles[@]}"; do
    printf -- '- role: %s\n  extraMounts:\n  - hostPath: %s\n    containerPath: /rollout-shared\n' "$role" "$shared"
  done
} > "$state/kind-config.yaml"
# kind's default node image for its version; KIND_NODE_IMAGE=kindest/node:<tag> picks another.
"$kind_bin" create cluster --config "$state/kind-config.yaml" --kubeconfig "$KUBECONFIG" --wait 180s \
  ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
docker build -t rollout-checkpoint-operator:dev "$root"
"$kind_bin" load docker-image rollout-checkpoint-operator:dev --name "$KIND_CLUSTER"
"$cp_bin/kubectl" apply -f "$here/device-plugin.yaml"
"$cp_bin/kubectl" -n kube-system rollout status daemonset/rollout-gpu-device-plugin --timeout=120s
"$cp_bin/helm" upgrade --install rollout-operator "$root/charts/rollout-operator" \
  --namespace rollout-system --create-namespace \
  --set image.tag=dev --set image.pullPolicy=Never --wait --timeout 180s
echo "export KUBECONFIG=$KUBECONFIG"
