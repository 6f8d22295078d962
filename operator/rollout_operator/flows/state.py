"""The operator's in-process state: everything one operator process remembers between passes.

Status is the operator's memory (docs/design.md#610-status-written-by-hand); what a process keeps
besides it is only what saves API calls, Events or log lines, and every part starts empty after
a restart (docs/design.md#611-the-operators-in-process-state). All of it lives in one
`OperatorState`, made by the startup handler (`handlers/runtime.py`, Kopf's `memo`) and handed
explicitly to the handlers' wiring and from there to the flows; no module holds mutable state of
its own (`tests/unit/test_module_state.py` checks that).

One part per concern; each says what it holds, who writes it and who reads it. The parts are
plain synchronous objects: the operator runs on one event loop, and none of them awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from rollout_protocol import Role

from ..cluster.objects import OwnedObjects
from ..metrics import SetTransitions
from ..model.api import namespace_or_default

logger = logging.getLogger(__name__)

SetKey = tuple[str, str]
"""A set by (namespace, name); the namespace is "default" when the event had none."""

NOTES_LOGGED: Final = 1024
"""How many distinct notes (by set, reason and message) `LoggedNotes` remembers as logged."""


def _key(namespace: str | None, name: str) -> SetKey:
    return (namespace_or_default(namespace), name)


class Wakeups:
    """The wake-up Event of each per-set loop of one kind running in this process.

    Holds, per set, the `asyncio.Event` its loop's `PassLoop` waits on. Written by the loop
    itself (`registered`: on its start, and removed when it returns); read by whoever wants the
    loop to look again soon (`wake`): the handlers of the set's, its pods' and its checkpoints'
    events, the checkpoint daemon, and the policy pass (`wake_set`, to start a resume). One
    instance per kind of loop (`OperatorState.set_loops`, `OperatorState.policy_loops`).
    """

    def __init__(self) -> None:
        self._events: dict[SetKey, asyncio.Event] = {}

    @contextlib.contextmanager
    def registered(self, namespace: str, name: str) -> Iterator[asyncio.Event]:
        """The set's Event while its loop runs (the one already there, if an earlier loop of the
        set has not returned yet); removed afterwards unless a later loop replaced it."""
        key = _key(namespace, name)
        event = self._events.setdefault(key, asyncio.Event())
        try:
            yield event
        finally:
            if self._events.get(key) is event:
                del self._events[key]

    def wake(self, namespace: str | None, name: object) -> None:
        """Ask the set's loop for a pass soon (no-op when the set has no loop here, or `name`
        is not a set's name: a field read from an object may hold anything)."""
        if not isinstance(name, str):
            return
        event = self._events.get(_key(namespace, name))
        if event is not None:
            event.set()

    def sets(self) -> list[SetKey]:
        """The sets that have a loop here now (a copy: loops may start or end meanwhile)."""
        return list(self._events)


class SeenSummaries:
    """Per object, a summary of what a handler last saw of it, so that an event wakes a loop
    only when what the loop reads of the object changed.

    Two of them: `OperatorState.pods_seen`, per participant pod what the set's pass can see of
    it (labels, deletion, node, status: `handlers.rolloutset._what_the_pass_sees`), written and
    read by the pod-event handler (the set's pass annotating its pods after a checkpoint would
    otherwise wake it once per pod); and `OperatorState.checkpoints_seen`, per checkpoint its
    phase and deletion, written and read by the checkpoint-event handler
    (`handlers/rolloutcheckpoint.py`: its own finalizer patch, say, wakes nobody). An entry goes
    with the object's DELETED event.
    """

    def __init__(self) -> None:
        self._seen: dict[SetKey, object] = {}

    def changed(self, namespace: str | None, name: str, seen: object) -> bool:
        """Record what is seen of the object now (None: it is gone); whether that is news,
        i.e. differs from what was recorded (a deleted object always is)."""
        key = _key(namespace, name)
        if seen is None:
            self._seen.pop(key, None)
            return True
        if self._seen.get(key) == seen:
            return False
        self._seen[key] = seen
        return True

    def swap(self, namespace: str | None, name: str, seen: object) -> object:
        """Record what is seen of the object now (None: it is gone); what was recorded before
        (None: nothing)."""
        key = _key(namespace, name)
        before = self._seen.pop(key, None)
        if seen is not None:
            self._seen[key] = seen
        return before


class LatestWritten:
    """Per set, the `status.latestCheckpoint` its pass last wrote (or found right) in this
    process; a shown value that differs was written by someone else.

    Written by the set's pass (`flows.setpass.SetPass`, after each status write); read by
    the same pass (`setstatus.checkpoint_fields`: whether to report the repair of a value
    written by hand) and by the `latest` event filter (`handlers/rolloutset.py`), which wakes
    the set's loop when the shown value is not this one. Empty after a restart: nothing is then
    reported as written by someone else until the pass wrote once.
    """

    def __init__(self) -> None:
        self._written: dict[SetKey, str | None] = {}

    def record(self, namespace: str, name: str, latest: str | None) -> None:
        self._written[_key(namespace, name)] = latest

    def last(self, namespace: str, name: str) -> str | None:
        """What the pass last wrote (None also when it wrote nothing yet)."""
        return self._written.get(_key(namespace, name))

    def written_elsewhere(self, namespace: str, name: str, shown: object) -> bool:
        """Whether the set's `latestCheckpoint` is not what its pass last wrote here."""
        key = _key(namespace, name)
        return key in self._written and self._written[key] != shown


class LoggedNotes:
    """Which policy notes (by set, reason and message) this process has logged, so that each
    is logged once, not on every pass (a pass repeats its notes until the cause goes).

    Written and read by the policy pass (`flows.policypass.PolicyPass`). Bounded: past `limit`
    distinct notes the oldest is forgotten (and would be logged again if it came back).
    """

    def __init__(self, limit: int = NOTES_LOGGED) -> None:
        self._limit = limit
        self._logged: dict[tuple[str, str, str, str], None] = {}

    def first_time(self, namespace: str, name: str, reason: str, message: str) -> bool:
        """Whether this note was not logged yet; it counts as logged from now on."""
        key = (namespace, name, reason, message)
        if key in self._logged:
            return False
        self._logged[key] = None
        while len(self._logged) > self._limit:
            del self._logged[next(iter(self._logged))]
        return True


COORDINATED_REMEMBERED: Final = 4096
"""How many participant pods `CoordinatedPods` remembers (the oldest is forgotten first)."""


class CoordinatedPods:
    """The participant pods whose control plane said it coordinates its worker processes (or
    runs one), so that a checkpoint need not ask them again (docs/design.md#47-workers).

    A pod's servers cannot change for its life (participant pods never restart a container:
    `restartPolicy: Never`), so the answer holds per pod, by namespace, name and address (a pod
    created again under the same name gets a new identity here unless it also got the same
    address, and runs the same template then). Written and read by the checkpoint flow
    (`flows/checkpoint/prepare.py`, `check_participants`): a checkpoint asks only when a
    participant is not known here, i.e. the first checkpoint of each attempt. Bounded: past
    `limit` pods the oldest is forgotten (and asked again)."""

    def __init__(self, limit: int = COORDINATED_REMEMBERED) -> None:
        self._limit = limit
        self._known: dict[tuple[str, str, str], tuple[Role, ...] | None] = {}
        """(namespace, pod, address) -> the roles the pod said it waits on (None: it did not
        say; docs/design.md#44-order)."""

    def known(self, namespace: str, pods: list[tuple[str, str]]) -> bool:
        """Whether every (pod, address) of `pods` said so already."""
        return all((namespace, pod, address) in self._known for pod, address in pods)

    def waits_on(self, namespace: str, pod: str, address: str) -> tuple[Role, ...] | None:
        """The roles a known pod said it waits on; None: it did not say, or is not known."""
        return self._known.get((namespace, pod, address))

    def remember(
        self, namespace: str, pods: list[tuple[str, str, Collection[Role] | None]]
    ) -> None:
        """Each (pod, address, the roles it said it waits on) as coordinated."""
        for pod, address, waits in pods:
            self._known[(namespace, pod, address)] = None if waits is None else tuple(waits)
        while len(self._known) > self._limit:
            del self._known[next(iter(self._known))]


class CheckpointWork:
    """Per checkpoint, the work this process does on it besides Kopf's handlers: whether its
    flow runs here, and the task that removes its records once it is being deleted.

    `flow_running` is entered by the checkpoint daemon (`handlers/rolloutcheckpoint.py`) around
    the flow; `flow_runs` is read by the records removal, which waits until a deleted
    checkpoint's flow has aborted (participants resumed, the Lease released) before it removes
    anything. `remove` is called by the checkpoint-event handler (`handlers/policy.py`) on every
    event of a checkpoint being deleted that still has the records finalizer: one task per
    checkpoint (a repeat while it runs is a no-op), cancelled at the operator's exit (`close`;
    the successor starts it again from the event its watch's first listing delivers).
    """

    def __init__(self) -> None:
        self._flows: dict[SetKey, int] = {}
        self._removals: dict[SetKey, asyncio.Task[None]] = {}

    @contextlib.contextmanager
    def flow_running(self, namespace: str, name: str) -> Iterator[None]:
        key = _key(namespace, name)
        self._flows[key] = self._flows.get(key, 0) + 1
        try:
            yield
        finally:
            self._flows[key] -= 1
            if not self._flows[key]:
                del self._flows[key]

    def flow_runs(self, namespace: str, name: str) -> bool:
        return _key(namespace, name) in self._flows

    def remove(
        self, namespace: str, name: str, work: Callable[[], Coroutine[Any, Any, None]]
    ) -> asyncio.Task[None] | None:
        """Start `work` (the records removal of this checkpoint) unless it runs already; the
        task when this call started it."""
        key = _key(namespace, name)
        running = self._removals.get(key)
        if running is not None and not running.done():
            return None
        task = asyncio.create_task(work(), name=f"records of checkpoint {key[0]}/{key[1]}")
        self._removals[key] = task

        def ended(done: asyncio.Task[None]) -> None:
            if self._removals.get(key) is done:
                del self._removals[key]
            if not done.cancelled() and (error := done.exception()) is not None:
                logger.error("records removal of %s/%s failed: %r", *key, error)

        task.add_done_callback(ended)
        return task

    def removing(self, namespace: str, name: str) -> bool:
        return _key(namespace, name) in self._removals

    async def close(self) -> None:
        """Cancel every removal under way (the operator stops)."""
        tasks = list(self._removals.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class OperatorState:
    """Everything this operator process remembers outside the API server, one part per concern
    (see each part's docstring for who writes and who reads it).

    Made once per process by the startup handler and carried in Kopf's `memo`
    (`handlers.runtime.state_of`); the handlers hand its parts to the flows explicitly.
    """

    set_loops: Wakeups = field(default_factory=Wakeups)
    """The sets' reconcile loops (`handlers/rolloutset.py` `reconcile_loop`)."""
    policy_loops: Wakeups = field(default_factory=Wakeups)
    """The sets' checkpoint-policy loops (`handlers/policy.py` `policy_loop`)."""
    pods_seen: SeenSummaries = field(default_factory=SeenSummaries)
    checkpoints_seen: SeenSummaries = field(default_factory=SeenSummaries)
    latest_written: LatestWritten = field(default_factory=LatestWritten)
    owned_objects: OwnedObjects = field(default_factory=OwnedObjects)
    """Which sets' token Secret and Services this process ensured, and when: written and read
    by the set's pass (`cluster.objects.OwnedObjects`)."""
    logged_notes: LoggedNotes = field(default_factory=LoggedNotes)
    checkpoints: CheckpointWork = field(default_factory=CheckpointWork)
    coordinated_pods: CoordinatedPods = field(default_factory=CoordinatedPods)
    transitions: SetTransitions = field(default_factory=SetTransitions)
    """Each set's last status seen through its watch: written and read by the `observe`
    handler (`handlers/rolloutset.py`), which posts an Event per transition
    (`metrics.SetTransitions`)."""


__all__ = [
    "NOTES_LOGGED",
    "CheckpointWork",
    "CoordinatedPods",
    "LatestWritten",
    "LoggedNotes",
    "OperatorState",
    "SeenSummaries",
    "SetKey",
    "Wakeups",
]
