"""The client's `Topology` read from a RolloutSet through the Kubernetes API.

The operator publishes everything a trainer needs in the RolloutSet's status: `status.attempt`
(the attempt the participants run) and `status.participants` (each pod with its address). While
a recovery runs, `status.recovery` is set and the participants shown are the *next* attempt's
pods, which are not serving yet; only when the recovery finished does `status.attempt` move to
that attempt. So a snapshot is *servable* only when no recovery runs and every environment
instance of the spec is listed, Ready, addressed, and its pod belongs to `status.attempt` (pod
names end in `-a<attempt>`). Anything else is a set in transition, and the topology waits.

Reads are plain GETs of the one object, shared by every caller: a client with 64 episodes
waiting for the next attempt makes one request per poll interval, not 64 watches. Polling keeps
no long-lived connection to repair across API server restarts, at the cost of up to one
interval of latency after a recovery (half a second by default, against recoveries that take
seconds).

This module talks to the API with kubernetes_asyncio only; `rollout_servers` never imports the
operator, so the API group and names are spelled out here (they are the API, not an
implementation detail).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import aiohttp
import anyio
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from .topology import TopologySnapshot

GROUP: Final = "checkpoint.rollout.dev"
VERSION: Final = "v1alpha1"
PLURAL: Final = "rolloutsets"
ENVIRONMENT: Final = "environment"
_IN_CLUSTER_NAMESPACE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class TopologyUnavailable(Exception):
    """The RolloutSet cannot be followed (it does not exist, or the API refuses access)."""


def servable_snapshot(obj: Mapping[str, Any]) -> TopologySnapshot | None:
    """The snapshot a RolloutSet object offers, or None while it is not servable (see the
    module docstring): recovering, not started, or environments not all Ready yet."""
    status = obj.get("status") or {}
    if status.get("recovery"):
        return None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Recovering" and condition.get("status") == "True":
            return None
    attempt = status.get("attempt")
    if not isinstance(attempt, int):
        return None
    spec = obj.get("spec") or {}
    replicas = next(
        (
            int(p.get("replicas", 1))
            for p in spec.get("participants") or []
            if p.get("role") == ENVIRONMENT
        ),
        0,
    )
    if replicas < 1:
        return None
    suffix = re.compile(rf"-a{attempt}$")
    by_index: dict[int, str] = {}
    for participant in status.get("participants") or []:
        if participant.get("role") != ENVIRONMENT:
            continue
        address = participant.get("address")
        pod = str(participant.get("pod") or "")
        # The pod's attempt label; operators before InPlace recovery named only the pod.
        runs = participant.get("attempt")
        current = runs == attempt if isinstance(runs, int) else bool(suffix.search(pod))
        if not participant.get("ready") or not address or not current:
            return None
        by_index[int(participant.get("index", 0))] = str(address)
    if sorted(by_index) != list(range(replicas)):
        return None
    return TopologySnapshot(attempt, tuple(by_index[i] for i in range(replicas)))


RECOVERY_TRY_MARGIN_S: Final = 60.0
"""Per recovery try, beyond restoreTimeoutSeconds: the retire, resume and status calls."""
RECOVERY_BACKOFF_CAP_S: Final = 60.0
"""The operator's longest backoff between recovery tries (`recovery.MAX_BACKOFF_SECONDS`)."""


def recovery_bound_seconds(obj: Mapping[str, Any]) -> float:
    """The longest a recovery of this RolloutSet can take before it succeeds or gives up:
    `maxRestarts + 1` tries of `restoreTimeoutSeconds` (plus their control calls), and the
    backoffs between them (2, 4, 8, ... seconds, at most 60). A trainer that waits longer than
    this for a new attempt waits for nothing; `rollout-collect --rollout-set` waits exactly
    this long by default (docs/servers.md)."""
    recovery = (obj.get("spec") or {}).get("recovery") or {}
    tries = int(recovery.get("maxRestarts", 10)) + 1
    per_try = float(recovery.get("restoreTimeoutSeconds", 600)) + RECOVERY_TRY_MARGIN_S
    backoffs = sum(min(RECOVERY_BACKOFF_CAP_S, 2.0**k) for k in range(1, tries + 1))
    return tries * per_try + backoffs


class RolloutSetTopology:
    """`Topology` (with `wait_newer`) of one RolloutSet, for `RolloutClient`.

    `current()` waits while the set is in transition (a recovery, pods starting) and returns
    the servable snapshot; `wait_newer(n)` returns once a servable snapshot has an attempt
    greater than `n`. Neither applies a deadline of its own: the client bounds both (its
    restore timeout), as the `Topology` protocol asks.
    """

    def __init__(
        self,
        custom: Any,
        name: str,
        namespace: str,
        *,
        poll_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._custom = custom
        self.name = name
        self.namespace = namespace
        self.poll_interval_s = poll_interval_s
        self._clock = clock
        self._lock = anyio.Lock()
        self._reads = 0
        self._read_at: float | None = None
        self._latest: TopologySnapshot | None = None
        self._servable: TopologySnapshot | None = None

    async def recovery_bound_s(self) -> float:
        """`recovery_bound_seconds` of the set as it is now (one read)."""
        obj = await self._custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name
        )
        return recovery_bound_seconds(obj)

    @property
    def latest(self) -> TopologySnapshot | None:
        """The last servable snapshot seen (None before the first one)."""
        return self._latest

    async def current(self) -> TopologySnapshot:
        if not self._fresh():
            await self._read_next(self._reads)
        return await self._until(lambda snapshot: True)

    async def wait_newer(self, attempt: int) -> TopologySnapshot:
        return await self._until(lambda snapshot: snapshot.attempt > attempt)

    async def _until(self, wanted: Callable[[TopologySnapshot], bool]) -> TopologySnapshot:
        while True:
            snapshot = self._servable
            if snapshot is not None and wanted(snapshot):
                return snapshot
            await self._read_next(self._reads)

    def _fresh(self) -> bool:
        return self._read_at is not None and self._clock() - self._read_at < self.poll_interval_s

    async def _read_next(self, reads_before: int) -> None:
        """One read shared by every caller: whoever queued behind a read that completed while
        it waited for the lock uses that one. Reads are at least `poll_interval_s` apart."""
        async with self._lock:
            if self._reads > reads_before:
                return
            if self._read_at is not None:
                wait = self.poll_interval_s - (self._clock() - self._read_at)
                if wait > 0:
                    await anyio.sleep(wait)
            try:
                obj = await self._custom.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, self.name
                )
            except ApiException as error:
                if error.status in (401, 403, 404):
                    raise TopologyUnavailable(
                        f"RolloutSet {self.namespace}/{self.name}: HTTP {error.status} "
                        f"{error.reason}; check the name, --namespace and the credentials"
                    ) from error
                obj = None  # a transient API error: the next read retries
            except (aiohttp.ClientError, OSError, TimeoutError):
                obj = None  # the API server is unreachable for now: the next read retries
            self._read_at = self._clock()
            self._reads += 1
            self._servable = None if obj is None else servable_snapshot(obj)
            if self._servable is not None:
                self._latest = self._servable


def default_namespace(kubeconfig: Path | None = None) -> str:
    """The namespace a pod runs in, else the kubeconfig context's namespace, else default."""
    if kubeconfig is None and _IN_CLUSTER_NAMESPACE.exists():
        return _IN_CLUSTER_NAMESPACE.read_text().strip() or "default"
    try:
        _, active = config.list_kube_config_contexts(
            config_file=str(kubeconfig) if kubeconfig else None
        )
    except (config.ConfigException, OSError, TypeError):
        return "default"
    namespace = ((active or {}).get("context") or {}).get("namespace")
    return str(namespace) if namespace else "default"


async def _configuration(kubeconfig: Path | None) -> Any:
    configuration = client.Configuration()
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            return configuration
        except config.ConfigException:
            pass
    await config.load_kube_config(
        config_file=str(kubeconfig) if kubeconfig else None, client_configuration=configuration
    )
    return configuration


@asynccontextmanager
async def rollout_set_topology(
    name: str,
    namespace: str | None = None,
    *,
    kubeconfig: Path | None = None,
    poll_interval_s: float = 0.5,
) -> AsyncIterator[RolloutSetTopology]:
    """A `RolloutSetTopology` with its own API client (in-cluster credentials, else the
    kubeconfig: `kubeconfig`, `$KUBECONFIG` or ~/.kube/config), closed on exit."""
    api = client.ApiClient(await _configuration(kubeconfig))
    try:
        yield RolloutSetTopology(
            client.CustomObjectsApi(api),
            name,
            namespace or default_namespace(kubeconfig),
            poll_interval_s=poll_interval_s,
        )
    finally:
        await api.close()
