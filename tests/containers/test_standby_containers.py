"""Standby pods on a real kubelet (docs/design.md#62-recovery): a model container SIGKILLed with a
model standby.

The operator runs as the chart installs it, the four reference servers and a model standby as
containers of the image. A trainer's `rollout-collect --rollout-set` runs episodes, a manual
checkpoint is taken while they run, and the model container's process is SIGKILLed. The
recovery (InPlace) adopts the standby: the model instance's pod is then the standby's (same
UID), which restores the checkpoint; every episode finishes exactly once. A replacement standby
starts under attempt 2; SIGKILLed while idle, it is replaced with no recovery.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from container_support import collected, condition, describe_pods, get_json, kubectl_apply

from devcluster.waiting import wait_for_sync
from harness.objects import example_checkpoint, example_set
from harness.providers import ContainerClusterProvider

pytestmark = pytest.mark.timeout(900)

SET = "math-rl"
EPISODES = 24
CONCURRENCY = 8


def test_a_killed_model_container_resumes_in_the_adopted_model_standby(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    storage: Path,
    tmp_path: Path,
) -> None:
    namespace, cluster = operator_release, container_provider
    spec = {"standby": {"model": 1}, "recovery": {"restorePolicy": "InPlace"}}
    kubectl_apply(cluster, namespace, example_set(storage, spec=spec))

    def rset() -> dict[str, Any]:
        return get_json(cluster, "rolloutset", SET, "-n", namespace)

    def ready(attempt: int) -> bool:
        obj = rset()
        status = obj.get("status") or {}
        standby = status.get("standby") or {}
        return (
            status.get("attempt") == attempt
            and not status.get("recovery")
            and condition(obj, "Ready").get("status") == "True"
            and standby.get("ready") == 1
        )

    try:
        wait_for_sync(lambda: ready(1), 300, "the set Ready with its model standby")
    except Exception:
        print(describe_pods(cluster, namespace))
        raise
    before = rset()
    [spare] = before["status"]["standby"]["pods"]
    spare_uid = get_json(cluster, "pod", spare, "-n", namespace)["metadata"]["uid"]
    [model] = [p["pod"] for p in before["status"]["participants"] if p["role"] == "model"]

    out = tmp_path / "episodes.jsonl"
    collect = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "rollout-collect"),
            *("--rollout-set", SET, "--namespace", namespace),
            *("--tasks", str(EPISODES), "--concurrency", str(CONCURRENCY), "--seed", "11"),
            *("--out", str(out)),
        ],
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_sync(lambda: len(collected(out)) >= 1, 180, "the first finished episode")
        kubectl_apply(cluster, namespace, example_checkpoint("before-kill"))
        wait_for_sync(
            lambda: (
                condition(
                    get_json(cluster, "rolloutcheckpoint", "before-kill", "-n", namespace), "Ready"
                ).get("status")
                == "True"
            ),
            180,
            "the checkpoint Ready",
        )
        cluster.kill_container(namespace, model)
        wait_for_sync(lambda: ready(2), 300, "Ready at attempt 2 with a new standby")
        output, _ = collect.communicate(timeout=600)
        assert collect.returncode == 0, output[-4000:]
    finally:
        if collect.poll() is None:
            collect.kill()
            collect.wait()

    ids = [item["rollout_id"] for item in collected(out)]
    assert len(ids) == EPISODES, output[-2000:]
    assert len(set(ids)) == EPISODES, "an episode finished twice"
    after = rset()
    [adopted] = [p["pod"] for p in after["status"]["participants"] if p["role"] == "model"]
    assert adopted == spare, (adopted, spare)
    assert get_json(cluster, "pod", spare, "-n", namespace)["metadata"]["uid"] == spare_uid
    last = after["status"]["lastRecovery"]
    assert last["adopted"] == [f"model-0={spare}"], last
    assert last["checkpoint"] == "before-kill"

    # The replacement standby, SIGKILLed while idle, is replaced with no recovery.
    [replacement] = after["status"]["standby"]["pods"]
    assert replacement != spare
    cluster.kill_container(namespace, replacement)
    wait_for_sync(
        lambda: ready(2) and replacement not in rset()["status"]["standby"]["pods"],
        180,
        "the idle standby replaced",
    )
    assert rset()["status"]["attempt"] == 2, "an idle standby's loss is no recovery"


def test_after_a_template_change_no_stale_standby_is_adopted(
    container_provider: ContainerClusterProvider,
    operator_release: str,
    storage: Path,
) -> None:
    """The model template changes while the set runs: the standby made from the old template
    is deleted at once (the running pods stay, the change is refused for them until they are
    replaced), and when the model container is then SIGKILLed the recovery adopts nothing:
    every pod, the model's included, is made from the new template."""
    namespace, cluster = operator_release, container_provider
    spec = {"standby": {"model": 1}}
    kubectl_apply(cluster, namespace, example_set(storage, spec=spec))

    def rset() -> dict[str, Any]:
        return get_json(cluster, "rolloutset", SET, "-n", namespace)

    def standby_ready() -> bool:
        obj = rset()
        standby = (obj.get("status") or {}).get("standby") or {}
        return condition(obj, "Ready").get("status") == "True" and standby.get("ready") == 1

    wait_for_sync(standby_ready, 300, "the set Ready with its model standby")
    [stale] = rset()["status"]["standby"]["pods"]
    changed = example_set(storage, spec=spec)
    model = next(p for p in changed["spec"]["participants"] if p["role"] == "model")
    container = model["template"]["spec"]["containers"][0]
    container["env"] = [*container.get("env", []), {"name": "TEMPLATE", "value": "new"}]
    kubectl_apply(cluster, namespace, changed)

    def stale_gone() -> bool:
        pods = get_json(cluster, "pods", "-n", namespace)["items"]
        return stale not in {p["metadata"]["name"] for p in pods}

    wait_for_sync(stale_gone, 120, f"the stale standby {stale} deleted")
    [model_pod] = [p["pod"] for p in rset()["status"]["participants"] if p["role"] == "model"]
    cluster.kill_container(namespace, model_pod)

    def recovered() -> bool:
        obj = rset()
        status = obj.get("status") or {}
        return (
            status.get("attempt") == 2
            and not status.get("recovery")
            and condition(obj, "Ready").get("status") == "True"
        )

    wait_for_sync(recovered, 300, "Ready under attempt 2")
    after = rset()
    assert after["status"]["lastRecovery"]["adopted"] == [], after["status"]["lastRecovery"]
    [model_after] = [p["pod"] for p in after["status"]["participants"] if p["role"] == "model"]
    pod = get_json(cluster, "pod", model_after, "-n", namespace)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}
    assert env.get("TEMPLATE") == "new", "the model pod is made from the new template"
