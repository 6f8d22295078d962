"""A Kueue-queued RolloutSet, carried out against the API (`decide.queue` decides).

`QueuePass`: one look at a set labelled `kueue.x-k8s.io/queue-name` (a set without the label is
left untouched), the first stage of the policy loop's pass (`stagedpass`: one read of the set,
one status write shared with the policy pass; `run` is a pass of this stage alone). It reads
the set's pods and its Workload from the watches (and, from the API server, for a Workload still
to create, the WorkloadPriorityClass the set names; for an admitted one, its ResourceFlavors),
lets `queue.decide` decide, and acts in an order that a crash between two steps leaves for the
next pass to finish (the Workload is read from the operator's watch of Workloads,
`cache.WORKLOADS`, like the set and its pods):

1. the Workload is created (a deterministic name: a repeat gets "exists");
2. `spec.suspend` (with the admitted placement) is patched on the set with a resourceVersion
   precondition: holding a set, or starting and resuming it once Kueue admitted it, is the
   policy's existing suspend and resume (checkpoint first, pods released; attempt + 1 after);
3. the set's `QuotaPending` and `Preempted` conditions are written (only when they changed),
   in the pass's one status write;
4. (`finish`, after that write) an evicted Workload whose set released every pod has its quota
   reservation cleared, which is what Kueue waits for before it requeues the Workload and gives
   the quota to the preemptor.

A lost race (409) returns `again`; the set's loop then passes again at once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..cluster.kube import ApiError, Kube
from ..cluster.statuswriter import PassStatus, SetDelta
from ..decide.policy.views import ConditionChange, Note
from ..decide.queue import (
    ANNOTATION_PLACEMENT,
    EXTERNAL_FRAMEWORK,
    LABEL_PRIORITY_CLASS,
    LABEL_QUEUE,
    WORKLOAD_API_VERSION,
    Flavor,
    QueuePlan,
    QueueSetView,
    WorkloadView,
    decide,
    pods_left,
    queue_of,
    workload_manifest,
    workload_name,
)
from ..decide.resources import set_selector
from ..model.api import RolloutSet, SetConditionType, namespace_or_default
from ..model.conditions import ConditionUpdate, merge_conditions, same_but_generation
from ..model.owners import StatusOwner
from .stagedpass import parsed, run_stages

logger = logging.getLogger(__name__)

Clock = Callable[[], datetime]
NoteSink = Callable[[RolloutSet, Note], Awaitable[None]]


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class QueueOutcome:
    again: bool = False
    """A write lost a race: look again at once."""
    plan: QueuePlan | None = None


class QueuePass:
    """One look at one queued set (see the module docstring): a stage of the policy loop's
    pass (`stagedpass`), or a pass of its own (`run`)."""

    def __init__(
        self,
        kube: Kube,
        *,
        clock: Clock = _utcnow,
        on_note: NoteSink | None = None,
        wake_set: Callable[[str, str], None] | None = None,
    ) -> None:
        self._kube = kube
        self._clock = clock
        self._on_note = on_note
        self._wake_set = wake_set
        self._planned: tuple[RolloutSet, QueuePlan] | None = None
        self._refused: WorkloadNotCreated | None = None

    async def run(self, namespace: str, name: str) -> QueueOutcome:
        """One pass of this stage alone: read, plan, write, finish."""
        outcome = await run_stages(self._kube, namespace, name, [self])
        return QueueOutcome(again=outcome.again, plan=self.plan_made)

    @property
    def plan_made(self) -> QueuePlan | None:
        """What `queue.decide` decided in this pass; None for a set without the label."""
        return None if self._planned is None else self._planned[1]

    async def plan(self, draft: PassStatus) -> bool:
        """Decide, create the Workload and patch `spec.suspend` (the draft rebased on the
        patched set), and add the conditions' delta. False when the API server refused the
        Workload: the set stays held, and the policy does not plan on it in this pass."""
        rset = parsed(draft)
        if rset is None:
            return False  # the set pass reports an invalid spec (InvalidSpec)
        if queue_of(rset) is None:
            return True
        namespace, name = namespace_or_default(rset.metadata.namespace), rset.metadata.name
        pods = await self._kube.list_pods(namespace, set_selector(name))
        view = QueueSetView.from_set(rset, pods_left=pods_left(pods))
        found = await self._kube.get_workload(namespace, name, workload_name(rset))
        workload = WorkloadView.from_object(found) if found is not None else None
        manifest: dict[str, Any] | None = None
        missing: str | None = None
        if workload is None:
            priority: int | None = None
            priority_class = rset.metadata.labels.get(LABEL_PRIORITY_CLASS)
            if priority_class:
                wpc = await self._kube.get_workload_priority_class(priority_class)
                if wpc is None:
                    missing = priority_class
                else:
                    priority = int(wpc.get("value") or 0)
            manifest = workload_manifest(rset, priority)
        flavors: dict[str, Flavor] = {}
        if workload is not None and workload.admitted and workload.eviction is None:
            for flavor in workload.flavor_names:
                got = await self._kube.get_resource_flavor(flavor)
                if got is not None:
                    flavors[flavor] = Flavor.from_object(got)
        plan = decide(
            view,
            workload,
            manifest=manifest,
            priority_class_missing=missing,
            flavors=flavors,
            now=self._clock(),
        )
        self._planned = (rset, plan)
        if plan.create is not None:
            try:
                created = await self._kube.create_workload(namespace, plan.create)
            except ApiError as error:
                # The set stays held (`queue.queue_holds`); say why and what to do.
                self._add_conditions(draft, not_created(error))
                self._refused = WorkloadNotCreated(str(error))
                self._refused.__cause__ = error
                return False
            if created:
                logger.info(
                    "set %s: created Workload %s in LocalQueue %s",
                    name,
                    plan.create["metadata"]["name"],
                    queue_of(rset),
                )
        if plan.suspend is not None:
            body: dict[str, Any] = {"spec": {"suspend": plan.suspend}}
            if plan.placement is not None:
                body["metadata"] = {"annotations": {ANNOTATION_PLACEMENT: plan.placement}}
            version = rset.metadata.resource_version
            draft.rebase(
                await self._kube.patch_set(namespace, name, body, resource_version=version)
            )
            logger.info(
                "set %s: %s (Kueue)",
                name,
                "held: spec.suspend true" if plan.suspend else "admitted: spec.suspend false",
            )
            # The set's own pass creates the pods: wake it (a hold and a release that follow
            # each other quickly may leave no spec change for Kopf to report).
            if self._wake_set is not None:
                self._wake_set(namespace, name)
        self._add_conditions(draft, plan)
        return True

    async def finish(self) -> None:
        """Once the conditions are written: an evicted Workload's quota handed back, the
        notes; a refused Workload raised (`WorkloadNotCreated`: the loop retries)."""
        if self._refused is not None:
            raise self._refused
        if self._planned is None:
            return
        rset, plan = self._planned
        if plan.release is not None:
            namespace = namespace_or_default(rset.metadata.namespace)
            workload = workload_name(rset)
            await self._kube.patch_workload_status(namespace, workload, plan.release)
            logger.info(
                "set %s: quota of Workload %s handed back to Kueue", rset.metadata.name, workload
            )
        for note in plan.notes:
            if self._on_note is not None:
                await self._on_note(rset, note)

    @staticmethod
    def _add_conditions(draft: PassStatus, plan: QueuePlan) -> None:
        """The queue's conditions (`QuotaPending`, `Preempted`) as a delta, only when they
        changed."""
        updates = [
            ConditionUpdate.of(c.type, c.status, c.reason, c.message) for c in plan.conditions
        ]
        if not updates:
            return
        rset = draft.rset
        current = rset.status.conditions
        merged = merge_conditions(current, updates, observed_generation=rset.metadata.generation)
        if same_but_generation(merged, current):
            return
        draft.add(SetDelta(StatusOwner.QUEUE, {"conditions": merged}))


class WorkloadNotCreated(Exception):
    """The API server refused the set's Workload (the set's condition says why); the loop
    retries with its backoff."""


def not_created(error: ApiError) -> QueuePlan:
    """The `QuotaPending` condition of a set whose Workload the API server refused."""
    if error.status == 404:
        message = (
            f"the Workload API ({WORKLOAD_API_VERSION}) is not served: install Kueue (with "
            f"{EXTERNAL_FRAMEWORK} in integrations.externalFrameworks) or remove the label "
            f"{LABEL_QUEUE}; the set creates no pods until then"
        )
        reason = "KueueNotInstalled"
    else:
        message = (
            f"the API server refused the set's Workload ({error}); the set creates no pods "
            "until it exists (the operator retries)"
        )
        reason = "WorkloadNotCreated"
    return QueuePlan(
        conditions=(ConditionChange(SetConditionType.QUOTA_PENDING.value, True, reason, message),)
    )
