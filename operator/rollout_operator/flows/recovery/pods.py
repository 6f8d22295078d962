"""Phase StartingPods of the recovery (docs/design.md#62-recovery): the target attempt's pods,
fresh or adopted standbys, until every one is Ready.

Ready standby pods of a lost role are adopted (relabelled into the target attempt under the lost
instance's index) when a checkpoint will be restored; fresh pods are created for the rest. The
step waits on the pods' events until all are Ready, failing the try when a pod ends, lands on a
NotReady node, or the try's restoreTimeoutSeconds end; then it writes the participants and
Restoring with the newest Ready checkpoint of the set (read from the checkpoints, never from
`status.latestCheckpoint`).
"""

from __future__ import annotations

from ...cluster.objects import (
    observe_pods,
    reconcile_pods,
)
from ...decide.inplace import instance_name
from ...decide.policy.views import checkpoint_views
from ...decide.resources import set_selector
from ...decide.setplan import PodView, attempt_instances
from ...decide.setstatus import newest_ready
from ...decide.standby import adoptions, standby_views
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
    POLL_SECONDS,
    RecoveryContext,
    RecoveryFailed,
    logger,
    patch,
    read_set,
    recovery_of,
    set_phase,
    try_deadline,
)
from .loss import observe


async def adopt_standbys(context: RecoveryContext, rset: RolloutSet) -> RolloutSet:
    """Take Ready standby pods for the target attempt's missing instances
    (docs/design.md#62-recovery).

    An adopted standby is relabelled into the target attempt under the lost instance's
    index (and marked with `ANNOTATION_ADOPTED`), so the attempt's plan counts it and
    creates fresh pods only for what no standby covers; the restore then gives it the
    instance's identity and peers. Only when a checkpoint will be restored (the restore is
    what re-identifies it). Idempotent: after an operator restart the annotation says which
    pods were adopted, and `recovery.adopted` is written from it."""
    recovery = recovery_of(rset)
    target = recovery.target_attempt
    if not rset.spec.standby.wanted() and not recovery.adopted:
        return rset
    if await restorable_checkpoint(context, rset) is None:
        return rset
    namespace = namespace_or_default(rset.metadata.namespace)
    raw = await context.kube.list_pods(namespace, set_selector(rset.metadata.name))
    views, nodes_of, lost_nodes = await observe(context.kube, rset)
    present = {(p.role, p.index) for p in views if p.attempt == target}
    missing = [i for i in attempt_instances(rset, target, views) if i not in present]
    # A standby on a node that is not Ready still shows Ready until the node controller
    # marks its pods: never adopt it (its restore would hang, the try fail).
    standbys = [
        s for s in standby_views(raw, rset.metadata.name) if nodes_of.get(s.name) not in lost_nodes
    ]
    picks = adoptions(rset, missing, standbys)
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
    return await patch(
        context, rset, {"recovery": recovery.model_copy(update={"adopted": adopted})}
    )


async def start_pods(context: RecoveryContext, rset: RolloutSet) -> RolloutSet:
    """StartingPods: adopt Ready standbys, create the rest of the target attempt's pods and
    wait for all of them to be Ready within the try's restoreTimeoutSeconds; then write the
    participants and Restoring with the checkpoint to restore (None: a fresh start)."""
    rset = await adopt_standbys(context, rset)
    recovery = recovery_of(rset)
    target = recovery.target_attempt
    deadline = try_deadline(rset)
    while True:
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
        if plan.all_ready:
            break
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
        # The pods' events end the wait (the cache's view of them costs no request).
        await context.kube.cache.wait_for_change(
            namespace_or_default(rset.metadata.namespace), rset.metadata.name, POLL_SECONDS
        )
        fresh = await read_set(
            context, namespace_or_default(rset.metadata.namespace), rset.metadata.name
        )
        if fresh is None:
            raise RecoveryFailed("SetDeleted", "the RolloutSet was deleted")
        if fresh.status.recovery is None:
            # Removed by hand: the next pass starts it again (repair_unfinished_recovery).
            raise RecoveryFailed("RecoveryRemoved", "status.recovery was removed")
        rset = fresh
    rset = await patch(context, rset, {"participants": plan.participants})
    checkpoint = await restorable_checkpoint(context, rset)
    return await set_phase(context, rset, RecoveryPhase.RESTORING, checkpoint=checkpoint)


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
