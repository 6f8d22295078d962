#!/usr/bin/env bash
# Builds (once per machine) a Gym virtual environment for one NeMo Gym release the adapter
# supports (docs/gym.md, "Gym releases"), the first argument:
#   0.4 (default)  nemo-gym 0.4.0 on Python >= 3.12: gym/requirements.txt, every dependency
#                  pinned by gym/constraints.txt;
#   0.7            nemo-gym 0.7.0 on Python 3.13: gym/requirements-0.7.txt, pinned by
#                  gym/constraints-0.7.txt. nemo-gym 0.7.0 declares Requires-Python >= 3.13.14;
#                  on an older 3.13 it alone is installed with that check overridden (pip's
#                  --ignore-requires-python, without dependencies), then everything else with
#                  the check on, so no other package is let past its own Requires-Python.
# and a layer over it with this checkout's SDK (`rollout-protocol[serve]`, protocol/) and the Gym
# adapter (`rollout-gym`, gym/) installed, as a user's image would have them (docs/gym.md).
#
# Two levels, both cached under $ROLLOUT_GYM_CACHE (default ~/.cache/rollout-gym):
#   base-<key>/   nemo-gym and its dependencies (base-0.7-<key>/ for 0.7); <key> digests the
#                 Python version, the release's two pin files and its recipe. The cold build is
#                 the slow part (Ray, MLflow, wandb).
#   venv-<key>/   a small venv whose site-packages reaches the base's through a .pth file, with
#                 the SDK and the adapter installed (no dependencies; venv-0.7-<key>/ for 0.7);
#                 <key> adds the digest of their sources, so a change to them costs seconds, not
#                 a new base.
# Prints the layer's directory as its last line. Python: for 0.4 $GYM_PYTHON, else the first
# python3.12 (or python3.13) that runs, on PATH or under pyenv's versions; for 0.7
# $GYM_PYTHON_0_7, else the first python3.13 that runs, likewise.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"

release="${1:-0.4}"
case "$release" in
  0.4)
    # the names and the recipe of the first release's base are unchanged, so its cache holds
    requirements="$here/requirements.txt" constraints="$here/constraints.txt"
    candidates=("${GYM_PYTHON:-}" python3.12 python3.13)
    pyenv_glob='3.1[23]*' minimum='3, 12' variable=GYM_PYTHON recipe=1 tag=""
    ;;
  0.7)
    requirements="$here/requirements-0.7.txt" constraints="$here/constraints-0.7.txt"
    candidates=("${GYM_PYTHON_0_7:-}" python3.13)
    pyenv_glob='3.13*' minimum='3, 13' variable=GYM_PYTHON_0_7 recipe=1 tag="0.7-"
    ;;
  *)
    echo "error: gym/build-venv.sh builds nemo-gym 0.4 or 0.7 (docs/gym.md), not '$release'" >&2
    exit 2
    ;;
esac

find_python() {
  local candidate
  for candidate in "${candidates[@]}" \
    "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/$pyenv_glob/bin/python3; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c "import sys; sys.exit(sys.version_info < ($minimum))" >/dev/null 2>&1; then
      command -v "$candidate" || echo "$candidate"
      return 0
    fi
  done
  echo "error: the Gym $release virtual environment needs Python >= ${minimum/, /.} (nemo-gym $release requires it); set $variable" >&2
  return 2
}

py="$(find_python)"
version="$("$py" -c 'import sys; print(".".join(map(str, sys.version_info[:3])))')"
cache="${ROLLOUT_GYM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-gym}"
# Bump a release's recipe when its base's build commands below change (the key leaves this
# script out, so that editing the rest of it does not rebuild the base).
base_key="$({ if [ -n "$tag" ]; then echo "$release"; fi; echo "$version $recipe"; uname -m; cat "$requirements" "$constraints"; } \
  | sha256sum | cut -c1-16)"
base="$cache/base-$tag$base_key"
# the sources the layer installs: tracked and untracked files of the two packages, by content
src_key="$(cd "$repo" && { echo "$base_key"; find protocol/pyproject.toml protocol/rollout_protocol gym/pyproject.toml gym/rollout_gym \
  -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-16)"
layer="$cache/venv-$tag$src_key"

# one build at a time per cache (make test's workers, several checkouts of one machine)
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock -w 1800 9 || { echo "[gym] another build holds $cache/.lock for 30 minutes" >&2; exit 1; }

if [ ! -f "$base/.complete" ]; then
  echo "[gym] building the NeMo Gym $release environment on Python $version (first build on this machine: minutes; log: $base.log) ..." >&2
  start=$SECONDS
  rm -rf "$base"
  {
    "$py" -m venv "$base"
    "$base/bin/python" -m pip install --quiet --upgrade pip
    if [ "$release" = 0.7 ] && ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 13, 14))'; then
      echo "nemo-gym 0.7.0 declares Requires-Python >= 3.13.14: installed on $version with that check overridden"
      "$base/bin/python" -m pip install --quiet --no-deps --ignore-requires-python nemo-gym -c "$constraints"
    fi
    "$base/bin/python" -m pip install --quiet -r "$requirements" -c "$constraints"
  } >"$base.log" 2>&1 || { echo "[gym] build failed; log: $base.log" >&2; tail -n 30 "$base.log" >&2; exit 1; }
  touch "$base/.complete"
  echo "[gym] NeMo Gym $release environment built in $((SECONDS - start)) s ($base)" >&2
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
# this release's layers of sources no longer checked out, bases of older pins: keep the newest
# eight and two (the 16 characters of a key: one release's never match another's)
keys='????????????????'
ls -1dt "$cache"/venv-$tag$keys/ 2>/dev/null | tail -n +9 | while read -r old; do rm -rf "$old" "${old%/}.log"; done
ls -1dt "$cache"/base-$tag$keys/ 2>/dev/null | tail -n +3 | while read -r old; do rm -rf "$old" "${old%/}.log"; done
echo "$layer"
