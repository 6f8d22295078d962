#!/usr/bin/env bash
# From `pip install` to a running, checkpointed NeMo Gym environment on devcluster, timed step by
# step (docs/gym.md, "From pip install to a checkpointed set"). Run from the repository root after
# `make venv cluster-binaries`; it leaves nothing running (the cluster and the operator are
# stopped on exit). GYM_PYTHON: a Python >= 3.12 (default: python3.12). PIP_ARGS: extra pip
# arguments (the measurement in docs/gym.md used --no-cache-dir: every wheel downloaded).
set -euo pipefail

repo="$(pwd)"
work="$(mktemp -d /tmp/gym-quickstart.XXXXXX)"
py="${GYM_PYTHON:-python3.12}"
start=$SECONDS
mark() { echo "[quickstart] +$((SECONDS - start)) s: $*"; }

cleanup() {
  [ -n "${collect:-}" ] && kill "$collect" 2>/dev/null || true
  [ -n "${operator:-}" ] && kill "$operator" 2>/dev/null && wait "$operator" 2>/dev/null || true
  .venv/bin/python -m devcluster down --dir "$work/cluster" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# 1. what a Gym user installs: nemo-gym from PyPI, the SDK and the adapter
"$py" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet ${PIP_ARGS:-} nemo-gym==0.4.0 "$repo/protocol[serve]" "$repo/gym"
mark "pip install done ($work/venv)"

# 2. a cluster with the operator (devcluster here; `helm install` on a real one, docs/install.md)
.venv/bin/python -m devcluster up --dir "$work/cluster" >"$work/cluster.log" 2>&1
export KUBECONFIG="$work/cluster/kubeconfig" PATH="$repo/.bin/devcluster:$repo/.venv/bin:$PATH"
kubectl apply -f crds/ >/dev/null
rollout-operator run --namespace default >"$work/operator.log" 2>&1 &
operator=$!
mark "cluster and operator up"

# 3. the set: the example manifest with this venv as the Gym pods' environment
sed "s#/opt/gym-venv#$work/venv#; s#/tmp/rollout-checkpoints#$work/checkpoints#g" \
  examples/gym-environment/rolloutset.yaml | kubectl apply -f - >/dev/null
kubectl wait --for=condition=Ready rolloutset/gym-counter --timeout=180s >/dev/null
mark "RolloutSet gym-counter Ready"

# 4. episodes from the Gym dataset rows, and a checkpoint while they run
rollout-collect --rollout-set gym-counter --tasks-file examples/gym-environment/tasks.jsonl \
  --rollouts-per-row 8 --concurrency 16 --out "$work/results.jsonl" 2>"$work/collect.log" &
collect=$!
# checkpoint once episodes run: a few finished, the others in flight
timeout 120 bash -c "until [ \"\$(cat '$work/results.jsonl' 2>/dev/null | wc -l)\" -ge 4 ]; do sleep 0.2; done"
kubectl apply -f - >/dev/null <<'EOF'
apiVersion: checkpoint.rollout.dev/v1alpha1
kind: RolloutCheckpoint
metadata: {name: gym-counter-manual-1}
spec: {rolloutSet: gym-counter, trigger: Manual}
EOF
kubectl wait --for=condition=Ready rolloutcheckpoint/gym-counter-manual-1 --timeout=120s >/dev/null
mark "checkpoint Ready: $(kubectl get rckpt gym-counter-manual-1 -o jsonpath='{.status.episodes} episodes captured')"
wait "$collect"
collect=
mark "$(wc -l <"$work/results.jsonl") episodes finished, rewards: $(python3 -c '
import json,sys,collections
print(dict(collections.Counter(json.loads(l)["reward"] for l in open(sys.argv[1]))))' "$work/results.jsonl")"
