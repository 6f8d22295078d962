"""The project's custom resources on a devcluster, as the harness writes and reads them.

Writing: `apply_crds` (applied and Established), `create_namespace` (ready for pods), the
example manifests (`example_set`, `example_checkpoint`, `with_storage` to move a set's storage to
a test folder) and `kubectl_apply`. Reading: `Resources` (the RolloutSet, its checkpoints and its
control token through kubernetes_asyncio, with waits on them) and the status predicates
`condition`, `is_true`, `phase_is` and `participants_by_role`.

The demo scenario, the e2e, adversarial and container tests and the benches all drive the same
examples through these; they live here rather than in the `make demo` script that uses them too.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import yaml
from kubernetes_asyncio import client as k8s
from rollout_operator.decide.resources import secret_name, token_from_secret
from rollout_operator.model.api import GROUP, ROLLOUT_CHECKPOINT_PLURAL, ROLLOUT_SET_PLURAL, VERSION

from devcluster.cluster import Cluster
from devcluster.waiting import wait_for, wait_for_sync

REPO: Final = Path(__file__).resolve().parents[1]
EXAMPLES: Final = REPO / "examples"
CRDS: Final = REPO / "crds"
SET_NAME: Final = "math-rl"


# --- manifests ------------------------------------------------------------------------------


def apply_crds(cluster: Cluster, crds: Path = CRDS) -> None:
    """Applies the CRDs in `crds` (this checkout's by default; a bench comparing with another
    commit passes that commit's) and waits until both are Established."""
    cluster.kubectl("apply", "-f", str(crds))
    wait_established(
        cluster, [f"crd/{ROLLOUT_SET_PLURAL}.{GROUP}", f"crd/{ROLLOUT_CHECKPOINT_PLURAL}.{GROUP}"]
    )


def wait_established(cluster: KubectlTarget, names: Sequence[str], timeout: float = 60) -> None:
    """Wait until every CRD of `names` (`crd/<name>`) is Established.

    Not `kubectl wait --for=condition=Established`: on a freshly created CRD whose status has
    no conditions yet it fails at once ("conditions accessor error") instead of waiting."""
    established = '{.status.conditions[?(@.type=="Established")].status}'

    def all_established() -> bool:
        return all(
            cluster.kubectl("get", name, "-o", f"jsonpath={established}", check=False).stdout
            == "True"
            for name in names
        )

    wait_for_sync(all_established, timeout, "the CRDs to be Established", interval=0.2)


class KubectlTarget(Protocol):
    """A devcluster `Cluster` or a `harness.providers` provider: what has their `kubectl`."""

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]: ...


def create_namespace(cluster: KubectlTarget, name: str) -> None:
    """A namespace whose default ServiceAccount exists (pods are refused before it does)."""
    cluster.kubectl("create", "namespace", name)
    wait_for_sync(
        lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        30,
        f"the default ServiceAccount of namespace {name}",
        interval=0.2,
    )


def delete_namespace(cluster: KubectlTarget, name: str) -> None:
    """Force-delete the namespace's pods, then the namespace, without waiting for either."""
    cluster.kubectl(
        "delete",
        "pods",
        "--all",
        "-n",
        name,
        "--force",
        "--grace-period=0",
        "--wait=false",
        check=False,
    )
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _load(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict), f"{path} is not one YAML object"
    return loaded


def with_storage(obj: dict[str, Any], storage_dir: Path) -> dict[str, Any]:
    """A RolloutSet manifest with its storage moved to `storage_dir`: a hostPath mounted at the
    same path (devcluster runs pods on this machine, so the records land exactly there)."""
    path = str(storage_dir)
    obj["spec"]["storage"] = {
        "path": path,
        "volume": {"hostPath": {"path": path, "type": "DirectoryOrCreate"}},
    }
    return obj


def example_set(
    storage_dir: Path,
    *,
    name: str = SET_NAME,
    extra_args: Mapping[str, Sequence[str]] | None = None,
    spec: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`examples/rolloutset.yaml` with its storage moved to `storage_dir` (devcluster mounts a
    hostPath at the same path, so the records land exactly there on this machine).

    `extra_args` appends server arguments per role (e.g. `--debug-hooks`); `spec` merges
    top-level spec fields (e.g. `recovery`).
    """
    obj = with_storage(_load(EXAMPLES / "rolloutset.yaml"), storage_dir)
    obj["metadata"]["name"] = name
    for participant in obj["spec"]["participants"]:
        more = list((extra_args or {}).get(participant["role"], ()))
        if more:
            container = participant["template"]["spec"]["containers"][0]
            container["args"] = [*container.get("args", []), *more]
    for key, value in (spec or {}).items():
        current = obj["spec"].get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            obj["spec"][key] = {**current, **value}
        else:
            obj["spec"][key] = value
    return obj


def example_checkpoint(name: str, set_name: str = SET_NAME) -> dict[str, Any]:
    obj = _load(EXAMPLES / "rolloutcheckpoint.yaml")
    obj["metadata"]["name"] = name
    obj["spec"]["rolloutSet"] = set_name
    return obj


def kubectl_apply(cluster: Cluster, namespace: str, obj: Mapping[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def condition(obj: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item.get("type") == type_:
            return dict(item)
    return None


def is_true(obj: Mapping[str, Any], type_: str) -> bool:
    found = condition(obj, type_)
    return found is not None and found.get("status") == "True"


# --- reading the custom resources -----------------------------------------------------------


class Resources:
    """The two custom resources of one namespace, read through kubernetes_asyncio."""

    def __init__(self, api: Any, namespace: str) -> None:
        self.custom = k8s.CustomObjectsApi(api)
        self.core = k8s.CoreV1Api(api)
        self.namespace = namespace

    async def rollout_set(self, name: str = SET_NAME) -> dict[str, Any]:
        obj: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, ROLLOUT_SET_PLURAL, name
        )
        return obj

    async def control_token(self, name: str = SET_NAME) -> str:
        """The set's control token, from the Secret the operator generated for it: what a
        caller shows for the participants' control routes and `GET /stats?detail=true`."""
        secret = await self.core.read_namespaced_secret(secret_name(name), self.namespace)
        return token_from_secret({"data": secret.data})

    async def checkpoint(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, ROLLOUT_CHECKPOINT_PLURAL, name
        )
        return obj

    async def wait_set(
        self,
        what: str,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float,  # noqa: ASYNC109 - a poll budget
        name: str = SET_NAME,
    ) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            obj = await self.rollout_set(name)
            return obj if predicate(obj) else None

        return await wait_for(check, timeout, f"RolloutSet {name} {what}", interval=0.1)

    async def wait_checkpoint(
        self,
        name: str,
        what: str,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float,  # noqa: ASYNC109 - a poll budget
        interval: float = 0.1,
    ) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            obj = await self.checkpoint(name)
            return obj if predicate(obj) else None

        return await wait_for(
            check,
            timeout,
            f"RolloutCheckpoint {name} {what}",
            interval=interval,
            ignore=(k8s.ApiException,),
        )


def phase_is(*phases: str) -> Callable[[dict[str, Any]], bool]:
    def check(obj: dict[str, Any]) -> bool:
        return (obj.get("status") or {}).get("phase") in phases

    return check


def participants_by_role(obj: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for participant in (obj.get("status") or {}).get("participants") or []:
        out[participant["role"]].append(participant)
    return out
