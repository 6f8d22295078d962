"""The coordinator's side of persisting after the resume (docs/protocol.md, "Persist after
resume"): each participant's commit asked to cut (and committed again the old way where the
participant predates the capability), the commit's outcome, and the persist and discard
fan-outs that follow the resume.

Held apart from the `Coordinator` (`_coordinator.py`), whose `commit`, `persist` and `discard`
call these: the coordinator stays the steps, and this is what two of them do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._client import ParticipantClient, ParticipantError
from ._coordinator_calls import FanOut, split
from ._coordinator_outcomes import CommitOutcome, DiscardOutcome, Failure
from ._wire import (
    CommitReply,
    CommitRequest,
    DiscardReply,
    DiscardRequest,
    ErrorCode,
    PersistRequest,
    Phase,
)


async def commit_or_cut(participant: ParticipantClient, request: CommitRequest) -> CommitReply:
    """One participant's commit; one that predates `CommitRequest.persist_after_resume` (it
    refuses the field as unknown, before doing anything) is committed again without it, the
    old way: durably, inside the pause."""
    try:
        return await participant.commit(request)
    except ParticipantError as error:
        if (
            request.persist_after_resume is None
            or error.code is not ErrorCode.INVALID_REQUEST
            or "persist_after_resume" not in error.detail
        ):
            raise
    return await participant.commit(request.model_copy(update={"persist_after_resume": None}))


def commit_outcome(
    checkpoint_id: str,
    scope: list[str] | None,
    excluded: list[str],
    replies: Sequence[CommitReply],
    failures: list[Failure],
    *,
    held: list[str] | None = None,
) -> CommitOutcome:
    """A commit's (or a persist's) outcome from its replies."""
    manifests = {reply.manifest.instance: reply.manifest for reply in replies}
    return CommitOutcome(
        checkpoint_id=checkpoint_id,
        ok=not failures,
        scope=scope,
        excluded=excluded,
        manifests=manifests,
        manifest_paths={reply.manifest.instance: reply.manifest_path for reply in replies},
        listed={
            reply.manifest.instance: reply.rollout_ids
            for reply in replies
            if reply.rollout_ids is not None
        },
        record_count=sum(m.record_count for m in manifests.values()),
        bytes=sum(m.bytes for m in manifests.values()),
        committed_episodes=_committed_episodes(replies),
        failures=failures,
        held=held or [],
    )


def _committed_episodes(replies: Sequence[CommitReply]) -> dict[str, int]:
    """By instance, the episodes each reply says its records hold (`committed_episodes`); one
    that does not say (an older participant, NeMo Gym's dialect) is absent."""
    return {
        reply.manifest.instance: reply.committed_episodes
        for reply in replies
        if reply.committed_episodes is not None
    }


def _reply_of(outcome: CommitOutcome, instance: str) -> CommitReply:
    """The commit reply an outcome keeps of one instance (a durable one: `persist` keeps it)."""
    manifest = outcome.manifests[instance]
    return CommitReply(
        checkpoint_id=outcome.checkpoint_id,
        phase=Phase.COMMITTED,
        manifest=manifest,
        manifest_path=outcome.manifest_paths[instance],
        rollout_ids=outcome.listed.get(instance),
        committed_episodes=outcome.committed_episodes.get(instance),
    )


async def persist_cut(
    fan_out: FanOut,
    participants: Sequence[ParticipantClient],
    checkpoint_id: str,
    deadline_ts: float,
    cut: CommitOutcome | None,
    progress: Callable[[str], None],
) -> CommitOutcome:
    """`Coordinator.persist`."""
    targets = [p for p in participants if cut is None or p.instance in cut.held]
    request = PersistRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
    progress(f"persist: {len(targets)} participant(s)")
    results = await fan_out(targets, lambda p: p.persist(request))
    replies, failures = split(targets, results)
    if cut is None:
        return commit_outcome(checkpoint_id, None, [], replies, failures)
    kept = [_reply_of(cut, i) for i in cut.manifests if i not in cut.held]
    persisted: list[CommitReply] = []
    for reply in replies:
        promised = cut.manifests.get(reply.manifest.instance)
        if promised != reply.manifest:
            failures.append(
                Failure(
                    instance=reply.manifest.instance,
                    code=ErrorCode.INTERNAL,
                    detail=f"persisted manifest {reply.manifest.records_sha256} "
                    f"({reply.manifest.record_count} records) is not the one its cut "
                    f"promised ({promised.records_sha256 if promised else 'none'})",
                )
            )
        else:
            instance = reply.manifest.instance
            persisted.append(
                reply.model_copy(
                    update={
                        "rollout_ids": cut.listed.get(instance),
                        # the cut's count: the same records (their manifest is the one promised)
                        "committed_episodes": cut.committed_episodes.get(instance),
                    }
                )
            )
    outcome = commit_outcome(
        checkpoint_id,
        cut.scope,
        cut.excluded,
        kept + persisted,
        [*cut.failures, *failures],
    )
    progress(f"persisted {len(persisted)} participant(s), {len(outcome.failures)} failed")
    return outcome


async def discard_cut(
    fan_out: FanOut,
    participants: Sequence[ParticipantClient],
    checkpoint_id: str,
    deadline_ts: float,
    cut: CommitOutcome | None,
    progress: Callable[[str], None],
) -> DiscardOutcome:
    """`Coordinator.discard`."""
    targets = [p for p in participants if cut is None or p.instance in cut.held]
    request = DiscardRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
    results = await fan_out(targets, lambda p: p.discard(request))
    replies, failures = split(targets, results)
    progress(f"discarded {checkpoint_id} on {len(replies)} participant(s), {len(failures)} failed")
    by_instance = {p.instance: results[p.instance] for p in targets}
    return DiscardOutcome(
        checkpoint_id=checkpoint_id,
        discarded=[
            i for i, r in by_instance.items() if isinstance(r, DiscardReply) and r.discarded
        ],
        removed=[i for i, r in by_instance.items() if isinstance(r, DiscardReply) and r.removed],
        failures=failures,
    )
