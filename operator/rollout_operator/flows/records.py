"""Removing a set's checkpoint records wherever its volume or bucket is (`RecordsRemover`).

Retention and the finalizers remove the records of checkpoints that go
(docs/design.md#65-retention-and-records). Records live on the set's own volume, which the
operator's pod usually cannot mount (a claim in a team's namespace, a hostPath on another node), so
the removal goes through whatever mounts it, in this order:

1. **Here**, when this process sees the volume (`StorageLocator.root`: devcluster's hostPath,
   the chart's `storage.claims`).
2. **The set's participants**: every live participant pod gets the `remove` control call, which
   removes the named checkpoints below the participant's own set directory (a request names
   checkpoints, never a path). Every pod is asked, because a hostPath volume differs per node;
   a participant whose checkpoint is open refuses, and the removal is tried again shortly. A
   bucket is the same for every pod, so one participant that answers is enough there.
3. **A cleanup pod** in the set's namespace, when no participant answers (a suspended, deleted
   or crash-looping set): it mounts the set's volume and runs `rollout-records remove`, the
   same removal code, from `$ROLLOUT_CLEANUP_IMAGE`; its result is read from its termination
   message and exit code, and the pod is deleted. Until it has finished, `RemovalPending` asks
   the caller to look again (a finalizer retries).

A set whose records are in an S3-API bucket goes the same way, from the second step: the operator
never holds the bucket's credentials, so its participants (which mount the Secret) remove the keys,
or a cleanup pod that mounts the Secret and runs `rollout-records remove` on the bucket
(docs/design.md#65-retention-and-records).

Every way removes only the protocol's own files, never through a symlink
(`rollout_protocol.remove_records`), and says honestly what stayed: a `RecordsRemoval` whose
`not_removed` is the text of a `RecordsNotRemoved` Warning when anything is left.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
from rollout_protocol import (
    MAX_KEPT_LISTED,
    ErrorCode,
    HttpParticipantClient,
    ParticipantError,
    RemoveReply,
    RemoveRequest,
    Role,
    StorageError,
    remove_records,
)

from ..cluster.kube import Kube
from ..cluster.objects import read_control_token
from ..cluster.storage import CLEANUP_IMAGE_ENV, StorageLocator
from ..decide.resources import (
    CLEANUP_DEADLINE_SECONDS,
    LABEL_RECORDS_OF,
    cleanup_pod,
    control_port,
    participant_url,
    set_dir,
    set_selector,
)
from ..model.api import LABEL_INDEX, LABEL_ROLE, RolloutSet, namespace_or_default

logger = logging.getLogger(__name__)

CALL_SECONDS: Final = 10.0
"""Deadline of one `remove` call to a participant (a removal is a few unlinks and fsyncs)."""
CLEANUP_GIVE_UP_SECONDS: Final = CLEANUP_DEADLINE_SECONDS + 60
"""A cleanup pod that has not finished this long after its creation (never scheduled, its
image never pulled) is deleted and the records reported as not removed."""
Clock = Callable[[], float]


class RemovalPending(Exception):
    """The removal is under way (a cleanup pod runs) or must wait (a participant's checkpoint
    is open): look again shortly."""


@dataclass(frozen=True)
class RecordsRemoval:
    """What a removal did: `outcome` for the log; `not_removed`, when anything stays on the
    volume, the message of a `RecordsNotRemoved` Warning naming it."""

    outcome: str
    not_removed: str | None = None
    removed: bool = False
    """Something was there and removed (a removal of what was absent is quiet in the log)."""


class RecordsRemover:
    """Removes a set's checkpoint records through whatever mounts its volume (module docstring)."""

    def __init__(
        self, kube: Kube, locator: StorageLocator | None = None, *, clock: Clock = time.time
    ) -> None:
        self._kube = kube
        self._locator = locator or StorageLocator.from_env()
        self._clock = clock

    async def remove(self, rset: RolloutSet, checkpoints: Sequence[str] | None) -> RecordsRemoval:
        """Remove these checkpoints' records, or (None) every record of the set and its folder.

        Raises `RemovalPending` while a cleanup pod works or a participant's checkpoint is open."""
        scope = None if checkpoints is None else tuple(dict.fromkeys(checkpoints))
        what = _what(rset, scope)
        namespace = namespace_or_default(rset.metadata.namespace)
        root = self._locator.root(namespace, rset.spec.storage)
        if root is not None:
            return await remove_here(root, rset, scope)
        answered = await self._through_participants(rset, scope, what)
        if answered is not None:
            return answered
        if self._locator.cleanup_image:
            return await self._through_pod(rset, scope, what, self._locator.cleanup_image)
        message = (
            f"{what} not removed: no participant of the set runs to remove them, the operator "
            f"cannot reach {self._locator.describe(namespace, rset.spec.storage)}, and no "
            f"cleanup image is configured ({CLEANUP_IMAGE_ENV}); delete "
            f"{_folder(rset, scope)} by hand"
        )
        return RecordsRemoval(message, not_removed=message)

    # --- the three ways ---------------------------------------------------------------------------

    async def _through_participants(
        self, rset: RolloutSet, scope: tuple[str, ...] | None, what: str
    ) -> RecordsRemoval | None:
        """Ask every live participant pod; None when none answered (none runs, or all failed)."""
        namespace = namespace_or_default(rset.metadata.namespace)
        urls = _participant_urls(
            rset, await self._kube.list_pods(namespace, set_selector(rset.metadata.name))
        )
        if not urls:
            return None
        token = await read_control_token(self._kube, namespace, rset.metadata.name)
        request = RemoveRequest(
            deadline_ts=self._clock() + CALL_SECONDS,
            checkpoint_ids=list(scope or ()),
            whole_set=scope is None,
        )
        replies: list[RemoveReply] = []
        failures: list[str] = []
        busy: list[str] = []

        async def ask(role: Role, index: int, url: str) -> None:
            async with HttpParticipantClient(role, url, index=index, token=token) as client:
                try:
                    replies.append(await client.remove(request))
                except ParticipantError as error:
                    if error.code is ErrorCode.CONFLICTING_CHECKPOINT:
                        busy.append(str(error))
                    else:
                        failures.append(str(error))

        if rset.spec.storage.s3 is not None:
            # One bucket for every pod: the first participant that answers removed it all.
            for role, index, url in urls:
                await ask(role, index, url)
                if replies or busy:
                    break
        else:
            async with anyio.create_task_group() as group:
                for role, index, url in urls:
                    group.start_soon(ask, role, index, url)
        if busy:
            raise RemovalPending(f"{what}: {busy[0]}")
        if failures:
            logger.info("set %s: %s: participants failed: %s", rset.metadata.name, what, failures)
        if not replies:
            return None
        return _summary(what, _merged(replies), f"by {len(replies)} participant(s)")

    async def _through_pod(
        self, rset: RolloutSet, scope: tuple[str, ...] | None, what: str, image: str
    ) -> RecordsRemoval:
        namespace = namespace_or_default(rset.metadata.namespace)
        manifest = cleanup_pod(rset, scope, image)
        name = manifest["metadata"]["name"]
        # Listed by its label, not read by name: the `list` the chart grants for pods already
        # covers it (no `get` on pods needed).
        listed = await self._kube.list_pods(namespace, f"{LABEL_RECORDS_OF}={rset.metadata.name}")
        pod = next((p for p in listed if (p.get("metadata") or {}).get("name") == name), None)
        if pod is None:
            await self._kube.create_pod(namespace, manifest)
            logger.info("set %s: cleanup pod %s removes the %s", rset.metadata.name, name, what)
            raise RemovalPending(f"cleanup pod {name} removes the {what}")
        status = pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            await self._kube.delete_pod(namespace, name, grace_seconds=0)
            reply, failure = _pod_result(pod)
            if reply is not None:
                return _summary(what, reply, f"by cleanup pod {name}")
            message = f"{what} not removed: cleanup pod {name} failed: {failure}"
            return RecordsRemoval(message, not_removed=message)
        created = _timestamp((pod.get("metadata") or {}).get("creationTimestamp"))
        if created is not None and self._clock() - created > CLEANUP_GIVE_UP_SECONDS:
            await self._kube.delete_pod(namespace, name, grace_seconds=0)
            message = (
                f"{what} not removed: cleanup pod {name} did not finish within "
                f"{CLEANUP_GIVE_UP_SECONDS:g}s ({_waiting(pod)}); delete "
                f"{_folder(rset, scope)} by hand"
            )
            return RecordsRemoval(message, not_removed=message)
        raise RemovalPending(f"cleanup pod {name} is {status.get('phase') or 'Pending'}")


async def remove_here(root: Path, rset: RolloutSet, scope: Sequence[str] | None) -> RecordsRemoval:
    """Remove records on a volume this process sees at `root` (a worker thread does the I/O):
    these checkpoints', or (None) every record of the set and its folder."""
    checkpoints = None if scope is None else tuple(dict.fromkeys(scope))
    what = _what(rset, checkpoints)
    try:
        reply = await anyio.to_thread.run_sync(
            lambda: remove_records(
                root, set_dir(rset), checkpoints or (), whole_set=checkpoints is None
            )
        )
    except (StorageError, ValueError) as error:
        message = f"{what} not removed: {error}"
        return RecordsRemoval(message, not_removed=message)
    return _summary(what, reply, "by the operator")


# --- pure helpers ---------------------------------------------------------------------------------


def _what(rset: RolloutSet, scope: tuple[str, ...] | None) -> str:
    if scope is None:
        return f"records of set {rset.metadata.name}"
    return f"records of checkpoint{'s' if len(scope) > 1 else ''} {', '.join(scope)}"


def _folder(rset: RolloutSet, scope: tuple[str, ...] | None) -> str:
    """What a person deletes by hand: the folder on the volume, or the keys in the bucket."""
    below = set_dir(rset) if scope is None or len(scope) != 1 else f"{set_dir(rset)}/{scope[0]}"
    s3 = rset.spec.storage.s3
    if s3 is None:
        return f"<volume>/{below}"
    prefix = f"{s3.prefix}/" if s3.prefix else ""
    return f"the keys below s3://{s3.bucket}/{prefix}{below}/ (endpoint {s3.endpoint})"


def _participant_urls(
    rset: RolloutSet, pods: Sequence[Mapping[str, Any]]
) -> list[tuple[Role, int, str]]:
    """The control URL of every running participant pod of the set, any attempt."""
    urls = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not ip:
            continue
        try:
            role = Role((meta.get("labels") or {}).get(LABEL_ROLE, ""))
        except ValueError:
            continue
        spec = rset.spec.participant(role)
        if spec is None:
            continue
        index = int((meta.get("labels") or {}).get(LABEL_INDEX) or 0)
        urls.append((role, index, participant_url(ip, control_port(spec.template))))
    return urls


def _merged(replies: Sequence[RemoveReply]) -> RemoveReply:
    """One reply for a volume seen by several participants: removed where any removed it,
    absent where all found it absent, every entry any of them left in place."""
    removed = list(dict.fromkeys(item for reply in replies for item in reply.removed))
    absent = [
        item
        for item in dict.fromkeys(item for reply in replies for item in reply.absent)
        if item not in removed
    ]
    kept = list(dict.fromkeys(item for reply in replies for item in reply.kept))
    count = max(len(kept), max(reply.kept_count for reply in replies))
    return RemoveReply(
        removed=removed, absent=absent, kept=kept[:MAX_KEPT_LISTED], kept_count=count
    )


def _summary(what: str, reply: RemoveReply, how: str) -> RecordsRemoval:
    parts = []
    if reply.removed:
        parts.append(f"{', '.join(reply.removed)} removed {how}")
    if reply.absent:
        parts.append(
            f"{', '.join(reply.absent)} {'were' if len(reply.absent) > 1 else 'was'} absent"
        )
    outcome = f"{what}: {'; '.join(parts) or 'nothing to remove'}"
    if not reply.kept_count:
        return RecordsRemoval(outcome, removed=bool(reply.removed))
    more = (
        f" and {reply.kept_count - len(reply.kept)} more"
        if reply.kept_count > len(reply.kept)
        else ""
    )
    kept = (
        f"{what}: kept on the volume, not written by the operator's participants "
        f"(a file someone added, a symlink or a special file): {', '.join(reply.kept)}{more}; "
        "remove them by hand if they are not needed"
    )
    return RecordsRemoval(f"{outcome}; {kept}", not_removed=kept, removed=bool(reply.removed))


def _pod_result(pod: Mapping[str, Any]) -> tuple[RemoveReply | None, str]:
    """The reply a finished cleanup pod wrote into its termination message, or why there is none."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    terminated = ((statuses[0].get("state") or {}).get("terminated") or {}) if statuses else {}
    code = terminated.get("exitCode")
    message = terminated.get("message") or ""
    if code in (0, 3) and message:
        try:
            return RemoveReply.model_validate(json.loads(message)), ""
        except ValueError:
            pass
    reason = terminated.get("reason") or (pod.get("status") or {}).get("reason") or "unknown"
    return None, f"exit code {code}, {reason}: {message.strip()[:300] or 'no message'}"


def _waiting(pod: Mapping[str, Any]) -> str:
    """Why a pod has not finished, from its container's waiting state or its conditions."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting:
            return f"{waiting.get('reason')}: {waiting.get('message') or ''}".strip(": ")
    for condition in status.get("conditions") or []:
        if condition.get("status") == "False" and condition.get("message"):
            return f"{condition.get('reason')}: {condition['message']}"
    return f"phase {status.get('phase') or 'Pending'}"


def _timestamp(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
