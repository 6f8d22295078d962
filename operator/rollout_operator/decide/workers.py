"""Whether a set's participants may be checkpointed at all: multi-worker servers.

A pod whose server runs several worker processes that its control plane does not coordinate
(`multi_process: unmanaged` on its status route) would be checkpointed through whichever worker
answered the control call: the other workers' episodes would be missing from the records, and a
restore would run them again or lose them. The operator refuses such a set's checkpoints
instead (docs/design.md#47-workers; docs/protocol.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rollout_protocol import MultiProcess, StatusReply


def unmanaged_workers(statuses: Sequence[StatusReply], pods: Mapping[str, str]) -> str | None:
    """Why the set cannot be checkpointed (naming each pod), or None when it can. `pods`: the
    pod name of each instance (`environment-0` -> its pod)."""
    unmanaged = [s for s in statuses if s.multi_process is MultiProcess.UNMANAGED]
    if not unmanaged:
        return None
    named = ", ".join(
        f"pod {pods.get(s.instance, s.instance)} ({s.instance}, {s.workers} worker processes)"
        for s in sorted(unmanaged, key=lambda s: s.instance)
    )
    return (
        f"refused: {named} runs several worker processes that its control plane does not "
        "coordinate (status multi_process: unmanaged), so a checkpoint would miss the episodes "
        "of every worker but the one that answered. Run one worker per pod, or serve the workers "
        "with rollout_protocol.workers.serve_workers (rollout-server --workers N), which "
        "coordinates them all (docs/sdk.md, section 10)"
    )
