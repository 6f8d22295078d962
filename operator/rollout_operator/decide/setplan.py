"""What a RolloutSet's pods should be, given what exists: pure planning, no I/O.

`plan_attempt` compares the pods of one attempt with the spec and says which pods to create now
(those whose peers already have addresses), which wait, and what `status.participants` shows.
`set_conditions` turns that plan into the Ready, Progressing and Degraded conditions. The Kopf
handlers only fetch, call these, and write; the recovery flow calls `plan_attempt` for the
attempt it builds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

from rollout_protocol import Role

from ..model.api import (
    ANNOTATION_SPEC_HASH,
    ANNOTATION_TEMPLATE_HASH,
    LABEL_ATTEMPT,
    LABEL_INDEX,
    LABEL_ROLE,
    LABEL_SET,
    ROLE_ORDER,
    ParticipantStatus,
    RolloutSet,
    SetConditionType,
)
from ..model.conditions import ConditionUpdate, is_true
from ..model.reasons import Reason
from .queue import queue_holds, queue_of
from .resources import (
    PEERS,
    control_port,
    participant_pod,
    participant_url,
    participants_hash,
    peer_index,
    pod_name,
    template_hash,
)

MAX_LISTED: Final = 5
"""How many pods a condition message names before it says "and N more"."""


def _parse_time(value: object) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str) and value:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    return None


@dataclass(frozen=True)
class PodView:
    """What the operator needs to know about one participant pod."""

    name: str
    set_name: str
    role: Role
    index: int
    attempt: int
    phase: str
    ready: bool
    ip: str | None
    terminating: bool
    spec_hash: str | None
    template_hash: str | None
    created: datetime | None
    problem: str | None
    """Why the pod is not (yet) running or ready, in the words of the scheduler or kubelet."""
    container_exited: bool = False
    """One of its containers terminated while the pod still runs (a pod of several containers,
    e.g. an inference server beside its participant sidecar): under restartPolicy Never it
    never comes back, and the pod stays Running as long as another container runs."""

    @property
    def finished(self) -> bool:
        """A participant process that ended (either way) is gone: its episodes are lost. So is a
        pod with one container gone for good, unless it is being deleted: then containers stop
        one by one, and an eviction checkpoint may still run through the one that is left."""
        return self.phase in ("Failed", "Succeeded") or (
            self.container_exited and not self.terminating
        )

    @property
    def live(self) -> bool:
        return not self.finished and not self.terminating

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> PodView | None:
        """None for a pod without our labels (never ours to manage)."""
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        try:
            role = Role(labels[LABEL_ROLE])
            index = int(labels[LABEL_INDEX])
            attempt = int(labels[LABEL_ATTEMPT])
            set_name = labels[LABEL_SET]
        except (KeyError, ValueError):
            return None
        status = pod.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        ready = (conditions.get("Ready") or {}).get("status") == "True"
        phase = status.get("phase") or "Pending"
        return cls(
            name=meta.get("name", ""),
            set_name=set_name,
            role=role,
            index=index,
            attempt=attempt,
            phase=phase,
            ready=ready and phase == "Running",
            ip=status.get("podIP") or None,
            terminating=meta.get("deletionTimestamp") is not None,
            spec_hash=(meta.get("annotations") or {}).get(ANNOTATION_SPEC_HASH),
            template_hash=(meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH),
            created=_parse_time(meta.get("creationTimestamp")),
            problem=_pod_problem(phase, ready, status, conditions),
            container_exited=phase == "Running" and _terminated(status) is not None,
        )


def _terminated(status: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """The first container that terminated: its name and `state.terminated`."""
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return str(cs.get("name")), term
    return None


def _pod_problem(
    phase: str, ready: bool, status: Mapping[str, Any], conditions: Mapping[Any, Any]
) -> str | None:
    def said(reason: object, message: object) -> str:
        return ": ".join(str(x) for x in (reason, message) if x)

    terminated = _terminated(status)
    if phase in ("Failed", "Succeeded", "Running") and terminated is not None:
        name, term = terminated
        text = said(term.get("reason"), term.get("message"))
        return f"{phase}: container {name} exited with code " + (
            f"{term.get('exitCode')}" + (f" ({text})" if text else "")
        )
    if phase in ("Failed", "Succeeded"):
        return f"{phase}: " + (said(status.get("reason"), status.get("message")) or "no reason")
    scheduled = conditions.get("PodScheduled") or {}
    if scheduled.get("status") == "False":
        return said(scheduled.get("reason") or "NotScheduled", scheduled.get("message"))
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") not in (None, "ContainerCreating"):
            return said(waiting.get("reason"), waiting.get("message"))
    if phase == "Running" and not ready:
        return "not Ready: " + (
            said(None, (conditions.get("Ready") or {}).get("message"))
            or "readiness probe not passing"
        )
    if phase == "Pending":
        return "Pending"
    return None


Instance = tuple[Role, int]


def desired_instances(rset: RolloutSet) -> list[Instance]:
    """Every (role, index) the spec asks for, in the protocol's role order."""
    out: list[Instance] = []
    for role in ROLE_ORDER:
        participant = rset.spec.participant(role)
        if participant is not None:
            out.extend((role, i) for i in range(participant.replicas))
    return out


def stale_pods(rset: RolloutSet, pods: Sequence[PodView]) -> list[PodView]:
    """Live pods built from another participants spec than the current one."""
    current = participants_hash(rset.spec)
    return [p for p in pods if p.live and p.spec_hash not in (None, current)]


def attempt_instances(rset: RolloutSet, attempt: int, pods: Sequence[PodView]) -> list[Instance]:
    """The (role, index) instances `attempt` consists of.

    Normally the spec's (`desired_instances`). After a refused spec change (live pods of the
    attempt built from another spec) the spec no longer describes the attempt: then only the
    instances that have pods count, so a replica the new spec adds is not mistaken for a lost
    one. Loss detection and planning both use this.
    """
    mine = [p for p in pods if p.attempt == attempt and p.set_name == rset.metadata.name]
    if not stale_pods(rset, mine):
        return desired_instances(rset)
    rank = {role: i for i, role in enumerate(ROLE_ORDER)}
    return sorted({(p.role, p.index) for p in mine}, key=lambda inst: (rank[inst[0]], inst[1]))


@dataclass(frozen=True)
class AttemptPlan:
    """The pods of one attempt: what exists, what to create now, what waits for peers."""

    attempt: int
    existing: dict[Instance, PodView]
    to_create: list[dict[str, Any]]
    waiting_for_peers: list[str]
    participants: list[ParticipantStatus]
    stale: list[PodView] = field(default_factory=list)
    """Live pods built from another participants spec (a spec change while they run). While
    there are any, the plan is frozen: it reports the existing pods and creates none."""

    @property
    def missing(self) -> list[str]:
        return [*(p["metadata"]["name"] for p in self.to_create), *self.waiting_for_peers]

    @property
    def complete(self) -> bool:
        """Every desired pod exists (in some state)."""
        return not self.to_create and not self.waiting_for_peers

    @property
    def all_ready(self) -> bool:
        return self.complete and all(p.ready and not p.terminating for p in self.existing.values())

    @property
    def started_at(self) -> datetime | None:
        """When the attempt's first pod was created: the progress deadline counts from here."""
        times = [p.created for p in self.existing.values() if p.created is not None]
        return min(times) if times else None


def plan_attempt(rset: RolloutSet, attempt: int, pods: Sequence[PodView]) -> AttemptPlan:
    """Plan the pods of `attempt` from the spec and the pods observed for that attempt.

    A pod is created once the peer instances it calls (see `resources.PEERS`) have IPs, so its
    `ROLLOUT_PEER_<ROLE>_URL` env can be filled in; pods without peers are created at once.
    Pods already present are never re-created, whatever their state: replacing a pod is the
    recovery flow's decision (under a new attempt), not this planner's.
    """
    name = rset.metadata.name
    mine = [p for p in pods if p.attempt == attempt and p.set_name == name]
    existing = {(p.role, p.index): p for p in mine}
    stale = stale_pods(rset, mine)
    desired = attempt_instances(rset, attempt, mine)
    ports = {p.role: control_port(p.template) for p in rset.spec.participants}

    def address(pod: PodView | None) -> str | None:
        if pod is None or pod.ip is None or pod.finished or pod.role not in ports:
            return None
        return participant_url(pod.ip, ports[pod.role])

    to_create: list[dict[str, Any]] = []
    waiting: list[str] = []
    participants: list[ParticipantStatus] = []
    for role, index in desired:
        pod = existing.get((role, index))
        if pod is not None:
            participants.append(
                ParticipantStatus(
                    role=role,
                    index=index,
                    pod=pod.name,
                    attempt=pod.attempt,
                    ready=pod.ready and not pod.terminating,
                    phase=pod.phase,
                    address=address(pod),
                )
            )
            continue
        participants.append(
            ParticipantStatus(
                role=role,
                index=index,
                pod=pod_name(name, role, index, attempt),
                attempt=attempt,
                ready=False,
            )
        )
        peer_urls: dict[Role, str] = {}
        for peer in PEERS[role]:
            peer_spec = rset.spec.participant(peer)
            if peer_spec is None:
                continue
            url = address(existing.get((peer, peer_index(index, peer_spec.replicas))))
            if url is None:
                break
            peer_urls[peer] = url
        else:
            participant = rset.spec.participant(role)
            assert participant is not None
            to_create.append(participant_pod(rset, participant, index, attempt, peer_urls))
            continue
        waiting.append(pod_name(name, role, index, attempt))
    return AttemptPlan(
        attempt=attempt,
        existing=existing,
        to_create=to_create,
        waiting_for_peers=waiting,
        participants=participants,
        stale=stale,
    )


def describe_spec_change(rset: RolloutSet, pods: Sequence[PodView]) -> list[str]:
    """What differs between the spec and the live pods, per role, in words a person can act on
    (replicas counted from the pods' indexes, templates compared by digest)."""
    live = [p for p in pods if p.live]
    changes: list[str] = []
    for role in ROLE_ORDER:
        participant = rset.spec.participant(role)
        mine = [p for p in live if p.role is role]
        if participant is None:
            if mine:
                changes.append(f"{role.value}: removed from the spec")
            continue
        if not mine:
            changes.append(f"{role.value}: added to the spec")
            continue
        running = max(p.index for p in mine) + 1
        if running != participant.replicas:
            changes.append(f"{role.value}: replicas {running} -> {participant.replicas}")
        wanted = template_hash(participant)
        if any(p.template_hash not in (None, wanted) for p in mine):
            changes.append(f"{role.value}: template changed")
    return changes


def _listing(items: Sequence[str]) -> str:
    shown = "; ".join(items[:MAX_LISTED])
    more = len(items) - MAX_LISTED
    return shown + (f"; and {more} more" if more > 0 else "")


@dataclass(frozen=True)
class SetHealth:
    """The conditions a reconcile computed, and when to look again if nothing else happens."""

    conditions: list[ConditionUpdate]
    recheck_at: datetime | None


def set_conditions(
    rset: RolloutSet,
    plan: AttemptPlan,
    *,
    pods_created: bool,
    create_errors: Sequence[str] = (),
    now: datetime,
) -> SetHealth:
    """Ready, Progressing and Degraded for the set's current attempt.

    `pods_created`: every pod of this attempt was created before (status.createdAttempt), so a
    missing one is lost, not yet to be created. `create_errors`: the API server's refusals of
    pod creations in this reconcile (an invalid template shows up here).
    """
    ready_t, progressing_t, degraded_t = (
        SetConditionType.READY.value,
        SetConditionType.PROGRESSING.value,
        SetConditionType.DEGRADED.value,
    )
    attempt = plan.attempt
    # Suspended=True without spec.suspend: afterDeadline Suspend released the pods (policy).
    # A Kueue-queued set holds until its Workload is admitted (`queue.queue_holds`).
    queued = queue_holds(rset)
    suspended = (
        rset.spec.suspend or queued or is_true(rset.status.conditions, SetConditionType.SUSPENDED)
    )
    # Pods on their way out count as released: the suspend deleted them, their state is saved.
    if suspended and all(p.terminating or p.finished for p in plan.existing.values()):
        why = (
            "spec.suspend is true"
            if rset.spec.suspend
            else f"waiting for Kueue to admit the set (LocalQueue {queue_of(rset)})"
            if queued
            else "suspended after mustSaveBy"
        )
        message = f"{why}: no participant pods run"
        return SetHealth(
            [
                ConditionUpdate.of(ready_t, False, Reason.SUSPENDED, message),
                ConditionUpdate.of(progressing_t, False, Reason.SUSPENDED, message),
                ConditionUpdate.of(degraded_t, False, Reason.AS_EXPECTED),
            ],
            None,
        )

    finished = [p for p in plan.existing.values() if p.finished]
    lost = plan.missing if pods_created else []
    not_ready = [p for p in plan.existing.values() if not p.ready or p.terminating]
    deadline_s = rset.spec.progress_deadline_seconds
    started = plan.started_at
    recheck_at: datetime | None = None
    overdue = False
    if not plan.all_ready and started is not None:
        deadline = started + timedelta(seconds=deadline_s)
        overdue = now >= deadline
        if not overdue:
            recheck_at = deadline

    # The most specific problem names the Degraded reason; Ready=False reuses it.
    problem: tuple[str, str] | None = None
    hold = rset.status.recovery_hold
    if hold is not None:
        problem = (Reason.RECOVERY_LIMIT, hold.message)
    elif finished:
        problem = (
            Reason.FAILED,
            f"participant pods of attempt {attempt} ended: "
            + _listing([f"{p.name} {p.problem}" for p in finished]),
        )
    elif lost:
        problem = (
            Reason.LOST,
            f"participant pods of attempt {attempt} are gone: " + _listing(lost),
        )
    elif create_errors:
        problem = (
            Reason.CREATE_FAILED,
            "the API server refused a participant pod: " + _listing(list(create_errors)),
        )
    elif overdue:
        problem = (
            Reason.NOT_STARTING,
            f"participant pods not Ready {deadline_s}s (progressDeadlineSeconds) after the "
            f"attempt started: "
            + _listing(
                [f"{p.name} {p.problem or p.phase}" for p in not_ready]
                + [
                    f"{n} (not created: waiting for its peers' addresses)"
                    for n in plan.waiting_for_peers
                ]
            ),
        )

    conditions: list[ConditionUpdate] = []
    if plan.all_ready:
        total = len(plan.existing)
        conditions.append(
            ConditionUpdate.of(
                ready_t,
                True,
                Reason.ALL_READY,
                f"all {total} participant pods of attempt {attempt} are Ready",
            )
        )
    elif problem is not None:
        conditions.append(ConditionUpdate.of(ready_t, False, *problem))
    else:
        ready_count = sum(1 for p in plan.existing.values() if p.ready and not p.terminating)
        waiting = [f"{p.name} ({p.problem or p.phase})" for p in not_ready]
        waiting += [f"{n} (waiting for peer addresses)" for n in plan.waiting_for_peers]
        waiting += [f"{p['metadata']['name']} (to be created)" for p in plan.to_create]
        conditions.append(
            ConditionUpdate.of(
                ready_t,
                False,
                Reason.STARTING,
                f"{ready_count} of {len(plan.existing) + len(plan.missing)} participant pods of "
                f"attempt {attempt} Ready; waiting for " + _listing(waiting),
            )
        )

    if plan.stale:
        changed = describe_spec_change(rset, list(plan.existing.values())) or ["participants"]
        refused = (
            Reason.SPEC_CHANGE_REFUSED,
            f"the spec changed while pods of attempt {attempt} run ({'; '.join(changed)}); "
            "the running pods keep the spec they were built from and no pod is created. Rolling "
            "participants through a checkpoint and restore is not supported yet: revert the "
            "change; pods of a later attempt (after a recovery) are built from the new spec",
        )
        conditions.append(ConditionUpdate.of(degraded_t, True, *refused))
        conditions.append(ConditionUpdate.of(progressing_t, False, *refused))
    elif problem is not None:
        conditions.append(ConditionUpdate.of(degraded_t, True, *problem))
        progress_reason = (
            Reason.DEADLINE_EXCEEDED if problem[0] == Reason.NOT_STARTING else problem[0]
        )
        conditions.append(ConditionUpdate.of(progressing_t, False, progress_reason, problem[1]))
    else:
        conditions.append(ConditionUpdate.of(degraded_t, False, Reason.AS_EXPECTED))
        if plan.all_ready:
            conditions.append(
                ConditionUpdate.of(
                    progressing_t, False, Reason.ATTEMPT_READY, f"attempt {attempt} is running"
                )
            )
        else:
            conditions.append(
                ConditionUpdate.of(
                    progressing_t,
                    True,
                    Reason.STARTING,
                    f"starting the participant pods of attempt {attempt}",
                )
            )
    return SetHealth(conditions, recheck_at)
