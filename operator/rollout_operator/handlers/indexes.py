"""The Kopf indexes the operator reads its cluster state from (`cache.ClusterCache`).

Kopf calls each function for every object its watch delivers (and drops an object's entries
when it is deleted), and fills every index before any handler or daemon runs. The values are
`cache.Seen` snapshots; each function also wakes whoever waits on the set the object belongs to
(a checkpoint's prepare, a recovery's wait for pods), so those waits end on events instead of
polling the API server.
"""

from __future__ import annotations

from typing import Any

import kopf

from ..cluster.cache import CHECKPOINTS, NODES, PODS, SETS, Seen, index_entries
from ..cluster.cache import WORKLOADS as SET_WORKLOADS
from ..cluster.kube import Kube
from ..decide.queue import KUEUE_GROUP, KUEUE_VERSION, WORKLOADS
from ..model.api import GROUP, LABEL_SET, ROLLOUT_CHECKPOINT_PLURAL, ROLLOUT_SET_PLURAL, VERSION
from .runtime import MEMO_KUBE


def _entries(kind: str, body: kopf.Body, memo: kopf.Memo) -> dict[Any, Seen]:
    entries, owner = index_entries(kind, body)
    kube = memo.get(MEMO_KUBE)
    if owner is not None and isinstance(kube, Kube):  # none before startup: nobody waits
        kube.cache.changed(*owner)
    return entries


@kopf.index(GROUP, VERSION, ROLLOUT_SET_PLURAL, id=SETS)
async def rollout_sets(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[Any, Seen]:
    return _entries(SETS, body, memo)


@kopf.index(GROUP, VERSION, ROLLOUT_CHECKPOINT_PLURAL, id=CHECKPOINTS)
async def rollout_checkpoints(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[Any, Seen]:
    return _entries(CHECKPOINTS, body, memo)


@kopf.index("", "v1", "pods", labels={LABEL_SET: kopf.PRESENT}, id=PODS)
async def set_pods(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[Any, Seen]:
    return _entries(PODS, body, memo)


@kopf.index(
    KUEUE_GROUP, KUEUE_VERSION, WORKLOADS, labels={LABEL_SET: kopf.PRESENT}, id=SET_WORKLOADS
)
async def set_workloads(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[Any, Seen]:
    """Kueue's Workloads of queued sets (where Kueue's CRDs are installed; elsewhere Kopf logs
    once that it cannot serve them and the index stays empty)."""
    return _entries(SET_WORKLOADS, body, memo)


@kopf.index("", "v1", "nodes", id=NODES)
async def nodes(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[Any, Seen]:
    return _entries(NODES, body, memo)


__all__ = ["nodes", "rollout_checkpoints", "rollout_sets", "set_pods", "set_workloads"]
