#!/usr/bin/env bash
# From `pip install nemo-gym==0.7.0` to a checkpointed set of a released 0.7 environment (the
# weather tool call, from its own Gym YAML) on devcluster, timed step by step (docs/gym.md, "From
# `pip install` to a set of a released 0.7 environment"). Run from the repository root after
# `make venv cluster-binaries`; it leaves nothing running (the cluster and the operator are
# stopped on exit). GYM_PYTHON_0_7: a Python 3.13 (default: python3.13, else pyenv's newest 3.13).
# PIP_ARGS: extra pip arguments (docs/gym.md's measurement used --no-cache-dir: every wheel
# downloaded).
#
# nemo-gym 0.7.0 declares Requires-Python >= 3.13.14. On an older 3.13 (this project's machines
# have 3.13.0) the script installs nemo-gym alone with that check overridden, as
# gym/build-venv.sh does, then everything with the check on; on 3.13.14 or later it does not.
set -euo pipefail

repo="$(pwd)"
work="$(mktemp -d /tmp/gym07-quickstart.XXXXXX)"
py="${GYM_PYTHON_0_7:-}"
if [ -z "$py" ]; then  # the first python3.13 that runs (a pyenv shim may not)
  for candidate in python3.13 $(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.13*/bin/python3 2>/dev/null | sort -rV); do
    if "$candidate" -c '' 2>/dev/null; then py="$candidate"; break; fi
  done
fi
"${py:-false}" -c '' 2>/dev/null || { echo "no Python 3.13 found: set GYM_PYTHON_0_7" >&2; exit 1; }
start=$SECONDS
mark() { echo "[quickstart] +$((SECONDS - start)) s: $*"; }

cleanup() {
  [ -n "${collect:-}" ] && kill "$collect" 2>/dev/null || true
  [ -n "${operator:-}" ] && kill "$operator" 2>/dev/null && wait "$operator" 2>/dev/null || true
  .venv/bin/python -m devcluster down --dir "$work/cluster" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# 1. what a Gym user installs: nemo-gym 0.7.0 from PyPI, the SDK and the adapter
"$py" -m venv "$work/venv"
pip=("$work/venv/bin/pip" install --quiet ${PIP_ARGS:-})
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 13, 14))'; then
  mark "Python $("$py" -c 'import platform; print(platform.python_version())') is older than nemo-gym 0.7.0's Requires-Python >= 3.13.14: its check overridden for nemo-gym alone"
  "${pip[@]}" --no-deps --ignore-requires-python nemo-gym==0.7.0
fi
"${pip[@]}" nemo-gym==0.7.0 "$repo/protocol[serve]" "$repo/gym"
mark "pip install done ($work/venv)"
rows="$("$work/venv/bin/python" -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('nemo_gym').origin).parents[1])")/resources_servers/example_single_tool_call/data/example.jsonl"

# 2. a cluster with the operator (devcluster here; `helm install` on a real one, docs/install.md)
.venv/bin/python -m devcluster up --dir "$work/cluster" >"$work/cluster.log" 2>&1
export KUBECONFIG="$work/cluster/kubeconfig" PATH="$repo/.bin/devcluster:$repo/.venv/bin:$PATH"
kubectl apply -f crds/ >/dev/null
rollout-operator run --namespace default >"$work/operator.log" 2>&1 &
operator=$!
mark "cluster and operator up"

# 3. the set: the example manifest with this venv as the Gym pods' environment
applied=$SECONDS
sed "s#/opt/gym-venv-0.7#$work/venv#; s#/tmp/rollout-checkpoints#$work/checkpoints#g" \
  examples/gym-0.7-environments/weather.yaml | kubectl apply -f - >/dev/null
kubectl wait --for=condition=Ready rolloutset/gym07-weather --timeout=300s >/dev/null
mark "RolloutSet gym07-weather Ready ($((SECONDS - applied)) s after kubectl apply)"

# 4. episodes from the environment's shipped rows, and a checkpoint while they run
rollout-collect --rollout-set gym07-weather --gym --tasks-file "$rows" \
  --rollouts-per-row 100 --concurrency 16 --out "$work/results.jsonl" 2>"$work/collect.log" &
collect=$!
# checkpoint once episodes run: a few finished, the others in flight
timeout 120 bash -c "until [ \"\$(cat '$work/results.jsonl' 2>/dev/null | wc -l)\" -ge 4 ]; do sleep 0.2; done"
kubectl apply -f - >/dev/null <<'EOF'
apiVersion: checkpoint.rollout.dev/v1alpha1
kind: RolloutCheckpoint
metadata: {name: gym07-weather-manual-1}
spec: {rolloutSet: gym07-weather, trigger: Manual}
EOF
kubectl wait --for=condition=Ready rolloutcheckpoint/gym07-weather-manual-1 --timeout=120s >/dev/null
mark "checkpoint Ready ($((SECONDS - applied)) s after kubectl apply): $(kubectl get rckpt gym07-weather-manual-1 -o jsonpath='{.status.episodes} captured, {.status.restarts} listed as restarts')"
wait "$collect"
collect=
mark "$(wc -l <"$work/results.jsonl") episodes finished, rewards: $(python3 -c '
import json,sys,collections
print(dict(collections.Counter(json.loads(l)["reward"] for l in open(sys.argv[1]))))' "$work/results.jsonl")"
