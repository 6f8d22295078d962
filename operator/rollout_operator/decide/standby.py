"""Standby pods (`spec.standby`, docs/design.md#62-recovery): which to start, which to drop, which
to adopt.

A standby is a Ready pod of a role, made from the role's current template, in no attempt: its
labels carry `checkpoint.rollout.dev/standby=true` instead of an attempt and an index, so the
attempt planner, loss detection, checkpoints and the trainer's discovery never see it. The set's
pass keeps `spec.standby` of them per role while the set runs (`plan_standbys`); a recovery
adopts Ready ones for lost instances (`adoptions`) instead of waiting for fresh pods to start.

Everything here is pure: the set pass and the recovery observe pods and act.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_protocol import Role

from ..model.api import (
    ANNOTATION_TEMPLATE_HASH,
    LABEL_ROLE,
    LABEL_SET,
    LABEL_STANDBY,
    MAX_STANDBY,
    ROLE_ORDER,
    RolloutSet,
    StandbyStatus,
)
from .resources import (
    PEERS,
    peer_index,
    standby_pod,
    standby_pod_name,
    template_hash,
)
from .setplan import AttemptPlan, Instance


@dataclass(frozen=True)
class StandbyView:
    """What the operator needs to know about one standby pod."""

    name: str
    role: Role
    phase: str
    ready: bool
    terminating: bool
    template_hash: str | None
    ip: str | None

    @property
    def finished(self) -> bool:
        return self.phase in ("Failed", "Succeeded")

    @property
    def live(self) -> bool:
        return not self.finished and not self.terminating

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any], set_name: str) -> StandbyView | None:
        """None for anything but a standby pod of this set."""
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(LABEL_STANDBY) != "true" or labels.get(LABEL_SET) != set_name:
            return None
        try:
            role = Role(labels.get(LABEL_ROLE, ""))
        except ValueError:
            return None
        status = pod.get("status") or {}
        phase = status.get("phase") or "Pending"
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        return cls(
            name=str(meta.get("name", "")),
            role=role,
            phase=phase,
            ready=phase == "Running" and (conditions.get("Ready") or {}).get("status") == "True",
            terminating=meta.get("deletionTimestamp") is not None,
            template_hash=(meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH),
            ip=status.get("podIP") or None,
        )


def standby_views(pods: Sequence[Mapping[str, Any]], set_name: str) -> list[StandbyView]:
    return [v for v in (StandbyView.from_pod(p, set_name) for p in pods) if v is not None]


def current(rset: RolloutSet, standby: StandbyView) -> bool:
    """Made from the role's current template (a standby made from another is never adopted)."""
    participant = rset.spec.participant(standby.role)
    return participant is not None and standby.template_hash == template_hash(participant)


@dataclass(frozen=True)
class StandbyPlan:
    """What the set's pass does about standby pods, and what the set's status shows."""

    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    """Standbys to delete: finished, made from an old template, or more than asked for."""
    status: StandbyStatus | None = None


def plan_standbys(
    rset: RolloutSet,
    standbys: Sequence[StandbyView],
    attempt: int,
    plan: AttemptPlan | None,
) -> StandbyPlan:
    """Keep `spec.standby` current standbys per role.

    New ones are made only while the attempt runs with every pod Ready (`plan`, None while the
    set recovers or is suspended): they call the peers instance 0 of their role calls now. Stale
    and finished ones are deleted whenever seen; an idle standby that is lost is thus replaced
    without any recovery."""
    create: list[dict[str, Any]] = []
    delete: list[str] = []
    names = {s.name for s in standbys}
    for role in ROLE_ORDER:
        participant = rset.spec.participant(role)
        wanted = rset.spec.standby.count(role) if participant is not None else 0
        mine = [s for s in standbys if s.role is role]
        keep: list[StandbyView] = []
        for standby in sorted(mine, key=lambda s: (not s.ready, s.name)):
            if standby.terminating:
                continue
            if standby.finished or not current(rset, standby) or len(keep) >= wanted:
                delete.append(standby.name)
            else:
                keep.append(standby)
        if participant is None or plan is None or not plan.all_ready or plan.stale:
            continue
        peers = _peers_of_instance_zero(rset, role, plan)
        if peers is None:
            continue
        ordinals = (
            k
            for k in range(MAX_STANDBY * 2)
            if standby_pod_name(rset.metadata.name, role, k, attempt) not in names
        )
        for _ in range(wanted - len(keep)):
            ordinal = next(ordinals, None)
            if ordinal is None:
                break
            create.append(standby_pod(rset, participant, ordinal, attempt, peers))
    desired = sum(count for _, count in rset.spec.standby.wanted())
    ready = sum(
        1 for s in standbys if s.ready and s.live and current(rset, s) and s.name not in delete
    )
    ready = min(ready, desired)
    live = sorted(s.name for s in standbys if s.live)
    status = (
        StandbyStatus(desired=desired, ready=ready, shown=f"{ready}/{desired}", pods=live)
        if desired or live
        else None
    )
    return StandbyPlan(create=create, delete=delete, status=status)


def _peers_of_instance_zero(
    rset: RolloutSet, role: Role, plan: AttemptPlan
) -> dict[Role, str] | None:
    by_instance = {(p.role, p.index): p for p in plan.participants}
    peers: dict[Role, str] = {}
    for peer in PEERS[role]:
        spec = rset.spec.participant(peer)
        if spec is None:
            continue
        callee = by_instance.get((peer, peer_index(0, spec.replicas)))
        if callee is None or callee.address is None:
            return None
        peers[peer] = callee.address
    return peers


def adoptions(
    rset: RolloutSet, missing: Sequence[Instance], standbys: Sequence[StandbyView]
) -> dict[Instance, StandbyView]:
    """Which Ready, current standby takes which missing instance (each standby at most once)."""
    free = sorted(
        (s for s in standbys if s.ready and s.live and s.ip and current(rset, s)),
        key=lambda s: s.name,
    )
    out: dict[Instance, StandbyView] = {}
    for instance in missing:
        role = instance[0]
        pick = next((s for s in free if s.role is role), None)
        if pick is not None:
            free.remove(pick)
            out[instance] = pick
    return out
