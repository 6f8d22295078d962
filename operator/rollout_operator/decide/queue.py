"""Kueue admission of a RolloutSet, decided (docs/design.md#67-observability-and-queues;
docs/policy.md, "Kueue").

A set labelled `kueue.x-k8s.io/queue-name` is a Kueue workload whose integration is this
operator (Kueue's external-framework contract, `integrations.externalFrameworks:
["RolloutSet.v1alpha1.checkpoint.rollout.dev"]`): Kueue only admits and evicts the Workload; the
operator creates and owns it and acts on what Kueue decided. The queue pass
(`flows/queuepass.py`) reads the set, its pods and its Workload, and `decide` here says what to
do, as Kueue's own Job integration would for a `batch/v1` Job:

- no Workload yet: create it (one pod set per role: count and requests from the templates,
  priority from the `kueue.x-k8s.io/priority-class` WorkloadPriorityClass) and hold the set
  (`spec.suspend: true`, the handle Kueue uses for every job kind);
- admitted: write the admitted flavors' node selectors and tolerations (annotation
  `checkpoint.rollout.dev/kueue-placement`, read by `resources.participant_pod`) and
  `spec.suspend: false` in one patch: the set starts, or resumes under attempt + 1 from the
  suspend checkpoint;
- evicted (preempted, a lost quota, a deactivated workload): `spec.suspend: true`, so the policy
  takes the suspend checkpoint and releases the pods (`policy.suspend.suspend_decision`); once
  none of the set's pods is left, clear the Workload's quota reservation, as an integration must
  for Kueue to requeue it (`QuotaReserved=False` reason `Pending`, no `status.admission`,
  `Admitted=False`, `Requeued`);
- otherwise it waits, and says why: `QuotaPending` (Kueue's own message) and `Preempted` (the
  preemptor as Kueue names it, then what the suspend checkpoint kept).

The queue pass is the one writer of `spec.suspend` and of the placement annotation of a labelled
set (people pause a queued set by deactivating its Workload, `spec.active: false`), of the
conditions `QuotaPending` and `Preempted`, and of the Workload (created, and its admission
cleared on eviction; Kueue writes the rest). Without the label nothing here applies.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from ..model.api import (
    LABEL_KUEUE_QUEUE,
    LABEL_SET,
    ConditionStatus,
    RolloutSet,
    SetConditionType,
    dump,
    format_time,
)
from ..model.conditions import truncate
from ..model.reasons import Reason
from .policy.views import ConditionChange, Note
from .resources import ANNOTATION_KUEUE_PLACEMENT, owner_reference

LABEL_QUEUE: Final = LABEL_KUEUE_QUEUE
"""The LocalQueue a set is submitted to (Kueue's own label)."""
LABEL_PRIORITY_CLASS: Final = "kueue.x-k8s.io/priority-class"
"""The WorkloadPriorityClass of the set's Workload (Kueue's own label)."""
LABEL_JOB_UID: Final = "kueue.x-k8s.io/job-uid"
"""On the Workload: the uid of the set it belongs to (Kueue's own label; its preemption
messages name the preemptor by it)."""
ANNOTATION_PLACEMENT: Final = ANNOTATION_KUEUE_PLACEMENT
"""On an admitted set: per role, the node selector and tolerations of the flavors Kueue
assigned (JSON), applied to every pod the operator creates for it (`resources._place`)."""
EXTERNAL_FRAMEWORK: Final = "RolloutSet.v1alpha1.checkpoint.rollout.dev"
"""What Kueue's `integrations.externalFrameworks` must list for RolloutSets."""
KUEUE_GROUP: Final = "kueue.x-k8s.io"
KUEUE_VERSION: Final = "v1beta2"
WORKLOAD_API_VERSION: Final = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
WORKLOADS: Final = "workloads"
RESOURCE_FLAVORS: Final = "resourceflavors"
PRIORITY_CLASSES: Final = "workloadpriorityclasses"

# Kueue's Workload condition types and reasons (sigs.k8s.io/kueue apis/kueue/v1beta2).
QUOTA_RESERVED: Final = "QuotaReserved"
ADMITTED: Final = "Admitted"
EVICTED: Final = "Evicted"
REQUEUED: Final = "Requeued"
REQUEUE_REASONS: Final = frozenset({"Preempted", "NodeFailures"})
"""Evictions after which Kueue's own integrations mark the Workload `Requeued=True`."""


def queue_of(rset: RolloutSet) -> str | None:
    """The LocalQueue the set is submitted to, or None (then nothing here applies)."""
    queue = rset.metadata.labels.get(LABEL_QUEUE)
    return queue or None


def queue_holds(rset: RolloutSet) -> bool:
    """Whether the set's own pass must create no pods: it is queued and Kueue never admitted
    it (the placement is written together with the unsuspend at admission)."""
    return queue_of(rset) is not None and ANNOTATION_PLACEMENT not in rset.metadata.annotations


def workload_name(rset: RolloutSet) -> str:
    """`rolloutset-<set>-<5 hex of its uid>`: one Workload per set object (a set deleted and
    created again under the same name gets a new one)."""
    digest = hashlib.sha256((rset.metadata.uid or "").encode()).hexdigest()[:5]
    return f"rolloutset-{rset.metadata.name}"[:247] + f"-{digest}"


def _requests_from_limits(container: Mapping[str, Any]) -> dict[str, Any]:
    """A container whose requests default to its limits, as the API server defaults a pod's
    (Kueue counts requests; a GPU is usually given as a limit only)."""
    out = dict(container)
    resources = dict(out.get("resources") or {})
    limits = resources.get("limits") or {}
    if limits:
        resources["requests"] = {**limits, **(resources.get("requests") or {})}
        out["resources"] = resources
    return out


def pod_sets(rset: RolloutSet) -> list[dict[str, Any]]:
    """One pod set per role: its replicas and standby pods, and its template's containers and
    scheduling (what Kueue counts against the quota and matches against flavors)."""
    out = []
    for participant in rset.spec.participants:
        template = dump(participant.template)
        spec = dict(template.get("spec") or {})
        spec["containers"] = [_requests_from_limits(c) for c in spec.get("containers") or []]
        if spec.get("initContainers"):
            spec["initContainers"] = [_requests_from_limits(c) for c in spec["initContainers"]]
        spec.pop("volumes", None)  # the storage volume is the operator's; Kueue ignores volumes
        out.append(
            {
                "name": participant.role.value,
                # Standby pods (spec.standby) hold what their template requests too.
                "count": participant.replicas + rset.spec.standby.count(participant.role),
                "template": {"spec": spec},
            }
        )
    return out


def workload_manifest(rset: RolloutSet, priority: int | None) -> dict[str, Any]:
    """The set's Workload: owned by the set (deleted with it), labelled with it (the operator's
    watch finds it by that label), in the set's LocalQueue with its priority."""
    queue = queue_of(rset)
    if queue is None:
        raise ValueError(f"RolloutSet {rset.metadata.name} has no {LABEL_QUEUE} label")
    labels = {LABEL_SET: rset.metadata.name, LABEL_JOB_UID: rset.metadata.uid or ""}
    metadata: dict[str, Any] = {
        "name": workload_name(rset),
        "labels": labels,
        "ownerReferences": [owner_reference(rset)],
    }
    if rset.metadata.namespace:
        metadata["namespace"] = rset.metadata.namespace
    spec: dict[str, Any] = {"queueName": queue, "podSets": pod_sets(rset)}
    priority_class = rset.metadata.labels.get(LABEL_PRIORITY_CLASS)
    if priority_class:
        spec["priorityClassRef"] = {
            "group": KUEUE_GROUP,
            "kind": "WorkloadPriorityClass",
            "name": priority_class,
        }
        spec["priority"] = priority or 0
    return {
        "apiVersion": WORKLOAD_API_VERSION,
        "kind": "Workload",
        "metadata": metadata,
        "spec": spec,
    }


# --- what the pass sees ---------------------------------------------------------------------


@dataclass(frozen=True)
class KueueCondition:
    type: str
    status: bool
    reason: str
    message: str
    last_transition_time: str | None = None

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> KueueCondition:
        return cls(
            type=str(raw.get("type") or ""),
            status=raw.get("status") == "True",
            reason=str(raw.get("reason") or ""),
            message=str(raw.get("message") or ""),
            last_transition_time=raw.get("lastTransitionTime"),
        )


@dataclass(frozen=True)
class Assignment:
    """One pod set's admission: the flavor of each resource."""

    pod_set: str
    flavors: tuple[str, ...]


@dataclass(frozen=True)
class WorkloadView:
    """What the queue pass needs of the set's Workload."""

    name: str
    generation: int
    resource_version: str | None
    conditions: tuple[KueueCondition, ...]
    raw_conditions: tuple[Mapping[str, Any], ...]
    cluster_queue: str | None
    assignments: tuple[Assignment, ...]

    @classmethod
    def from_object(cls, raw: Mapping[str, Any]) -> WorkloadView:
        meta = raw.get("metadata") or {}
        status = raw.get("status") or {}
        conditions = [c for c in status.get("conditions") or [] if isinstance(c, Mapping)]
        admission = status.get("admission") or {}
        assignments = []
        for item in admission.get("podSetAssignments") or []:
            flavors = item.get("flavors") or {}
            assignments.append(
                Assignment(str(item.get("name") or ""), tuple(sorted(set(flavors.values()))))
            )
        return cls(
            name=str(meta.get("name") or ""),
            generation=int(meta.get("generation") or 0),
            resource_version=meta.get("resourceVersion"),
            conditions=tuple(KueueCondition.of(c) for c in conditions),
            raw_conditions=tuple(conditions),
            cluster_queue=admission.get("clusterQueue") if admission else None,
            assignments=tuple(assignments),
        )

    def condition(self, type_: str) -> KueueCondition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    def true(self, type_: str) -> bool:
        found = self.condition(type_)
        return found is not None and found.status

    @property
    def quota_reserved(self) -> bool:
        return self.true(QUOTA_RESERVED)

    @property
    def admitted(self) -> bool:
        return self.true(ADMITTED) and self.quota_reserved

    @property
    def eviction(self) -> KueueCondition | None:
        found = self.condition(EVICTED)
        return found if found is not None and found.status else None

    @property
    def flavor_names(self) -> tuple[str, ...]:
        return tuple(sorted({f for a in self.assignments for f in a.flavors}))


@dataclass(frozen=True)
class Flavor:
    """A ResourceFlavor's placement: what pods on it must select and tolerate."""

    name: str
    node_labels: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def from_object(cls, raw: Mapping[str, Any]) -> Flavor:
        spec = raw.get("spec") or {}
        return cls(
            name=str((raw.get("metadata") or {}).get("name") or ""),
            node_labels=dict(spec.get("nodeLabels") or {}),
            tolerations=tuple(spec.get("tolerations") or ()),
        )


@dataclass(frozen=True)
class QueueSetView:
    """What the queue pass needs of the set."""

    name: str
    queue: str
    suspend: bool
    suspended: bool
    suspended_message: str
    placement: str | None
    recovering: bool
    pods_left: int
    """The set's pods that are not finished, terminating ones included (their GPUs are not
    free until they are gone)."""
    deleting: bool
    attempt: int | None
    preempted: bool
    """Whether the set's Preempted condition is True (set by an earlier pass)."""

    @classmethod
    def from_set(cls, rset: RolloutSet, *, pods_left: int) -> QueueSetView:
        conditions = {c.type: c for c in rset.status.conditions}
        suspended = conditions.get(SetConditionType.SUSPENDED.value)
        preempted = conditions.get(SetConditionType.PREEMPTED.value)
        return cls(
            name=rset.metadata.name,
            queue=queue_of(rset) or "",
            suspend=rset.spec.suspend,
            suspended=suspended is not None and suspended.status is ConditionStatus.TRUE,
            suspended_message=suspended.message if suspended is not None else "",
            placement=rset.metadata.annotations.get(ANNOTATION_PLACEMENT),
            recovering=rset.status.recovery is not None,
            pods_left=pods_left,
            deleting=rset.metadata.deletion_timestamp is not None,
            attempt=rset.status.attempt,
            preempted=preempted is not None and preempted.status is ConditionStatus.TRUE,
        )


# --- the decision ---------------------------------------------------------------------------


@dataclass(frozen=True)
class QueuePlan:
    create: dict[str, Any] | None = None
    """A Workload to create."""
    suspend: bool | None = None
    """`spec.suspend` to write (None: leave it)."""
    placement: str | None = None
    """The placement annotation to write with `suspend` False."""
    release: dict[str, Any] | None = None
    """The Workload status patch that hands its quota back to Kueue."""
    conditions: tuple[ConditionChange, ...] = ()
    notes: tuple[Note, ...] = ()


def placement(assignments: Iterable[Assignment], flavors: Mapping[str, Flavor]) -> str:
    """Per pod set (role), the node labels and tolerations of its flavors, as JSON (stable
    order, so an unchanged admission writes the same annotation)."""
    out: dict[str, Any] = {}
    for assignment in assignments:
        selector: dict[str, str] = {}
        tolerations: list[Mapping[str, Any]] = []
        for name in assignment.flavors:
            flavor = flavors.get(name)
            if flavor is None:
                continue
            selector.update(flavor.node_labels)
            tolerations += [t for t in flavor.tolerations if t not in tolerations]
        entry: dict[str, Any] = {}
        if selector:
            entry["nodeSelector"] = dict(sorted(selector.items()))
        if tolerations:
            entry["tolerations"] = list(tolerations)
        out[assignment.pod_set] = entry
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def _condition(type_: SetConditionType, status: bool, reason: str, message: str) -> ConditionChange:
    return ConditionChange(type_.value, status, reason, message)


def release_patch(
    workload: WorkloadView, eviction: KueueCondition, now: datetime
) -> dict[str, Any]:
    """What Kueue's own integrations write once an evicted job stopped: no admission,
    `QuotaReserved=False` reason `Pending`, `Admitted=False`, and `Requeued` (True after a
    preemption or a node failure). Kueue then requeues the Workload."""
    stamp = format_time(now)
    wanted = {
        QUOTA_RESERVED: ("False", "Pending", eviction.message),
        ADMITTED: ("False", "NoReservation", "The workload has no reservation"),
        REQUEUED: (
            "True" if eviction.reason in REQUEUE_REASONS else "False",
            eviction.reason,
            eviction.message,
        ),
    }
    conditions: list[dict[str, Any]] = []
    for raw in workload.raw_conditions:
        type_ = str(raw.get("type"))
        if type_ not in wanted:
            conditions.append(dict(raw))
            continue
        status, reason, message = wanted.pop(type_)
        changed = raw.get("status") != status
        conditions.append(
            {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": truncate(message),
                "observedGeneration": workload.generation,
                "lastTransitionTime": stamp if changed else raw.get("lastTransitionTime", stamp),
            }
        )
    for type_, (status, reason, message) in wanted.items():
        conditions.append(
            {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": truncate(message),
                "observedGeneration": workload.generation,
                "lastTransitionTime": stamp,
            }
        )
    return {
        "metadata": {"resourceVersion": workload.resource_version},
        "status": {"admission": None, "conditions": conditions},
    }


def decide(
    view: QueueSetView,
    workload: WorkloadView | None,
    *,
    manifest: dict[str, Any] | None,
    priority_class_missing: str | None = None,
    flavors: Mapping[str, Flavor] | None = None,
    now: datetime,
) -> QueuePlan:
    """What the queue pass does for a labelled set (see the module docstring).

    `manifest`: the Workload to create when there is none; `priority_class_missing`: the name of
    a WorkloadPriorityClass the set names but that does not exist (nothing is created then);
    `flavors`: the ResourceFlavors of an admitted Workload's assignments."""
    if view.deleting:
        return QueuePlan()
    hold = True if not view.suspend else None
    if workload is None:
        if priority_class_missing is not None:
            message = (
                f"the WorkloadPriorityClass {priority_class_missing} named by the label "
                f"{LABEL_PRIORITY_CLASS} does not exist; create it or remove the label"
            )
            return QueuePlan(
                suspend=hold,
                conditions=(
                    _condition(
                        SetConditionType.QUOTA_PENDING,
                        True,
                        Reason.PRIORITY_CLASS_NOT_FOUND,
                        message,
                    ),
                ),
                notes=(Note(Reason.PRIORITY_CLASS_NOT_FOUND, message, warning=True),),
            )
        name = (manifest or {}).get("metadata", {}).get("name", "")
        return QueuePlan(
            create=manifest,
            suspend=hold,
            conditions=(
                _condition(
                    SetConditionType.QUOTA_PENDING,
                    True,
                    Reason.WORKLOAD_CREATED,
                    f"Workload {name} submitted to LocalQueue {view.queue}; the set starts "
                    "when Kueue admits it",
                ),
            ),
        )

    eviction = workload.eviction
    if eviction is not None:
        return _evicted(view, workload, eviction, now)

    if workload.admitted:
        where = ", ".join(
            f"{a.pod_set}: {'/'.join(a.flavors) or '-'}" for a in workload.assignments
        )
        changes = [
            _condition(
                SetConditionType.QUOTA_PENDING,
                False,
                Reason.ADMITTED,
                f"admitted by ClusterQueue {workload.cluster_queue} through LocalQueue "
                f"{view.queue} (flavors {where or 'none'})",
            )
        ]
        notes: list[Note] = []
        if view.preempted:
            message = (
                "readmitted by Kueue: the set resumes under the next attempt from the latest "
                "Ready checkpoint"
            )
            changes.append(
                _condition(SetConditionType.PREEMPTED, False, Reason.READMITTED, message)
            )
            notes.append(Note(Reason.READMITTED, message))
        wanted = placement(workload.assignments, flavors or {})
        if view.suspend or view.placement != wanted:
            return QueuePlan(
                suspend=False, placement=wanted, conditions=tuple(changes), notes=tuple(notes)
            )
        return QueuePlan(conditions=tuple(changes), notes=tuple(notes))

    # Pending: not admitted (no quota yet, or admission checks outstanding).
    reserved = workload.condition(QUOTA_RESERVED)
    if reserved is not None and not reserved.status and reserved.message:
        reason, message = reserved.reason or Reason.PENDING, reserved.message
    elif workload.quota_reserved:
        reason, message = Reason.PENDING, "quota reserved; waiting for admission checks"
    else:
        reason, message = Reason.PENDING, "waiting for Kueue to consider the Workload"
    return QueuePlan(
        suspend=hold,
        conditions=(
            _condition(
                SetConditionType.QUOTA_PENDING,
                True,
                reason,
                f"LocalQueue {view.queue}, Workload {workload.name}: {message}",
            ),
        ),
    )


def _evicted(
    view: QueueSetView, workload: WorkloadView, eviction: KueueCondition, now: datetime
) -> QueuePlan:
    cause = f"evicted by Kueue ({eviction.reason}): {eviction.message}"
    pending = _condition(
        SetConditionType.QUOTA_PENDING,
        True,
        Reason.PENDING,
        f"LocalQueue {view.queue}, Workload {workload.name}: {cause}",
    )
    released = view.suspend and view.suspended and not view.recovering and view.pods_left == 0
    if not released:
        return QueuePlan(
            suspend=True if not view.suspend else None,
            conditions=(
                _condition(
                    SetConditionType.PREEMPTED,
                    True,
                    eviction.reason or Reason.SAVING,
                    f"{cause}; the suspend checkpoint saves every unfinished episode, then "
                    "the pods are released and the quota handed back",
                ),
                pending,
            ),
        )
    kept = view.suspended_message or "the set is suspended"
    message = f"{cause}; {kept}; quota handed back to Kueue"
    notes: tuple[Note, ...] = ()
    if workload.quota_reserved or workload.true(ADMITTED):
        failed = "failed" in kept
        notes = (Note("QuotaReleased", message, warning=failed),)
    plan_release = (
        release_patch(workload, eviction, now)
        if workload.quota_reserved or workload.true(ADMITTED)
        else None
    )
    return QueuePlan(
        release=plan_release,
        conditions=(
            _condition(SetConditionType.PREEMPTED, True, eviction.reason or Reason.SAVING, message),
            pending,
        ),
        notes=notes,
    )


def pods_left(pods: Sequence[Mapping[str, Any]]) -> int:
    """Pods of the set that still hold their resources (not Succeeded or Failed)."""
    return sum(
        1 for pod in pods if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    )


__all__ = [
    "ANNOTATION_PLACEMENT",
    "LABEL_PRIORITY_CLASS",
    "LABEL_QUEUE",
    "Flavor",
    "QueuePlan",
    "QueueSetView",
    "WorkloadView",
    "decide",
    "pods_left",
    "queue_holds",
    "queue_of",
    "workload_manifest",
    "workload_name",
]
