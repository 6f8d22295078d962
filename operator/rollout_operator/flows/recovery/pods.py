"""Phase StartingPods of the recovery (docs/design.md#62-recovery): the target attempt's pods,
fresh or adopted standbys, until every one is Ready.

Ready standby pods of a lost role are adopted (relabelled into the target attempt under the lost
instance's index) when a checkpoint will be restored; fresh pods are created for the rest. The
step does not wait within itself: while a pod is not Ready it leaves the phase as it is (adding
only the adopted standbys, when they changed) and the loop passes again on the pods' events
(`handlers/rolloutset.py` wakes the set's loop), on a NotReady node's, or at the try's deadline;
it fails the try when a pod ends, lands on a NotReady node, or the try's restoreTimeoutSeconds
end. Once all are Ready it adds the participants and Restoring with the newest Ready checkpoint
of the set (read from the checkpoints, never from `status.latestCheckpoint`), in one write.

Safe to run again from StartingPods (every pass while the pods start, a successor's, or the next
pass's after the write lost a race): adoption is idempotent (the annotation says which pods were
adopted), and the pods already created are counted by the attempt's plan, never created twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from ...cluster.objects import (
    observe_pods,
    reconcile_pods,
)
from ...decide.inplace import instance_name
from ...decide.policy.views import checkpoint_views
from ...decide.resources import set_selector
from ...decide.setplan import Instance, PodView, attempt_instances
from ...decide.setstatus import newest_ready
from ...decide.standby import StandbyView, adoptions, standby_views
from ...model.api import (
    ANNOTATION_ADOPTED,
    LABEL_ATTEMPT,
    LABEL_INDEX,
    LABEL_STANDBY,
    RecoveryPhase,
    RolloutSet,
    TargetLevel,
    namespace_or_default,
)
from ...model.reasons import Reason
from .context import (
    RecoveryContext,
    RecoveryFailed,
    RecoveryPass,
    change,
    logger,
    recovery_of,
    set_phase,
    try_deadline,
)
from .loss import observe


async def adopt_standbys(context: RecoveryContext, run: RecoveryPass) -> RolloutSet:
    """Take Ready standby pods for the target attempt's missing instances
    (docs/design.md#62-recovery).

    An adopted standby is relabelled into the target attempt under the lost instance's
    index (and marked with `ANNOTATION_ADOPTED`), so the attempt's plan counts it and
    creates fresh pods only for what no standby covers; the restore then gives it the
    instance's identity and peers. Only when a checkpoint will be restored (the restore is
    what re-identifies it), and only while instances are missing (the step's first pass).
    Idempotent: after an operator restart the annotation says which pods were adopted, and
    `recovery.adopted` is added to the pass from it (the step goes on in the same pass)."""
    rset = run.rset
    recovery = recovery_of(rset)
    target = recovery.target_attempt
    if not rset.spec.standby.wanted() and not recovery.adopted:
        return rset
    namespace = namespace_or_default(rset.metadata.namespace)
    views, nodes_of, lost_nodes = await observe(context.kube, rset)
    present = {(p.role, p.index) for p in views if p.attempt == target}
    missing = [i for i in attempt_instances(rset, target, views) if i not in present]
    if missing and await restorable_checkpoint(context, rset) is not None:
        raw = await context.kube.list_pods(namespace, set_selector(rset.metadata.name))
        # A standby on a node that is not Ready still shows Ready until the node controller
        # marks its pods: never adopt it (its restore would hang, the try fail).
        standbys = [
            s
            for s in standby_views(raw, rset.metadata.name)
            if nodes_of.get(s.name) not in lost_nodes
        ]
        await adopt(context, rset, adoptions(rset, missing, standbys))
    raw = await context.kube.list_pods(namespace, set_selector(rset.metadata.name))
    # Adopted by this recovery (the annotation names the attempt): a pod adopted by an
    # earlier one and kept since is an ordinary participant now.
    adopted = sorted(
        f"{instance}={meta['name']}"
        for meta in (p.get("metadata") or {} for p in raw)
        for instance, _, when in [
            str((meta.get("annotations") or {}).get(ANNOTATION_ADOPTED, "")).partition("@")
        ]
        if instance
        and when == str(target)
        and (meta.get("labels") or {}).get(LABEL_ATTEMPT) == str(target)
    )
    if adopted == recovery.adopted:
        return rset
    return change(
        run, {"recovery": recovery.model_copy(update={"adopted": adopted})}, requeue=False
    )


async def adopt(
    context: RecoveryContext, rset: RolloutSet, picks: Mapping[Instance, StandbyView]
) -> None:
    """Relabel each picked standby into the target attempt as the instance it covers."""
    namespace = namespace_or_default(rset.metadata.namespace)
    target = recovery_of(rset).target_attempt
    for instance, standby in picks.items():
        index = instance[1]
        relabelled = await context.kube.patch_pod_metadata(
            namespace,
            standby.name,
            labels={LABEL_ATTEMPT: str(target), LABEL_INDEX: str(index), LABEL_STANDBY: None},
            annotations={ANNOTATION_ADOPTED: f"{instance_name(instance)}@{target}"},
        )
        if relabelled:
            logger.info(
                "set %s: standby pod %s adopted as %s under attempt %d",
                rset.metadata.name,
                standby.name,
                instance_name(instance),
                target,
            )


async def start_pods(context: RecoveryContext, run: RecoveryPass) -> RecoveryPass:
    """StartingPods: adopt Ready standbys, create the rest of the target attempt's pods; once
    all of them are Ready, add the participants and Restoring with the checkpoint to restore
    (None: a fresh start). Until then the phase stays, and the loop looks again on the pods'
    events or at the try's deadline (restoreTimeoutSeconds), when the try fails."""
    rset = await adopt_standbys(context, run)
    recovery = recovery_of(rset)
    target = recovery.target_attempt
    deadline = try_deadline(rset)
    pods = await observe_pods(
        context.kube, namespace_or_default(rset.metadata.namespace), rset.metadata.name
    )
    outcome = await reconcile_pods(context.kube, rset, target, pods)
    plan = outcome.plan
    failed = [p for p in plan.existing.values() if p.finished]
    if failed:
        raise RecoveryFailed(
            Reason.PODS_NOT_READY,
            f"replacement pod {failed[0].name} ended: {failed[0].problem}",
        )
    if outcome.errors:
        raise RecoveryFailed(Reason.PODS_NOT_READY, "; ".join(outcome.errors[:3]))
    if not plan.all_ready:
        stranded = await on_lost_nodes(context, rset, list(plan.existing.values()))
        if stranded:
            raise RecoveryFailed(Reason.PODS_NOT_READY, stranded)
        if context.clock() > deadline:
            waiting = [p.pod for p in plan.participants if not p.ready]
            raise RecoveryFailed(
                Reason.PODS_NOT_READY,
                f"pods of attempt {target} not Ready within restoreTimeoutSeconds "
                f"({rset.spec.recovery.restore_timeout_seconds}): {', '.join(waiting[:5])}",
            )
        # The pods' events wake the loop before then (the cache's view costs no request).
        run.look_again_at(datetime.fromtimestamp(deadline, UTC))
        return run
    change(run, {"participants": plan.participants})
    checkpoint = await restorable_checkpoint(context, run.rset)
    set_phase(run, RecoveryPhase.RESTORING, checkpoint=checkpoint)
    return run


async def on_lost_nodes(
    context: RecoveryContext, rset: RolloutSet, pods: list[PodView]
) -> str | None:
    """Why a replacement pod can never become Ready: the scheduler placed it on a node that
    is NotReady (it may do so in the seconds before the node lifecycle controller taints a
    lost node). Failing the try at once lets the next attempt's pods land elsewhere,
    instead of waiting out restoreTimeoutSeconds."""
    waiting = {p.name for p in pods if not p.ready}
    if not waiting:
        return None
    _, nodes_of, lost_nodes = await observe(context.kube, rset)
    for name in sorted(waiting):
        node = nodes_of.get(name)
        if node is not None and node in lost_nodes:
            return f"replacement pod {name} was placed on node {node}, which is NotReady"
    return None


async def restorable_checkpoint(context: RecoveryContext, rset: RolloutSet) -> str | None:
    """The newest Ready (published) checkpoint of this set; None when there is none.

    Read from the checkpoints, not from `status.latestCheckpoint`: status is user-writable,
    and a name written there (an older checkpoint, another set's, none at all) must not
    decide what is restored (docs/design.md#610-status-written-by-hand). The two agree unless
    status was written."""
    if rset.spec.recovery.target_level is TargetLevel.SIBLING:
        return None
    namespace = namespace_or_default(rset.metadata.namespace)
    listed = await context.kube.list_checkpoints(namespace, rset.metadata.name)
    newest = newest_ready(checkpoint_views(listed))
    name = newest.name if newest is not None else None
    if name != rset.status.latest_checkpoint:
        logger.warning(
            "set %s: status.latestCheckpoint says %r, its newest Ready checkpoint is %r: "
            "restoring %r",
            rset.metadata.name,
            rset.status.latest_checkpoint,
            name,
            name,
        )
    return name
