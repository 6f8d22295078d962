"""Phase StoppingAttempt of the recovery (docs/design.md#62-recovery): the lost attempt's pods
stop, or, InPlace, only the lost ones.

`Recreate` first asks the pods that outlived the loss what work the lost attempt did after its
checkpoint (`lastRecovery`, best effort), then deletes every pod of the lost attempt. `InPlace`
has the kept pods retire the lost attempt and relabels them into the target attempt, deleting
only the lost; when that cannot be done safely it falls back to Recreate, saying why. Either
way the step adds StartingPods to the pass, with `nextTryAt` marking when the try began, and a
fall-back (its reason on the Recovering condition, its Event) in the same write.

Safe to run again from StoppingAttempt (a successor's, or the next pass's after the write lost
a race): deleting pods is idempotent; InPlace finds its kept pods already relabelled into the
target (their retire is replayed by its operation id), and a fall-back whose Recreate ran
finds nothing left to keep and falls back again; Recreate finds no survivor left to count
(their work is reported uncounted).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from rollout_protocol import (
    Coordinator,
    HttpParticipantClient,
    RetireOutcome,
    Role,
)

from ...cluster.objects import (
    delete_attempt_pods,
    read_control_token,
)
from ...decide.inplace import instance_name, plan_in_place
from ...decide.resources import control_port, participant_url
from ...decide.setplan import PodView, attempt_instances
from ...decide.workloss import lost_reports
from ...model.api import (
    LABEL_ATTEMPT,
    LostWorkReport,
    RecoveryPhase,
    RestorePolicy,
    RolloutSet,
    SetConditionType,
    namespace_or_default,
)
from ...model.conditions import (
    ConditionUpdate,
    utcnow,
)
from ...model.reasons import Reason
from .context import (
    COUNT_RETIRE_SECONDS,
    STOP_GRACE_SECONDS,
    InPlaceRefused,
    RecoveryContext,
    RecoveryPass,
    change,
    logger,
    recovery_of,
    set_phase,
)
from .loss import find_losses, observe

FINISHED_ROLES: Final = (Role.ENVIRONMENT, Role.AGENT)
"""Roles that can tell which rollouts finished, best first (see `Coordinator.retire`)."""


def finished_from(lost_roles: set[Role]) -> list[Role]:
    """The roles a retire may learn the finished rollouts from: those that lost no pod."""
    return [role for role in FINISHED_ROLES if role not in lost_roles]


def reported_losses(retired: RetireOutcome) -> list[LostWorkReport]:
    """The work each participant's retire said the lost attempt did after its checkpoint."""
    return lost_reports({i: (w.since, w.counts) for i, w in retired.lost.items()})


async def stop_attempt(context: RecoveryContext, run: RecoveryPass) -> RecoveryPass:
    """StoppingAttempt: stop the lost attempt (InPlace: only its lost pods, the kept ones
    joining the target; Recreate: every pod, after counting the work they lose), then add
    StartingPods with `nextTryAt`, the try's start."""
    rset = run.rset
    recovery = recovery_of(rset)
    if recovery.restore_policy is RestorePolicy.IN_PLACE:
        try:
            return await keep_survivors(context, run)
        except InPlaceRefused as refused:
            rset = fall_back(run, str(refused))
            recovery = recovery_of(rset)
    fields: dict[str, Any] = {}
    if recovery.tries == 0 and recovery.fallback is None and not recovery.lost_work:
        fields["lost_work"] = await count_before_deleting(context, rset)
    # Every pod older than the target attempt goes: a survivor of the lost attempt would
    # keep running episodes that the restore also continues (they would complete twice).
    # Pods already labelled with the target attempt go too: an InPlace try kept them
    # (relabelled), and it failed or fell back. No pod of the target attempt was created
    # yet: that happens in the next phase.
    for attempt in range(recovery.from_attempt, recovery.target_attempt + 1):
        await delete_attempt_pods(context.kube, rset, attempt, grace_seconds=STOP_GRACE_SECONDS)
    replaced = [instance_name(i) for i in attempt_instances(rset, recovery.from_attempt, [])]
    # `nextTryAt` marks when this try began: its restoreTimeoutSeconds count from here.
    set_phase(
        run,
        RecoveryPhase.STARTING_PODS,
        next_try_at=utcnow(),
        kept=[],
        replaced=replaced,
        **fields,
    )
    return run


async def count_before_deleting(context: RecoveryContext, rset: RolloutSet) -> list[LostWorkReport]:
    """Recreate: the pods that outlived the loss retire the lost attempt before they are
    deleted, and say what it did after its checkpoint (work the restore has done again).
    Best effort within `COUNT_RETIRE_SECONDS`: a pod that does not answer is deleted all
    the same, its work uncounted."""
    recovery = recovery_of(rset)
    source = recovery.from_attempt
    pods, nodes_of, lost_nodes = await observe(context.kube, rset)
    losses = find_losses(rset, source, pods, nodes_of, lost_nodes)
    survivors = [
        p
        for p in pods
        if p.attempt == source
        and (p.role, p.index) not in losses
        and p.ip is not None
        and not p.finished
        and not p.terminating
    ]
    if not survivors:
        return []
    token = await read_control_token(
        context.kube, namespace_or_default(rset.metadata.namespace), rset.metadata.name
    )
    if token is None:
        return []
    reachable = [p for p in survivors if rset.spec.participant(p.role) is not None]
    try:
        retired = await retire_source(
            context,
            rset,
            reachable,
            token,
            seconds=COUNT_RETIRE_SECONDS,
            operation_id=f"recreate-a{source}-a{recovery.target_attempt}",
            lost_roles={role for role, _ in losses},
        )
    except (OSError, TimeoutError) as error:
        logger.info("set %s: survivors did not report lost work: %s", rset.metadata.name, error)
        return []
    if retired.failures:
        logger.info(
            "set %s: work of %s uncounted: %s",
            rset.metadata.name,
            ", ".join(f.instance for f in retired.failures),
            "; ".join(str(f) for f in retired.failures[:3]),
        )
    return reported_losses(retired)


async def keep_survivors(context: RecoveryContext, run: RecoveryPass) -> RecoveryPass:
    """InPlace: the kept pods retire the lost attempt and join the target; the lost go."""
    rset = run.rset
    recovery = recovery_of(rset)
    source, target = recovery.from_attempt, recovery.target_attempt
    pods, nodes_of, lost_nodes = await observe(context.kube, rset)
    lost = find_losses(rset, source, pods, nodes_of, lost_nodes)
    plan = plan_in_place(rset, source, target, pods, set(lost))
    if plan.refused is not None:
        raise InPlaceRefused(plan.refused)
    namespace = namespace_or_default(rset.metadata.namespace)
    token = await read_control_token(context.kube, namespace, rset.metadata.name)
    if token is None:
        raise InPlaceRefused("the set's control-token Secret is missing")
    for pod in plan.kept:
        if pod.ip is None or rset.spec.participant(pod.role) is None:
            raise InPlaceRefused(f"kept pod {pod.name} has no address")
    retired = await retire_source(
        context,
        rset,
        plan.kept,
        token,
        seconds=context.waits.retire_seconds,
        operation_id=f"in-place-a{source}-a{target}",
        lost_roles={role for role, _ in plan.replaced},
    )
    if retired.failures:
        raise InPlaceRefused(
            f"kept pod(s) could not retire attempt {source}: "
            + "; ".join(str(f) for f in retired.failures[:3])
        )
    for pod in plan.kept:
        if pod.attempt == target:
            continue
        relabelled = await context.kube.patch_pod_metadata(
            namespace, pod.name, labels={LABEL_ATTEMPT: str(target)}
        )
        if not relabelled:
            raise InPlaceRefused(f"kept pod {pod.name} is gone")
    # Only the lost pods are still labelled with the old attempt now.
    await delete_attempt_pods(context.kube, rset, source, grace_seconds=STOP_GRACE_SECONDS)
    kept = [p.name for p in plan.kept]
    replaced = [instance_name(i) for i in plan.replaced]
    logger.info(
        "set %s InPlace: keeping %s, replacing %s under attempt %d",
        rset.metadata.name,
        ", ".join(kept),
        ", ".join(replaced),
        target,
    )
    set_phase(
        run,
        RecoveryPhase.STARTING_PODS,
        next_try_at=utcnow(),
        kept=kept,
        replaced=replaced,
        lost_work=reported_losses(retired),
    )
    return run


async def retire_source(
    context: RecoveryContext,
    rset: RolloutSet,
    pods: Sequence[PodView],
    token: str,
    *,
    seconds: float,
    operation_id: str,
    lost_roles: set[Role],
) -> RetireOutcome:
    """The `pods` (each with an address and a participant spec) retire the recovery's source
    attempt within `seconds`, and say what it did after its checkpoint (both policies: the
    survivors Recreate deletes, the pods InPlace keeps)."""
    recovery = recovery_of(rset)
    clients: list[HttpParticipantClient] = []
    for pod in pods:
        spec = rset.spec.participant(pod.role)
        assert pod.ip is not None
        assert spec is not None
        url = participant_url(pod.ip, control_port(spec.template))
        clients.append(HttpParticipantClient(pod.role, url, index=pod.index, token=token))
    try:
        return await Coordinator(clients).retire(
            recovery.from_attempt,
            None,
            context.clock() + seconds,
            operation_id=operation_id,
            finished_from=finished_from(lost_roles),
        )
    finally:
        for client in clients:
            await client.aclose()


def fall_back(run: RecoveryPass, why: str) -> RolloutSet:
    """Recreate from here on, saying why on the Recovering condition and in an Event (added to
    the pass with the phase that follows, in its one write)."""
    rset = run.rset
    recovery = recovery_of(rset)
    message = f"InPlace recovery not possible, replacing every participant instead: {why}"
    logger.warning("set %s: %s", rset.metadata.name, message)
    updated = recovery.model_copy(
        update={"restore_policy": RestorePolicy.RECREATE, "fallback": why}
    )
    rset = change(
        run,
        {"recovery": updated},
        [
            ConditionUpdate.of(
                SetConditionType.RECOVERING.value, True, Reason.IN_PLACE_FALLBACK, message
            )
        ],
    )
    run.announce(Reason.IN_PLACE_FALLBACK, message, True)
    return rset
