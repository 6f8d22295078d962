#!/usr/bin/env bash
# Assembles kind's node image with podman, without a registry: `kind build node-image` is
# Docker-only and pulls its base and component images, neither of which works here.
#
#   1. The root filesystem: Debian 12 by mmdebstrap from the machine's apt sources, with the
#      packages and files of kind's own base image (sigs.k8s.io/kind images/base: its entrypoint,
#      systemd units, containerd config), containerd, ctr and the runc shim from devcluster's node
#      build, runc from Debian, the CNI plugins, kubelet, kubeadm and kubectl in /usr/bin.
#   2. The component images kubeadm asks for, named as `kubeadm config images list` prints them:
#      kube-apiserver, kube-controller-manager, kube-scheduler, etcd, CoreDNS and pause each
#      FROM scratch plus its binary; kube-proxy on a small Debian root (it needs iptables).
#   3. containerd started in a container of the root filesystem, the component images imported
#      with `ctr import --no-unpack` (pinned, as kind does), the container committed as the node
#      image, entrypoint and stop signal as kind's base image has them.
#
# Cached in podman's storage (kind/env.sh) as localhost/rollout-kind-node:<key>, <key> a digest of
# this script, kind/env.sh, the apt sources, kind's version and the binaries' cache keys; the
# component archive is kept in $KIND_CACHE/node-<key>/. Prints the image name as its last line.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source=kind/env.sh
source "$here/env.sh"

for tool in podman mmdebstrap runc python3; do
  command -v "$tool" >/dev/null || { echo "error: $tool is missing; 'make kind' installs it (apt-get)" >&2; exit 2; }
done
cp_bin="$("$root/devcluster/build-binaries.sh" | tail -n 1)"
node_bin="$("$root/devcluster/build-node-binaries.sh" | tail -n 1)"
tools="$("$here/build-tools.sh" | tail -n 1)"
kind_src="$(cd "$root/devcluster" && GOFLAGS=-mod=mod go env GOMODCACHE)/sigs.k8s.io/kind@$KIND_VERSION/images/base/files"
[ -d "$kind_src" ] || { echo "error: kind's module is not in the Go module cache ($kind_src)" >&2; exit 2; }
sources=""
for candidate in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
  if [ -s "$candidate" ]; then sources="$candidate"; break; fi
done
[ -n "$sources" ] || { echo "error: no apt sources file to build the node from" >&2; exit 2; }

kind_podman_config
key="$( { cat "$here/build-node-image.sh" "$here/env.sh" "$sources"; echo "$cp_bin $node_bin $tools";
          podman --version; runc --version | head -n 1; } | sha256sum | cut -c1-16)"
NODE_IMAGE="localhost/rollout-kind-node:$key"
dir="$kind_cache/node-$key"
mkdir -p "$kind_cache"
exec 9>"$kind_cache/.build.lock"
flock 9

if pm image exists "$NODE_IMAGE"; then
  echo "[kind] node image: cached ($NODE_IMAGE)" >&2
  echo "$NODE_IMAGE"
  exit 0
fi

start=$SECONDS
tmp="$kind_cache/.node-$key.tmp"
rm -rf "$tmp"
mkdir -p "$tmp/images"
ETCD_TAG="$("$cp_bin/etcd" --version | awk '/etcd Version/ {print $3}')-0"
PAUSE_IMAGE="registry.k8s.io/pause:3.10.2"

# 1. The node's root filesystem (kind's base image: images/base/Dockerfile, on bookworm).
echo "[kind] node rootfs: mmdebstrap bookworm (first build takes minutes) ..." >&2
cat > "$tmp/customize.sh" <<HOOK
#!/bin/sh
set -eu
r="\$1"
mkdir -p "\$r/kind/bin" "\$r/etc/containerd" "\$r/etc/systemd/system/kubelet.service.d" \
  "\$r/opt/cni/bin" "\$r/etc/kubernetes/manifests" "\$r/LICENSES"
install -m 0755 "$kind_src"/usr/local/bin/* "\$r/usr/local/bin/"
install -m 0644 "$kind_src"/kind/README.txt "\$r/kind/"
install -m 0755 "$kind_src"/kind/bin/* "\$r/kind/bin/"
install -m 0644 "$kind_src"/etc/crictl.yaml "\$r/etc/"
# The pause image built here, and restrict_oom_score_adj: root in the node container lacks
# CAP_SYS_RESOURCE on these machines, so containerd may not lower a container's OOM score.
sed -e 's|sandbox_image = .*|sandbox_image = "$PAUSE_IMAGE"|' \
    -e 's|restrict_oom_score_adj = false|restrict_oom_score_adj = true|' \
  "$kind_src"/etc/containerd/config.toml > "\$r/etc/containerd/config.toml"
install -m 0644 "$kind_src"/etc/default/kubelet "\$r/etc/default/"
install -m 0644 "$kind_src"/etc/sysctl.d/* "\$r/etc/sysctl.d/"
install -m 0644 "$kind_src"/etc/systemd/system/*.service "$kind_src"/etc/systemd/system/*.slice "\$r/etc/systemd/system/"
install -m 0644 "$kind_src"/etc/systemd/system/kubelet.service.d/* "\$r/etc/systemd/system/kubelet.service.d/"
for b in containerd ctr containerd-shim-runc-v2; do install -m 0755 "$node_bin/\$b" "\$r/usr/local/bin/"; done
for b in kubelet; do install -m 0755 "$node_bin/\$b" "\$r/usr/bin/"; done
install -m 0755 "$tools/kubeadm" "$cp_bin/kubectl" "\$r/usr/bin/"
for p in host-local loopback portmap bridge; do install -m 0755 "$node_bin/cni/\$p" "\$r/opt/cni/bin/"; done
install -m 0755 "$tools/cni/ptp" "\$r/opt/cni/bin/"
printf '%s' "$K8S_VERSION" > "\$r/kind/version"
"$node_bin/ctr" oci spec | python3 -c '
import json, sys
spec = json.load(sys.stdin)
spec.setdefault("hooks", {}).setdefault("createContainer", []).append({"path": "/kind/bin/mount-product-files.sh"})
spec["process"].pop("rlimits", None)
json.dump(spec, sys.stdout, indent=2)' > "\$r/etc/containerd/cri-base.json"
find "\$r/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
rm -f "\$r"/lib/systemd/system/multi-user.target.wants/* "\$r"/etc/systemd/system/*.wants/* \
  "\$r"/lib/systemd/system/local-fs.target.wants/* "\$r"/lib/systemd/system/sockets.target.wants/*udev* \
  "\$r"/lib/systemd/system/sockets.target.wants/*initctl* "\$r"/lib/systemd/system/basic.target.wants/*
echo "ReadKMsg=no" >> "\$r/etc/systemd/journald.conf"
ln -sf /usr/lib/systemd/systemd "\$r/sbin/init"
chroot "\$r" systemctl enable kubelet.service containerd.service undo-mount-hacks.service
chroot "\$r" systemctl mask systemd-binfmt.service
HOOK
chmod +x "$tmp/customize.sh"
mmdebstrap --quiet --variant=minbase \
  --include=systemd,dbus,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,procps,bash,ca-certificates,runc,jq,e2fsprogs \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook="$tmp/customize.sh \"\$1\"" \
  --format=tar bookworm "$tmp/rootfs.tar" "$sources" >&2

# 2. The component images.
echo "[kind] component images ..." >&2
scratch_image() {  # name, binary, entrypoint path
  local name="$1" binary="$2" path="$3" layer="$tmp/layer"
  rm -rf "$layer" && mkdir -p "$layer/$(dirname "$path")" "$layer/tmp" && chmod 1777 "$layer/tmp"
  install -m 0755 "$binary" "$layer/$path"
  tar -C "$layer" --owner=0 --group=0 --numeric-owner -cf "$tmp/layer.tar" .
  pm import --quiet --change "ENTRYPOINT [\"$path\"]" \
    --change "ENV PATH=/usr/local/bin:/usr/bin:/bin" "$tmp/layer.tar" "$name" >/dev/null
  echo "$name"
}
images=(
  "$(scratch_image "registry.k8s.io/kube-apiserver:$K8S_VERSION" "$cp_bin/kube-apiserver" /usr/local/bin/kube-apiserver)"
  "$(scratch_image "registry.k8s.io/kube-controller-manager:$K8S_VERSION" "$cp_bin/kube-controller-manager" /usr/local/bin/kube-controller-manager)"
  "$(scratch_image "registry.k8s.io/kube-scheduler:$K8S_VERSION" "$cp_bin/kube-scheduler" /usr/local/bin/kube-scheduler)"
  "$(scratch_image "registry.k8s.io/etcd:$ETCD_TAG" "$cp_bin/etcd" /usr/local/bin/etcd)"
  "$(scratch_image "registry.k8s.io/coredns/coredns:v1.14.6" "$tools/coredns" /coredns)"
  "$(scratch_image "$PAUSE_IMAGE" "$node_bin/pause" /pause)"
)
mmdebstrap --quiet --variant=minbase --include=iptables,nftables,conntrack \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook="install -m 0755 $node_bin/kube-proxy \"\$1/usr/local/bin/kube-proxy\"" \
  --format=tar bookworm "$tmp/kube-proxy.tar" "$sources" >&2
pm import --quiet --change 'ENTRYPOINT ["/usr/local/bin/kube-proxy"]' \
  "$tmp/kube-proxy.tar" "registry.k8s.io/kube-proxy:$K8S_VERSION" >/dev/null
images+=("registry.k8s.io/kube-proxy:$K8S_VERSION")
pm save --quiet --multi-image-archive --format docker-archive -o "$tmp/images/components.tar" "${images[@]}"
pm rmi "${images[@]}" >/dev/null

# 3. The node image: the root filesystem with the component images in its containerd.
echo "[kind] node image: importing the components into the node's containerd ..." >&2
base="localhost/rollout-kind-base:$key"
pm import --quiet "$tmp/rootfs.tar" "$base" >/dev/null
builder="rollout-kind-build-$key"
pm rm --force --ignore "$builder" >/dev/null
cleanup() { pm rm --force --ignore "$builder" >/dev/null 2>&1 || true; pm rmi --force "$base" >/dev/null 2>&1 || true; }
trap cleanup EXIT
pm run --detach --name "$builder" --network none --privileged --entrypoint /usr/local/bin/containerd \
  -v "$tmp/images:/import:ro" "$base" >/dev/null
deadline=$((SECONDS + 60))
until pm exec "$builder" ctr version >/dev/null 2>&1; do
  [ $SECONDS -lt $deadline ] || { pm logs "$builder" >&2; echo "error: containerd in the build container did not answer within 60 s" >&2; exit 1; }
done
pm exec "$builder" ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned \
  --all-platforms --no-unpack --digests /import/components.tar >&2
pm exec "$builder" ctr --namespace=k8s.io images ls -q >&2
pm stop --time 10 "$builder" >/dev/null
pm commit --quiet \
  --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' --change 'CMD []' \
  --change 'ENV container=docker' --change 'STOPSIGNAL SIGRTMIN+3' \
  "$builder" "$NODE_IMAGE" >/dev/null
rm -rf "$dir"; mv "$tmp" "$dir"; rm -f "$dir/rootfs.tar" "$dir/kube-proxy.tar" "$dir/layer.tar"; rm -rf "$dir/layer"
# Only the newest node image stays (1.1 GB each); its component archive beside it.
for old in $(pm images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/rollout-kind-node:' | grep -v ":$key\$"); do
  pm rmi "$old" >/dev/null 2>&1 || true
  rm -rf "$kind_cache/node-${old##*:}"
done
echo "[kind] node image: $NODE_IMAGE built in $((SECONDS - start)) s ($(pm image inspect --format '{{.Size}}' "$NODE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))" >&2
echo "$NODE_IMAGE"
