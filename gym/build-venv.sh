#!/usr/bin/env bash
# Builds (once per machine) the Gym virtual environment: Python >= 3.12 with `nemo-gym` from PyPI
# (gym/requirements.txt, every dependency pinned by gym/constraints.txt), and a layer over it
# with this checkout's SDK (`rollout-protocol[serve]`, protocol/) and the Gym adapter
# (`rollout-gym`, gym/) installed, as a user's image would have them (docs/gym.md).
#
# Two levels, both cached under $ROLLOUT_GYM_CACHE (default ~/.cache/rollout-gym):
#   base-<key>/   nemo-gym and its dependencies; <key> digests the Python version, the two pin
#                 files and BASE_RECIPE. The cold build is the slow part (Ray, MLflow, wandb).
#   venv-<key>/   a small venv whose site-packages reaches the base's through a .pth file, with
#                 the SDK and the adapter installed (no dependencies); <key> adds the digest of
#                 their sources, so a change to them costs seconds, not a new base.
# Prints the layer's directory as its last line. Python: $GYM_PYTHON, else the first python3.12
# (or python3.13) that runs, on PATH or under pyenv's versions.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"

find_python() {
  local candidate
  for candidate in "${GYM_PYTHON:-}" python3.12 python3.13 \
    "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.1[23]*/bin/python3; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      command -v "$candidate" || echo "$candidate"
      return 0
    fi
  done
  echo "error: the Gym virtual environment needs Python >= 3.12 (nemo-gym requires it); set GYM_PYTHON" >&2
  return 2
}

py="$(find_python)"
version="$("$py" -c 'import sys; print(".".join(map(str, sys.version_info[:3])))')"
cache="${ROLLOUT_GYM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-gym}"
# Bump BASE_RECIPE when the base's build commands below change (the key leaves this script out,
# so that editing the rest of it does not rebuild the base).
BASE_RECIPE=1
base_key="$({ echo "$version $BASE_RECIPE"; uname -m; cat "$here/requirements.txt" "$here/constraints.txt"; } \
  | sha256sum | cut -c1-16)"
base="$cache/base-$base_key"
# the sources the layer installs: tracked and untracked files of the two packages, by content
src_key="$(cd "$repo" && { echo "$base_key"; find protocol/pyproject.toml protocol/rollout_protocol gym/pyproject.toml gym/rollout_gym \
  -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-16)"
layer="$cache/venv-$src_key"

# one build at a time per cache (make test's workers, several checkouts of one machine)
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock -w 1800 9 || { echo "[gym] another build holds $cache/.lock for 30 minutes" >&2; exit 1; }

if [ ! -f "$base/.complete" ]; then
  echo "[gym] building the NeMo Gym environment on Python $version (first build on this machine: minutes; log: $base.log) ..." >&2
  start=$SECONDS
  rm -rf "$base"
  {
    "$py" -m venv "$base"
    "$base/bin/python" -m pip install --quiet --upgrade pip
    "$base/bin/python" -m pip install --quiet -r "$here/requirements.txt" -c "$here/constraints.txt"
  } >"$base.log" 2>&1 || { echo "[gym] build failed; log: $base.log" >&2; tail -n 30 "$base.log" >&2; exit 1; }
  touch "$base/.complete"
  echo "[gym] NeMo Gym environment built in $((SECONDS - start)) s ($base)" >&2
fi

if [ ! -f "$layer/.complete" ]; then
  rm -rf "$layer"
  {
    "$py" -m venv --without-pip "$layer"
    base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    layer_site="$("$layer/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$base_site" > "$layer_site/nemo-gym-base.pth"
    # the base's pip, run by the layer's interpreter, installs into the layer
    "$layer/bin/python" -m pip install --quiet --no-deps --no-build-isolation "$repo/protocol" "$repo/gym"
  } >"$layer.log" 2>&1 || { echo "[gym] layer failed; log: $layer.log" >&2; tail -n 30 "$layer.log" >&2; exit 1; }
  touch "$layer/.complete"
  echo "[gym] SDK and adapter installed ($layer)" >&2
fi
# layers of sources no longer checked out, bases of older pins: keep the newest eight and two
ls -1dt "$cache"/venv-*/ 2>/dev/null | tail -n +9 | while read -r old; do rm -rf "$old" "${old%/}.log"; done
ls -1dt "$cache"/base-*/ 2>/dev/null | tail -n +3 | while read -r old; do rm -rf "$old" "${old%/}.log"; done
echo "$layer"
