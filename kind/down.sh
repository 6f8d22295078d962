#!/usr/bin/env bash
# `make kind-down`: removes the kind cluster kind/up.sh started and everything it put on the
# machine: the node containers and their volumes, podman's run state (containers, network,
# netavark and aardvark-dns state, mounts), the network namespace with its link and routes, the
# /lib/modules folder if up.sh made it, and the kernel tunables the kubelets changed (put back to
# the values recorded before the first kubelet started). The images stay in podman's storage
# under $KIND_CACHE (the cache). Ends by checking that nothing is left, and fails naming what is.
# Safe to run after a failed or partial `make kind`, and twice.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source=kind/env.sh
source "$here/env.sh"
state="${KIND_STATE:-$root/.kind}"
PY="${PY:-$root/.venv/bin/python}"
log() { echo "[kind] $*" >&2; }

lib_modules_created=false
run_containers_created=false
run_netns_created=false
networks_created=false
flag() { python3 -c 'import json,sys; print(str(json.load(open(sys.argv[1])).get(sys.argv[2], False)).lower())' "$state/cluster.json" "$1"; }
if [ -s "$state/cluster.json" ]; then
  lib_modules_created="$(flag lib_modules_created)"
  run_containers_created="$(flag run_containers_created)"
  run_netns_created="$(flag run_netns_created)"
  networks_created="$(flag networks_created)"
fi

if [ -e "$kind_netns_path" ] && [ -d "$kind_run/conf" ]; then
  tools="$("$here/build-tools.sh" 2>/dev/null | tail -n 1)"
  in_netns "$tools/kind" delete cluster --name "$KIND_CLUSTER" >&2 || true
  # Whatever kind did not own: containers (a build container too), volumes, the network.
  pmn rm --all --force --volumes --time 5 >/dev/null 2>&1 || true
  pmn volume prune --force >/dev/null 2>&1 || true
  pmn network rm --force kind >/dev/null 2>&1 || true
fi
# Mounts podman's storage and run root hold (overlay, shm, the netns bind mounts of containers).
grep -E " ($kind_cache/storage|$kind_run|/run/netns/netns-)[^ ]*" /proc/self/mountinfo \
  | awk '{print $5}' | sort -r | while read -r point; do umount -l "$point" 2>/dev/null || true; done
ip route del "$KIND_NODE_SUBNET" dev "$KIND_HOST_LINK" 2>/dev/null || true
ip route del "$KIND_POD_SUBNET" dev "$KIND_HOST_LINK" 2>/dev/null || true
ip link del "$KIND_HOST_LINK" 2>/dev/null || true
if [ -e "$kind_netns_path" ]; then ip netns del "$KIND_NETNS" || true; fi
if [ -f "$kind_run/kernel-tunables.json" ]; then
  "$PY" -c 'import sys; from pathlib import Path; from devcluster.containernode import restore_tunables; restore_tunables(Path(sys.argv[1]))' \
    "$kind_run/kernel-tunables.json" || python3 - "$kind_run/kernel-tunables.json" <<'PY'
import json, sys
for name, value in json.load(open(sys.argv[1])).items():
    with open(f"/proc/sys/{name}", "w") as f:
        f.write(value)
PY
fi
if [ "$lib_modules_created" = true ] && [ -d /lib/modules ]; then rmdir /lib/modules 2>/dev/null || true; fi
# netavark's state of this cluster's network; /run/containers itself if this run made it.
if [ "$networks_created" = true ]; then rm -rf /run/containers/networks; fi
if [ "$run_containers_created" = true ]; then rmdir /run/containers 2>/dev/null || true; fi
if [ "$run_netns_created" = true ] && [ -d /run/netns ] && [ -z "$(ls -A /run/netns)" ]; then
  # `ip netns add` bind-mounts the folder on itself (shared propagation), at times twice.
  for _ in 1 2 3 4; do mountpoint -q /run/netns && umount /run/netns; done
  rmdir /run/netns 2>/dev/null || true
fi
rm -rf "$kind_run"
rm -f "$state/cluster.json" "$state/kubeconfig" "$state/kubeconfig.kind"

# Check: nothing of the cluster may be left.
left=()
[ -e "$kind_netns_path" ] && left+=("network namespace $KIND_NETNS")
ip link show "$KIND_HOST_LINK" >/dev/null 2>&1 && left+=("link $KIND_HOST_LINK")
[ -e "$kind_run" ] && left+=("$kind_run")
while read -r point; do left+=("mount $point"); done < <(grep -E " ($kind_cache/storage|$kind_run)" /proc/self/mountinfo | awk '{print $5}')
for pid in $(pgrep -x conmon; pgrep -x aardvark-dns); do
  if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -e "$kind_cache" -e "$kind_run"; then
    left+=("process $pid $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-80)")
  fi
done
if [ "$lib_modules_created" = true ] && [ -e /lib/modules ]; then left+=("/lib/modules"); fi
if [ "$networks_created" = true ] && [ -e /run/containers/networks ]; then left+=("/run/containers/networks"); fi
if [ "$run_containers_created" = true ] && [ -e /run/containers ]; then left+=("/run/containers"); fi
if [ "$run_netns_created" = true ] && [ -e /run/netns ]; then left+=("/run/netns"); fi
for name in kernel/panic kernel/panic_on_oops vm/overcommit_memory; do
  log "$(echo "$name" | tr / .) = $(cat /proc/sys/$name)"
done
if [ ${#left[@]} -gt 0 ]; then
  printf '[kind] left behind: %s\n' "${left[@]}" >&2
  exit 1
fi
log "down: no container, mount, namespace, link or process of the cluster is left"
