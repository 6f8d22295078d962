#!/usr/bin/env bash
# `make kind`: a kind cluster of one control plane and $KIND_WORKERS workers (default 2) on
# podman, from the node image kind/build-node-image.sh assembles; the project's image on every
# node, the device plugin DaemonSet on the workers, the operator installed by Helm; prints the
# KUBECONFIG line. `make kind-down` (kind/down.sh) removes all of it. See docs/kind.md.
#
# Network (docs/kind.md, "Network"): the node containers live on podman's network inside the
# network namespace $KIND_NETNS; this machine reaches the nodes and the pods through one veth
# pair into that namespace and two routes (node subnet, pod subnet), so kubectl, Helm and the
# tests' trainer dial them directly. The namespace has no route anywhere else: nothing the
# cluster sends leaves the machine.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source=kind/env.sh
source "$here/env.sh"

KIND_WORKERS="${KIND_WORKERS:-2}"
state="${KIND_STATE:-$root/.kind}"
shared="${KIND_SHARED:-$state/shared}"
SHARED_IN_NODE="/rollout-shared"
PY="${PY:-$root/.venv/bin/python}"
export KUBECONFIG="$state/kubeconfig"
log() { echo "[kind] $*" >&2; }
step_start=$SECONDS
lap() { log "$1 ($((SECONDS - step_start)) s)"; step_start=$SECONDS; }

[ "$(id -u)" = 0 ] || { echo "error: make kind runs as root (podman, a network namespace, sysctls)" >&2; exit 2; }
if [ -e "$state/cluster.json" ]; then
  echo "error: a kind cluster from $state is up (or was not taken down); run make kind-down first" >&2
  exit 1
fi
if [ -e "$kind_netns_path" ] || [ -e "$kind_run" ]; then
  echo "error: a kind cluster of this machine is up ($kind_netns_path, $kind_run): take it down" \
    "with make kind-down (KIND_STATE=its folder) first" >&2
  exit 1
fi
total_start=$SECONDS
# Before any podman call (the builds make some): what of the machine's folders this run creates.
lib_modules_created="$([ -e /lib/modules ] && echo false || echo true)"
run_containers_created="$([ -e /run/containers ] && echo false || echo true)"
networks_created="$([ -e /run/containers/networks ] && echo false || echo true)"
run_netns_created="$([ -e /run/netns ] && echo false || echo true)"  # `ip netns add` makes it
mkdir -p "$state" "$shared"
# Written before anything is created: kind/down.sh works from it even after a failed start.
# netavark keeps its run state (IP allocations, aardvark-dns) in /run/containers/networks
# whatever the configuration says (podman 4.3): down removes it if this run made it.
printf '{"cluster": "%s", "netns": "%s", "workers": %s, "shared": "%s", "lib_modules_created": %s, "run_containers_created": %s, "networks_created": %s, "run_netns_created": %s}\n' \
  "$KIND_CLUSTER" "$KIND_NETNS" "$KIND_WORKERS" "$shared" \
  "$lib_modules_created" "$run_containers_created" "$networks_created" "$run_netns_created" \
  > "$state/cluster.json"
NODE_IMAGE="$("$here/build-node-image.sh" | tail -n 1)"
tools="$("$here/build-tools.sh" | tail -n 1)"
cp_bin="$("$root/devcluster/build-binaries.sh" | tail -n 1)"
image_dir="$("$root/image/build.sh" | tail -n 1)"
lap "builds ready: node image $NODE_IMAGE"
kubectl() { "$cp_bin/kubectl" "$@"; }

mkdir -p "$state" "$shared"
chmod 1777 "$shared"
kind_podman_config
fail() { echo "error: $*; kind/down.sh takes down what was started" >&2; exit 1; }

# The kubelets set kernel.panic, kernel.panic_on_oops and vm.overcommit_memory (and others, not
# namespaced) machine-wide: the machine's own values are recorded now, put back by kind/down.sh.
"$PY" -c 'import sys; from pathlib import Path; from devcluster.containernode import record_tunables; record_tunables(Path(sys.argv[1]))' \
  "$kind_run/kernel-tunables.json"
# kind mounts /lib/modules into every node; this kernel has no modules and no such folder.
[ -e /lib/modules ] || mkdir /lib/modules

ip netns add "$KIND_NETNS"
ip -n "$KIND_NETNS" link set lo up
ip link add "$KIND_HOST_LINK" type veth peer name rkind1 netns "$KIND_NETNS"
ip addr add "$KIND_LINK_HOST/30" dev "$KIND_HOST_LINK"
ip link set "$KIND_HOST_LINK" up
ip -n "$KIND_NETNS" addr add "$KIND_LINK_NETNS/30" dev rkind1
ip -n "$KIND_NETNS" link set rkind1 up
in_netns sysctl -qw net.ipv4.ip_forward=1
ip route add "$KIND_NODE_SUBNET" via "$KIND_LINK_NETNS" dev "$KIND_HOST_LINK"
ip route add "$KIND_POD_SUBNET" via "$KIND_LINK_NETNS" dev "$KIND_HOST_LINK"
pmn network create --driver bridge --subnet "$KIND_NODE_SUBNET" kind >/dev/null
lap "network namespace $KIND_NETNS, link $KIND_LINK_HOST <-> $KIND_LINK_NETNS, podman network $KIND_NODE_SUBNET"

config="$state/kind-config.yaml"
# A lost node seen sooner (docs/kind.md, "A lost node: heartbeats and grace"): each kubelet renews
# its node Lease every quarter of nodeLeaseDurationSeconds (16 s: every 4 s, instead of 40 s: 10 s),
# the node controller looks every 2 s (instead of 5) and marks a node Unknown when it has seen no
# renewal for node-monitor-grace-period (12 s: three renewals, instead of the default 50 s). The
# Lease is the heartbeat the node controller reads; nodeStatusUpdateFrequency stays at 10 s (set,
# it would post the whole node status that often and cut the heartbeat's request timeout to it).
KIND_NODE_LEASE_SECONDS="${KIND_NODE_LEASE_SECONDS:-16}"
KIND_NODE_GRACE="${KIND_NODE_GRACE:-12s}"
{
  cat <<YAML
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
name: $KIND_CLUSTER
networking:
  disableDefaultCNI: true
  podSubnet: $KIND_POD_SUBNET
  serviceSubnet: $KIND_SERVICE_SUBNET
kubeadmConfigPatches:
- |
  kind: KubeletConfiguration
  failCgroupV1: false
  nodeLeaseDurationSeconds: $KIND_NODE_LEASE_SECONDS
- |
  kind: ClusterConfiguration
  controllerManager:
    extraArgs:
    - name: node-monitor-grace-period
      value: $KIND_NODE_GRACE
    - name: node-monitor-period
      value: 2s
  etcd:
    local:
      imageTag: "$("$cp_bin/etcd" --version | awk '/etcd Version/ {print $3}')-0"
nodes:
YAML
  roles=(control-plane)
  for _ in $(seq "$KIND_WORKERS"); do roles+=(worker); done
  for role in "${roles[@]}"; do
    cat <<YAML
- role: $role
  extraMounts:
  - hostPath: $shared
    containerPath: $SHARED_IN_NODE
YAML
  done
} > "$config"
in_netns "$tools/kind" create cluster --config "$config" --image "$NODE_IMAGE" \
  --kubeconfig "$state/kubeconfig.kind" --retain >&2 || fail "kind create cluster failed"
lap "kind create cluster: 1 control plane, $KIND_WORKERS workers"

# The API server at the control-plane node's address (its serving certificate names it), which
# this machine reaches through the link; kind's own kubeconfig names a port published on the
# namespace's loopback.
cp_ip="$(pmn inspect --format '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$KIND_CLUSTER-control-plane")"
sed "s|server: https://127.0.0.1:[0-9]*|server: https://$cp_ip:6443|" "$state/kubeconfig.kind" > "$state/kubeconfig"
chmod 600 "$state/kubeconfig"

# The pod network: ptp + host-local from each node's pod CIDR, and a route to every other node's
# pod CIDR through that node (what kindnetd does), in the nodes and in the namespace.
# The controller-manager gives each node its pod CIDR shortly after the node registers.
kubectl wait --for=jsonpath='{.spec.podCIDR}' nodes --all --timeout=60s >/dev/null \
  || fail "a node got no pod CIDR within 60 s"
mapfile -t nodes < <(kubectl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')
[ "${#nodes[@]}" -eq $((KIND_WORKERS + 1)) ] || fail "expected $((KIND_WORKERS + 1)) nodes, found ${nodes[*]}"
declare -A node_ip node_cidr
for node in "${nodes[@]}"; do
  node_ip[$node]="$(kubectl get node "$node" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')"
  node_cidr[$node]="$(kubectl get node "$node" -o jsonpath='{.spec.podCIDR}')"
done
for node in "${nodes[@]}"; do
  pmn exec -i "$node" sh -c 'cat > /etc/cni/net.d/10-rollout-ptp.conflist' <<JSON
{
  "cniVersion": "1.0.0",
  "name": "rollout-kind",
  "plugins": [
    {"type": "ptp", "ipMasq": false, "mtu": 1500,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "${node_cidr[$node]}"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
  for other in "${nodes[@]}"; do
    [ "$other" = "$node" ] || pmn exec "$node" ip route replace "${node_cidr[$other]}" via "${node_ip[$other]}"
  done
  ip -n "$KIND_NETNS" route replace "${node_cidr[$node]}" via "${node_ip[$node]}"
done
kubectl wait --for=condition=Ready nodes --all --timeout=180s >&2 || fail "nodes not Ready in 180 s"
lap "pod network: ptp per node, routes between nodes; every node Ready"

# The project's image on every node that runs pods (what `kind load image-archive` does, through
# ctr), the nodes side by side: with workers, the control plane keeps kubeadm's NoSchedule taint
# and runs none of the image's pods (kind removes the taint only in a cluster of one node).
image_nodes=()
for node in "${nodes[@]}"; do
  [ "$KIND_WORKERS" -gt 0 ] && [ "$node" = "$KIND_CLUSTER-control-plane" ] || image_nodes+=("$node")
done
declare -A import_pid
for node in "${image_nodes[@]}"; do
  pmn exec -i "$node" ctr --namespace=k8s.io images import --digests --snapshotter=overlayfs - \
    < "$image_dir/image.oci.tar" >/dev/null &
  import_pid[$node]=$!
done
for node in "${image_nodes[@]}"; do
  wait "${import_pid[$node]}" || fail "image import on $node failed"
done
lap "project image loaded on ${#image_nodes[@]} nodes: ${image_nodes[*]}"

if [ -f "$root/kind/device-plugin.yaml" ]; then
  kubectl apply -f "$root/kind/device-plugin.yaml" >/dev/null
  kubectl -n kube-system rollout status daemonset/rollout-gpu-device-plugin --timeout=120s >&2 \
    || fail "device plugin DaemonSet not ready in 120 s"
  lap "device plugin DaemonSet ready"
fi

if [ -z "${KIND_NO_OPERATOR:-}" ]; then
  "$cp_bin/helm" upgrade --install rollout-operator "$root/charts/rollout-operator" \
    --namespace rollout-system --create-namespace \
    --set image.tag=dev --set image.pullPolicy=Never --wait --timeout 180s >&2 \
    || fail "helm install of the operator failed"
  lap "operator installed by Helm (namespace rollout-system)"
fi
kubectl -n kube-system rollout status deployment/coredns --timeout=120s >&2 || fail "CoreDNS not ready"
log "up in $((SECONDS - total_start)) s"
echo "export KUBECONFIG=$state/kubeconfig"
