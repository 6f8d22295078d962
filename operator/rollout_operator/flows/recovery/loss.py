"""How the recovery sees a lost participant (docs/design.md#62-recovery): the set's pods, their
nodes, and which participant instances of an attempt are gone.

A participant is lost when its pod failed, was deleted (or is being deleted outside an
eviction's grace period), or sits on a node that is NotReady. `detect_loss` starts a recovery;
`find_losses` is also how the steps see the survivors (StoppingAttempt) and a replacement pod
lost while restoring (Restoring, Resuming).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...cluster.kube import Kube
from ...decide.resources import set_selector
from ...decide.setplan import Instance, PodView, attempt_instances
from ...model.api import RolloutSet, SetConditionType, namespace_or_default
from ...model.conditions import is_true
from ...model.reasons import Reason


@dataclass(frozen=True)
class Loss:
    reason: str
    message: str


def detect_loss(
    rset: RolloutSet,
    pods: list[PodView],
    nodes_of: dict[str, str],
    lost_nodes: set[str],
    held: frozenset[str] = frozenset(),
) -> Loss | None:
    """Whether the current attempt lost a participant. Only an attempt that came up counts
    (`createdAttempt`: its pods were all created and Ready together; a pod that fails while the
    attempt starts is the reconciler's Degraded).

    `held`: terminating pods that are not lost yet (their eviction checkpoint runs inside
    their grace period, see `cluster.objects.eviction_holds`). A Suspended set has released its
    pods on purpose; resuming it is the policy's recovery, not a loss."""
    status = rset.status
    attempt = status.attempt
    if attempt is None or status.created_attempt is None or status.created_attempt < attempt:
        return None
    if rset.spec.suspend or status.recovery is not None:
        return None
    if is_true(status.conditions, SetConditionType.SUSPENDED.value):
        return None
    losses = find_losses(rset, attempt, pods, nodes_of, lost_nodes, held)
    return next(iter(losses.values()), None)


def find_losses(
    rset: RolloutSet,
    attempt: int,
    pods: list[PodView],
    nodes_of: dict[str, str],
    lost_nodes: set[str],
    held: frozenset[str] = frozenset(),
) -> dict[Instance, Loss]:
    """Every participant instance of `attempt` that was lost, with why (in role order)."""
    existing = {(p.role, p.index): p for p in pods if p.attempt == attempt}
    losses: dict[Instance, Loss] = {}
    for role, index in attempt_instances(rset, attempt, pods):
        pod = existing.get((role, index))
        label = f"{role.value}-{index} of attempt {attempt}"
        if pod is None:
            losses[(role, index)] = Loss(
                Reason.POD_DELETED, f"participant {label}: its pod is gone"
            )
        elif pod.finished:
            losses[(role, index)] = Loss(
                Reason.POD_FAILED, f"participant {label} ({pod.name}): {pod.problem}"
            )
        elif pod.terminating and pod.name not in held:
            losses[(role, index)] = Loss(
                Reason.POD_DELETED, f"participant {label} ({pod.name}) is being deleted"
            )
        elif (node := nodes_of.get(pod.name)) is not None and node in lost_nodes:
            losses[(role, index)] = Loss(
                Reason.NODE_LOST, f"participant {label} ({pod.name}) ran on node {node}, NotReady"
            )
    return losses


async def observe(kube: Kube, rset: RolloutSet) -> tuple[list[PodView], dict[str, str], set[str]]:
    """The set's pods, the node of each, and which of those nodes are not Ready."""
    namespace = namespace_or_default(rset.metadata.namespace)
    raw = await kube.list_pods(namespace, set_selector(rset.metadata.name))
    views = [v for v in (PodView.from_pod(p) for p in raw) if v is not None]
    nodes_of = {
        p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in raw
        if (p.get("spec") or {}).get("nodeName")
    }
    lost: set[str] = set()
    for node_name in set(nodes_of.values()):
        node = await kube.get_node(node_name)
        if node is None:
            lost.add(node_name)
            continue
        ready = next(
            (c for c in (node.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"),
            None,
        )
        if ready is None or ready.get("status") != "True":
            lost.add(node_name)
    return views, nodes_of, lost
