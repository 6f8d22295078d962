"""Planning an InPlace recovery: which pods stay, which are replaced, who must re-wire.

`restorePolicy: InPlace` keeps every participant pod that was not lost. The kept pods retire the
lost attempt, are relabelled to the target attempt, and take the restore together with fresh
pods for the lost instances, all or nothing, as a Recreate recovery does. A model pod that took
minutes to load its weights thus survives the loss of an environment, agent or resources pod.

Peer wiring follows without replacing callers: a kept pod whose callee was replaced gets the
callee's new URL in its restore call (`RestoreRequest.peers`) and re-wires before anything is
installed. A participant that cannot re-wire refuses, and the recovery falls back to Recreate.

Everything here is pure (no I/O): the recovery flow (`flows/recovery/`) observes pods and acts.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from rollout_protocol import Role

from ..model.api import ParticipantStatus, RolloutSet
from .resources import PEERS, peer_index
from .setplan import Instance, PodView, attempt_instances, stale_pods


def instance_name(instance: Instance) -> str:
    """`role-index`, as the protocol names a participant instance."""
    role, index = instance
    return f"{role.value}-{index}"


@dataclass(frozen=True)
class InPlacePlan:
    """The outcome of planning: kept pods and replaced instances, or why InPlace cannot run."""

    kept: list[PodView]
    """Live pods of the lost attempt (or already relabelled to the target) that stay."""
    replaced: list[Instance]
    """Instances that get a fresh pod under the target attempt."""
    refused: str | None = None
    """Why this loss cannot be recovered in place (then Recreate runs)."""


def plan_in_place(
    rset: RolloutSet,
    from_attempt: int,
    target_attempt: int,
    pods: Sequence[PodView],
    lost: Collection[Instance],
) -> InPlacePlan:
    """Keep every live pod of the lost attempt whose instance was not lost.

    Pods already relabelled to `target_attempt` count as kept too, so planning again after an
    operator restart (between relabelling and persisting the phase) gives the same answer.
    """
    name = rset.metadata.name
    instances = attempt_instances(rset, from_attempt, pods)
    candidates = [
        p
        for p in pods
        if p.set_name == name and p.attempt in (from_attempt, target_attempt) and p.live
    ]
    if stale_pods(rset, candidates):
        return InPlacePlan(
            kept=[],
            replaced=list(instances),
            refused="the participants spec changed while pods ran: every pod is rebuilt",
        )
    by_instance: dict[Instance, PodView] = {}
    for pod in sorted(candidates, key=lambda p: p.attempt):
        by_instance[(pod.role, pod.index)] = pod  # the relabelled one wins over a stale view
    kept = [
        by_instance[instance]
        for instance in instances
        if instance in by_instance and instance not in lost
    ]
    replaced = [
        instance for instance in instances if instance not in {(p.role, p.index) for p in kept}
    ]
    if not kept:
        return InPlacePlan(kept=[], replaced=replaced, refused="no participant pod survived")
    return InPlacePlan(kept=kept, replaced=replaced)


def rewiring(
    rset: RolloutSet,
    participants: Sequence[ParticipantStatus],
    kept_pods: Collection[str],
    adopted_pods: Collection[str] = (),
) -> dict[str, dict[Role, str]]:
    """New peer URLs by caller instance: for kept callers whose callee was replaced, and for
    every peer of an adopted standby (it was wired to the peers of the attempt it was made in).

    Instance `i` of a role calls instance `i mod replicas` of each peer role (`peer_index`):
    only a kept caller whose callee got a fresh or adopted pod has a stale URL.
    """
    by_instance: Mapping[Instance, ParticipantStatus] = {(p.role, p.index): p for p in participants}
    out: dict[str, dict[Role, str]] = {}
    for caller in participants:
        adopted = caller.pod in adopted_pods
        if caller.pod not in kept_pods and not adopted:
            continue
        for peer in PEERS[caller.role]:
            spec = rset.spec.participant(peer)
            if spec is None:
                continue
            callee = by_instance.get((peer, peer_index(caller.index, spec.replicas)))
            if callee is None or callee.address is None:
                continue
            if callee.pod in kept_pods and not adopted:
                continue
            out.setdefault(instance_name((caller.role, caller.index)), {})[peer] = callee.address
    return out


def adopted_instances(adopted: Sequence[str]) -> dict[str, str]:
    """`recovery.adopted` (`role-index=pod` entries) as {instance: pod}."""
    out: dict[str, str] = {}
    for entry in adopted:
        instance, _, pod = entry.partition("=")
        if instance and pod:
            out[instance] = pod
    return out
