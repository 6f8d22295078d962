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

from ..cluster.cache import (
    CHECKPOINTS,
    NODES,
    PODS,
    SETS,
    Seen,
    checkpoint_key,
    checkpoints_of_set_key,
    pods_key,
    set_key,
)
from ..cluster.kube import Kube
from ..model.api import (
    CHECKPOINT_SET_FIELD,
    GROUP,
    LABEL_SET,
    ROLLOUT_CHECKPOINT_PLURAL,
    ROLLOUT_SET_PLURAL,
    VERSION,
)
from .runtime import MEMO_KUBE


def _changed(memo: kopf.Memo, namespace: str, set_name: str) -> None:
    kube = memo.get(MEMO_KUBE)
    if isinstance(kube, Kube):  # none before startup made it: nobody waits yet
        kube.cache.changed(namespace, set_name)


@kopf.index(GROUP, VERSION, ROLLOUT_SET_PLURAL, id=SETS)
async def rollout_sets(
    namespace: str | None, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> dict[tuple[str, str], Seen]:
    namespace = namespace or "default"
    _changed(memo, namespace, name)
    return {set_key(namespace, name): Seen.of(body)}


@kopf.index(GROUP, VERSION, ROLLOUT_CHECKPOINT_PLURAL, id=CHECKPOINTS)
async def rollout_checkpoints(
    namespace: str | None, name: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> dict[tuple[str, str, str], Seen]:
    namespace = namespace or "default"
    seen = Seen.of(body)
    keys = {checkpoint_key(namespace, name): seen}
    set_name = spec.get(CHECKPOINT_SET_FIELD)
    if isinstance(set_name, str):
        keys[checkpoints_of_set_key(namespace, set_name)] = seen
        _changed(memo, namespace, set_name)
    return keys


@kopf.index("", "v1", "pods", labels={LABEL_SET: kopf.PRESENT}, id=PODS)
async def set_pods(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> dict[tuple[str, str], Seen]:
    namespace = namespace or "default"
    set_name = str(labels.get(LABEL_SET))
    _changed(memo, namespace, set_name)
    return {pods_key(namespace, set_name): Seen.of(body)}


@kopf.index("", "v1", "nodes", id=NODES)
async def nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, Seen]:
    return {name: Seen.of(body)}


__all__ = ["nodes", "rollout_checkpoints", "rollout_sets", "set_pods"]
