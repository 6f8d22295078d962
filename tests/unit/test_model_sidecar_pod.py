"""The model role as a two-container pod (an inference server plus `rollout-server model
--backend openai` as the participant), without a cluster: the operator sees a pod with one dead
container as lost, the two example manifests build the pods they document, and the builtin
engine continues its own output under `continue_final_message` as vLLM does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from rollout_operator.decide.resources import control_port, participant_pod
from rollout_operator.decide.setplan import PodView
from rollout_operator.flows.recovery import detect_loss
from rollout_operator.model import api
from rollout_operator.model.reasons import Reason
from rollout_protocol import Role
from rollout_servers.servers.backends import BuiltinBackend, builtin_completion
from rollout_servers.servers.generation import Continuation, GenRequest, Progress
from rollout_servers.tasks import shipped_tasks
from testsupport import builders

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model-sidecar"
QUESTION = next(t for t in shipped_tasks() if len(t.steps) == 2).question


# --- the operator: a pod with one container gone ------------------------------------------------


def sidecar_pod(*, exited: bool, terminating: bool = False) -> dict[str, Any]:
    """A model pod of attempt 2 whose inference container exited while the sidecar runs."""
    inference: dict[str, Any] = {"running": {"startedAt": "2026-11-29T12:00:00Z"}}
    if exited:
        inference = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    meta: dict[str, Any] = {
        "name": "rl-model-0-a2",
        "labels": {
            api.LABEL_SET: "rl",
            api.LABEL_ROLE: "model",
            api.LABEL_INDEX: "0",
            api.LABEL_ATTEMPT: "2",
        },
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-11-29T12:01:00Z"
    return {
        "metadata": meta,
        "status": {
            "phase": "Running",  # what Kubernetes reports while any container runs
            "podIP": "127.0.3.1",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [
                {"name": "inference", "state": inference},
                {"name": "checkpoint-sidecar", "state": {"running": {}}},
            ],
        },
    }


def view(pod: dict[str, Any]) -> PodView:
    out = PodView.from_pod(pod)
    assert out is not None
    return out


def model_set() -> api.RolloutSet:
    return builders.rollout_set(
        generation=2, roles={"model": None}, port=9000, status={"attempt": 2, "createdAttempt": 2}
    )


def test_a_running_pod_with_a_dead_container_is_lost_and_says_which() -> None:
    pod = view(sidecar_pod(exited=True))
    assert pod.phase == "Running"
    assert pod.finished
    assert not pod.live
    assert pod.problem == "Running: container inference exited with code 137 (OOMKilled)"
    loss = detect_loss(model_set(), [pod], {}, set())
    assert loss is not None
    assert loss.reason == Reason.POD_FAILED
    assert "container inference exited with code 137" in loss.message


def test_both_containers_running_is_not_a_loss() -> None:
    pod = view(sidecar_pod(exited=False))
    assert not pod.finished
    assert detect_loss(model_set(), [pod], {}, set()) is None


def test_a_container_stopping_in_a_deleted_pod_leaves_the_eviction_checkpoint_alone() -> None:
    """On SIGTERM the inference server may exit while the sidecar serves the eviction
    checkpoint: the pod is terminating, not failed, and held while that checkpoint runs."""
    pod = view(sidecar_pod(exited=True, terminating=True))
    assert not pod.finished
    assert detect_loss(model_set(), [pod], {}, set(), frozenset({pod.name})) is None
    loss = detect_loss(model_set(), [pod], {}, set())
    assert loss is not None
    assert loss.reason == Reason.POD_DELETED


# --- the manifests ------------------------------------------------------------------------------


def load(name: str) -> api.RolloutSet:
    obj = yaml.safe_load((EXAMPLES / name).read_text())
    obj["metadata"].update({"namespace": "ns", "uid": "u"})
    return api.RolloutSet.model_validate(obj)


def model_containers(rset: api.RolloutSet) -> dict[str, dict[str, Any]]:
    participant = rset.spec.participant(Role.MODEL)
    assert participant is not None
    pod = participant_pod(rset, participant, 0, 1, {})
    return {c["name"]: c for c in pod["spec"]["containers"]}


def arg_after(container: dict[str, Any], flag: str) -> str:
    args: list[str] = container["args"]
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{container['name']} has no {flag}: {args}")


def port_named(container: dict[str, Any], name: str) -> int | None:
    ports = [p["containerPort"] for p in container.get("ports") or [] if p.get("name") == name]
    return ports[0] if ports else None


def check_shape(rset: api.RolloutSet, upstream_host: str) -> dict[str, dict[str, Any]]:
    """Two containers; the sidecar owns the control port and relays to the other one's port on
    `upstream_host`; the operator's env and the storage mount reach both."""
    participant = rset.spec.participant(Role.MODEL)
    assert participant is not None
    containers = model_containers(rset)
    assert len(containers) == 2
    sidecar = containers.pop("checkpoint-sidecar")
    ((_, server),) = containers.items()
    assert sidecar["command"] == ["rollout-server", "model"]
    assert arg_after(sidecar, "--backend") == "openai"
    assert control_port(participant.template) == port_named(sidecar, "control")
    assert port_named(server, "control") is None
    upstream_port = port_named(server, "inference")
    assert arg_after(sidecar, "--upstream-url") == f"http://{upstream_host}:{upstream_port}"
    assert str(upstream_port) == arg_after(server, "--port")
    for container in (sidecar, server):
        names = {e["name"] for e in container["env"]}
        assert {"ROLLOUT_POD_IP", "ROLLOUT_CONTROL_TOKEN", "ROLLOUT_ATTEMPT"} <= names
        assert {"mountPath": rset.spec.storage.path, "name": "rollout-checkpoints"} in container[
            "volumeMounts"
        ]
        assert container["readinessProbe"]["httpGet"]["port"] in ("control", "inference")
    return {"sidecar": sidecar, "server": server}


def test_the_devcluster_example_binds_the_pod_ip_in_both_containers() -> None:
    shape = check_shape(load("rolloutset.yaml"), "$(ROLLOUT_POD_IP)")
    server = shape["server"]
    assert server["command"] == ["rollout-server", "model"]
    assert arg_after(server, "--backend") == "builtin"
    assert arg_after(server, "--host") == "$(ROLLOUT_POD_IP)"
    assert arg_after(shape["sidecar"], "--host") == "$(ROLLOUT_POD_IP)"


def test_the_vllm_example_keeps_vllm_private_to_the_pod() -> None:
    rset = load("vllm.yaml")
    shape = check_shape(rset, "127.0.0.1")
    vllm, sidecar = shape["server"], shape["sidecar"]
    assert vllm["command"] == ["vllm", "serve"]
    assert arg_after(vllm, "--host") == "127.0.0.1"
    assert int(arg_after(vllm, "--max-model-len")) > 0
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(sidecar.get("resources"))
    for probe in ("startupProbe", "readinessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "inference"}
    startup = vllm["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert rset.spec.recovery.restore_timeout_seconds >= budget  # a recovery outlasts loading
    served = arg_after(vllm, "--served-model-name")
    assert arg_after(sidecar, "--model-name") == served
    agent = rset.spec.participant(Role.AGENT)
    assert agent is not None
    assert served in agent.template.spec.containers[0].model_extra["args"]  # type: ignore[index]


# --- the builtin engine as an upstream ----------------------------------------------------------


async def collect(backend: BuiltinBackend, request: GenRequest) -> list[str]:
    return [piece.text async for piece in backend.stream(request, Progress()) if piece.text]


def chat(prompt: str, max_tokens: int, continuation: Continuation | None = None) -> GenRequest:
    return GenRequest(
        kind="chat",
        body={},
        prompt_text=prompt,
        max_tokens=max_tokens,
        seed=5,
        stream=True,
        continuation=continuation,
    )


async def test_continue_final_message_goes_on_with_the_engines_own_output() -> None:
    backend = BuiltinBackend(0.0, 0.25)
    prompt = "user: " + QUESTION
    whole, reason = builtin_completion(prompt, 5, 64, 0.25)
    assert reason == "stop"
    assert len(whole) > 4
    for cut in (1, 3, len(whole) - 1):
        prefix = "".join(whole[:cut])
        full = prompt + "\nassistant: " + prefix
        tail = await collect(
            backend, chat(full, 64 - cut, Continuation(prompt_text=prompt, prefix=prefix))
        )
        assert tail == whole[cut:], cut
    # max_tokens counts the new tokens only, as in vLLM
    prefix = "".join(whole[:2])
    short = chat(prompt, 2, Continuation(prompt_text=prompt, prefix=prefix))
    assert await collect(backend, short) == whole[2:4]


async def test_a_final_message_not_its_own_is_a_plain_prompt() -> None:
    backend = BuiltinBackend(0.0, 0.25)
    prompt = "user: " + QUESTION
    full = prompt + "\nassistant: Something else entirely."
    request = chat(full, 64, Continuation(prompt_text=prompt, prefix=" Something else entirely."))
    assert await collect(backend, request) == builtin_completion(full, 5, 64, 0.25)[0]
