# Sourced by kind/*.sh: where the kind cluster's pieces live, and podman pinned to the project's
# own configuration (never the machine's): runc as the OCI runtime (crun, which Debian's podman
# prefers when installed, refuses this machine's hybrid cgroup layout), cgroupfs (the host runs no
# systemd), ulimits within the machine's hard limits, its own storage, run root, network configs
# and an empty registries list (nothing is pulled). Every podman call of the cluster runs inside
# the network namespace $KIND_NETNS (`nsenter --net=`; `ip netns exec` would remount /sys and
# hide the cgroup mounts), so podman's bridge, forwarding and iptables rules never touch the
# machine's own namespace. See docs/kind.md.
# shellcheck shell=bash

KIND_VERSION="v0.33.0"
K8S_VERSION="v1.37.2"
KIND_CLUSTER="${KIND_CLUSTER:-rollout}"
KIND_NETNS="${KIND_NETNS:-rollout-kind}"
kind_cache="${KIND_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-kind}"
kind_run="/run/rollout-kind"
kind_netns_path="/run/netns/$KIND_NETNS"
# Addresses on this machine's side of the cluster (docs/kind.md, "Network"): a /30 link from the
# machine into the cluster's namespace, the podman network of the node containers, and the pods.
KIND_LINK_HOST="10.215.0.1"
KIND_LINK_NETNS="10.215.0.2"
KIND_NODE_SUBNET="10.219.0.0/24"
KIND_POD_SUBNET="10.217.0.0/16"
KIND_SERVICE_SUBNET="10.218.0.0/16"
KIND_HOST_LINK="rkind0"

kind_podman_config() {  # writes the configuration files podman reads through the env below
  mkdir -p "$kind_run/conf" "$kind_run/cni" "$kind_cache/storage"
  cat > "$kind_run/conf/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$kind_run/events.log"
tmp_dir = "$kind_run/libpod-tmp"
volume_path = "$kind_cache/storage/volumes"
static_dir = "$kind_cache/storage/libpod"

[engine.runtimes]
runc = ["$(command -v runc)"]

[network]
network_backend = "netavark"
network_config_dir = "$kind_run/cni"
CONF
  cat > "$kind_run/conf/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$kind_cache/storage"
runroot = "$kind_run/storage"
CONF
  printf 'unqualified-search-registries = []\n' > "$kind_run/conf/registries.conf"
}

export CONTAINERS_CONF="$kind_run/conf/containers.conf"
export CONTAINERS_STORAGE_CONF="$kind_run/conf/storage.conf"
export CONTAINERS_REGISTRIES_CONF="$kind_run/conf/registries.conf"
export KIND_EXPERIMENTAL_PROVIDER="podman"

in_netns() { nsenter --net="$kind_netns_path" -- "$@"; }
pm() { podman "$@"; }              # builds: no network at all (--network none)
pmn() { in_netns podman "$@"; }    # the cluster: inside its network namespace
