#!/usr/bin/env bash
# Builds the project's image from its Dockerfile with buildah (a daemonless OCI builder from
# Debian's packages) on the local Debian base that build-base.sh makes, and caches it as an OCI
# archive under $ROLLOUT_IMAGE_CACHE/<key>/ (default ~/.cache/rollout-images), where <key> is a
# digest of every build input: the Dockerfile and .dockerignore, the build context the Dockerfile
# copies (pyproject.toml, README.md, operator/, servers/, protocol/ without bytecode), the base
# recipe's key, this script and buildah's version. The image is rebuilt only when one changes.
#
#   image/build.sh            build (or find cached) and print a summary; last line: the cache dir
#
# The cache dir holds build.log, image.oci.tar (named $ROLLOUT_IMAGE_NAME inside, default
# docker.io/library/rollout-checkpoint-operator:dev, the name the kubelet resolves the chart's
# and examples' `rollout-checkpoint-operator:dev` to) and image.json (name, manifest digest,
# image id, sizes, build time, input key).
#
# How the build runs here: as root without a daemon; storage driver overlay under the cache dir
# (a mount namespace of its own, so no mount outlives the build); RUN steps with chroot
# isolation on the host network (pip in the Dockerfile installs from the package index). If this
# machine trusts extra certificate authorities (a TLS-inspecting proxy), its CA bundle and a
# pip.conf pointing at it are mounted into RUN steps only: nothing of it lands in the image.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"

# A private mount namespace: buildah's overlay mounts end with this script, even when it fails.
if [ -z "${_ROLLOUT_IMAGE_MOUNT_NS:-}" ]; then
  exec env _ROLLOUT_IMAGE_MOUNT_NS=1 unshare --mount --propagation private -- "$0" "$@"
fi

# buildah on the project's own containers.conf (runc), never the machine's: image/containers.conf.
export CONTAINERS_CONF="$here/containers.conf"
IMAGE_NAME="${ROLLOUT_IMAGE_NAME:-docker.io/library/rollout-checkpoint-operator:dev}"
cache_root="${ROLLOUT_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-images}"
ca_bundle="${ROLLOUT_IMAGE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

for tool in buildah python3 sha256sum; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "error: $tool is not installed; 'make image' installs buildah and mmdebstrap (apt-get)." >&2
    exit 2
  fi
done

mkdir -p "$cache_root"
# One build at a time per cache (two test sessions may ask at once).
exec 9>"$cache_root/.lock"
flock 9

base_dir="$("$here/build-base.sh" | tail -n 1)"
base_key="${base_dir##*/base-}"
base_image="localhost/rollout-base:$base_key"

context_digest() {  # the files the Dockerfile copies, as .dockerignore lets them through
  (cd "$root" && find pyproject.toml README.md operator servers protocol -type f \
      -not -path '*/__pycache__/*' -not -name '*.pyc' -not -path '*.egg-info/*' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum)
}
key="$( { cat "$here/build.sh" "$root/Dockerfile" "$root/.dockerignore"; echo "$base_key";
          echo "$IMAGE_NAME"; buildah --version; context_digest; } | sha256sum | cut -c1-16)"
dir="$cache_root/$key"

summary() {
  python3 - "$dir/image.json" <<'EOF'
import json, sys
info = json.load(open(sys.argv[1]))
print(f"[image] {info['name']}")
print(f"[image]   digest  {info['digest']}   (image id {info['id']})")
print(f"[image]   size    {info['size_bytes'] / 1e6:.0f} MB unpacked, "
      f"{info['archive_bytes'] / 1e6:.0f} MB archive ({info['archive']})")
print(f"[image]   built   in {info['build_seconds']} s from inputs {info['inputs']} "
      f"on base {info['base']}")
EOF
}

if [ -s "$dir/image.oci.tar" ] && [ -s "$dir/image.json" ]; then
  echo "[image] cached ($dir)" >&2
  summary >&2
  echo "$dir"
  exit 0
fi

storage=(--root "$cache_root/storage" --runroot "$cache_root/run" --storage-driver overlay)
cleanup() { buildah "${storage[@]}" rm --all >/dev/null 2>&1 || true; }
trap cleanup EXIT

start=$SECONDS
if ! buildah "${storage[@]}" inspect --type image "$base_image" >/dev/null 2>&1; then
  echo "[image] base: importing $base_image" >&2
  buildah "${storage[@]}" bud --quiet --isolation chroot -f "$base_dir/Containerfile" \
    -t "$base_image" "$base_dir" >&2
fi

trust=()
if [ -s "$ca_bundle" ]; then
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$cache_root/pip.conf"
  trust=(-v "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro" -v "$cache_root/pip.conf:/etc/pip.conf:ro")
fi

echo "[image] building $IMAGE_NAME from Dockerfile on $base_image (takes a minute or more) ..." >&2
tmp="$cache_root/.$key.tmp"
rm -rf "$tmp"
mkdir -p "$tmp"
# The builder's output goes to build.log in the cache dir (its tail is shown if the build fails).
if ! buildah "${storage[@]}" bud --isolation chroot --network host "${trust[@]}" \
    --build-arg "PYTHON_IMAGE=$base_image" -f "$root/Dockerfile" -t "$IMAGE_NAME" "$root" \
    > "$tmp/build.log" 2>&1; then
  tail -n 40 "$tmp/build.log" >&2
  echo "error: the image build failed; the whole log is $tmp/build.log" >&2
  exit 1
fi
image_id="$(buildah "${storage[@]}" inspect --type image --format '{{.FromImageID}}' "$IMAGE_NAME")"
size="$(buildah "${storage[@]}" images --json "$IMAGE_NAME" | python3 -c '
import json, sys
units = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9}
number, unit = json.load(sys.stdin)[0]["size"].split()
print(int(float(number) * units[unit]))')"
buildah "${storage[@]}" push --quiet --digestfile "$tmp/digest" "$IMAGE_NAME" \
  "oci-archive:$tmp/image.oci.tar:$IMAGE_NAME" >&2
# The archive is the cache; the storage keeps only the base (the next build starts from it).
buildah "${storage[@]}" rmi "$IMAGE_NAME" >/dev/null
buildah "${storage[@]}" rmi --prune >/dev/null 2>&1 || true

python3 - "$tmp" "$IMAGE_NAME" "$image_id" "$size" "$key" "$base_key" "$((SECONDS - start))" <<'EOF'
import json, os, sys
tmp, name, image_id, size, key, base_key, seconds = sys.argv[1:]
json.dump({
    "name": name,
    "digest": open(os.path.join(tmp, "digest")).read().strip(),
    "id": "sha256:" + image_id if not image_id.startswith("sha256:") else image_id,
    "archive": "image.oci.tar",
    "archive_bytes": os.path.getsize(os.path.join(tmp, "image.oci.tar")),
    "size_bytes": int(size),
    "inputs": key,
    "base": base_key,
    "build_seconds": int(seconds),
}, open(os.path.join(tmp, "image.json"), "w"), indent=2)
EOF
rm -f "$tmp/digest"
rm -rf "$dir"
mv "$tmp" "$dir"
# Keep the three newest builds (a checkout that moves between branches finds them); older ones go.
find "$cache_root" -mindepth 1 -maxdepth 1 -type d -regextype posix-extended \
    -regex '.*/[0-9a-f]{16}' -printf '%T@ %p\n' \
  | sort -rn | tail -n +4 | cut -d' ' -f2- | while read -r old; do rm -rf "$old"; done
summary >&2
echo "$dir"
