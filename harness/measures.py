"""What a recovery did, measured from outside the operator.

`Timeline` and `observe_recovery` note when each step of a recovery (`RECOVERY_STEPS`) was first
seen on the RolloutSet. `StatsTracker` keeps the last `/stats?detail=true` of every participant
pod, also of those the loss killed. `checkpoint_records` and `generation_prefixes` read what a
published checkpoint kept, and `measure_redone` counts the steps and model tokens done again by
the episodes that ran again after the loss (`Redone`).

The demo's summary, `bench/recovery.py`, `bench/container_recovery.py` and the e2e tests count
with these same functions (so what the demo shows is what they check); they live here rather
than in the `make demo` script.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import httpx
from kubernetes_asyncio import client as k8s
from rollout_protocol import BucketStore
from rollout_protocol import _storage as storage
from rollout_servers.client import EpisodeResult

from harness.objects import Resources

# --- observing a recovery --------------------------------------------------------------------


@dataclass
class Timeline:
    """When the observer first saw each step of the first recovery (monotonic seconds)."""

    events: dict[str, float] = field(default_factory=dict)
    attempts: list[int] = field(default_factory=list)

    def mark(self, event: str, at: float) -> None:
        self.events.setdefault(event, at)

    def since(self, event: str, origin: str = "killed") -> float | None:
        if event not in self.events or origin not in self.events:
            return None
        return self.events[event] - self.events[origin]


RECOVERY_STEPS: Final = (
    ("killed", "pod killed"),
    ("loss_detected", "loss detected (Recovering)"),
    ("pods_ready", "fresh pods Ready"),
    ("restored", "records restored"),
    ("resumed", "resumed, set Ready"),
)


async def observe_recovery(
    resources: Resources, timeline: Timeline, from_attempt: int, stop: anyio.Event
) -> None:
    """Poll the set every 0.1 s and note when its recovery from `from_attempt` moves on.

    Phases map to the steps a user cares about: the recovery appears (loss detected), it enters
    Restoring (the fresh pods are all Ready), Resuming (every participant installed the records),
    and it disappears with the attempt advanced (resumed; the set is Ready again).
    """
    while not stop.is_set():
        try:
            obj = await resources.rollout_set()
        except (k8s.ApiException, OSError, TimeoutError):
            obj = None
        now = time.monotonic()
        if obj is not None:
            status = obj.get("status") or {}
            recovery = status.get("recovery")
            attempt = status.get("attempt")
            if isinstance(attempt, int) and attempt not in timeline.attempts:
                timeline.attempts.append(attempt)
            if recovery and recovery.get("fromAttempt") == from_attempt:
                timeline.mark("loss_detected", now)
                phase = recovery.get("phase")
                if phase in ("Restoring", "Resuming"):
                    timeline.mark("pods_ready", now)
                if phase == "Resuming":
                    timeline.mark("restored", now)
            elif isinstance(attempt, int) and attempt > from_attempt:
                timeline.mark("loss_detected", now)
                timeline.mark("pods_ready", now)
                timeline.mark("restored", now)
                timeline.mark("resumed", now)
                return
        with anyio.move_on_after(0.1):
            await stop.wait()


class StatsTracker:
    """The last `/stats?detail=true` of every participant pod the set has shown.

    Pods of a lost attempt die (the model by SIGKILL, the others when the recovery deletes
    them), and their counters with them; the tracker keeps the last reply each pod gave, polled
    every `interval` seconds, so work done before the loss can be compared with the work done
    again after it. Counts may miss what a dying pod did in its last interval.
    """

    def __init__(self, http: httpx.AsyncClient, token: str, interval: float = 0.2) -> None:
        self.http = http
        self.interval = interval
        self.headers = {"Authorization": f"Bearer {token}"}
        """detail=true lists rollout ids: the participants ask for the set's control token."""
        self.addresses: dict[str, tuple[str, str]] = {}
        """pod name -> (role, address)"""
        self.last: dict[str, dict[str, Any]] = {}

    def learn(self, obj: Mapping[str, Any]) -> None:
        for participant in (obj.get("status") or {}).get("participants") or []:
            if participant.get("address"):
                self.addresses[participant["pod"]] = (participant["role"], participant["address"])

    async def poll_pod(self, pod: str) -> dict[str, Any] | None:
        """Read one pod's counters now (and keep them); None when it does not answer."""
        _, address = self.addresses[pod]
        try:
            reply = await self.http.get(
                address + "/stats", params={"detail": "true"}, headers=self.headers, timeout=1.0
            )
        except httpx.HTTPError:
            return None
        if reply.status_code != 200:
            return None
        body: dict[str, Any] = reply.json()
        self.last[pod] = body
        return body

    async def poll_once(self) -> None:
        async with anyio.create_task_group() as group:
            for pod in list(self.addresses):
                group.start_soon(self.poll_pod, pod)

    async def run(self, resources: Resources, stop: anyio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(k8s.ApiException, OSError, TimeoutError):
                self.learn(await resources.rollout_set())
            await self.poll_once()
            with anyio.move_on_after(self.interval):
                await stop.wait()

    def by_role(self, role: str) -> list[dict[str, Any]]:
        return [
            self.last[pod]
            for pod, (r, _) in self.addresses.items()
            if r == role and pod in self.last
        ]


# --- measuring what was redone ------------------------------------------------------------------


def checkpoint_folder(storage_root: Path, set_name: str, checkpoint: str) -> Path:
    """A checkpoint's folder on the volume: `<namespace>/<set>/<uid>/<checkpoint>` for a set
    the operator runs (one namespace and uid per test storage folder), `<set>/<checkpoint>`
    for participants run without it."""
    found = sorted(storage_root.glob(f"*/{set_name}/*/{checkpoint}"))
    if not found:
        return storage_root / set_name / checkpoint
    assert len(found) == 1, f"checkpoint {checkpoint} of {set_name} in several sets: {found}"
    return found[0]


def checkpoint_records(storage_root: Path, set_name: str, checkpoint: str) -> dict[str, list[Any]]:
    """The records of a published checkpoint, per participant instance (verified digests)."""
    base = checkpoint_folder(storage_root, set_name, checkpoint)
    out: dict[str, list[Any]] = {}
    for directory in sorted(p for p in base.iterdir() if p.is_dir()):
        _, records = storage.read_records(directory, expect_checkpoint_id=checkpoint)
        out[directory.name] = records
    return out


def bucket_checkpoint_records(
    store: BucketStore, set_dir: str, checkpoint: Mapping[str, Any]
) -> dict[str, list[Any]]:
    """The records of a published checkpoint in a bucket, per participant instance (verified
    digests); blocks, so call it in a worker thread."""
    name = checkpoint["metadata"]["name"]
    return {
        participant["instance"]: store.read_records(set_dir, name, participant["instance"])[1]
        for participant in checkpoint["status"]["participants"]
    }


def generation_prefixes(records: Mapping[str, list[Any]]) -> dict[str, int]:
    """Tokens the checkpoint kept per model request (`<rollout>/<key>`): a cut generation's
    prefix, or the whole of a held or delivered response."""
    kept: dict[str, int] = {}
    for instance, items in records.items():
        if not instance.startswith("model-"):
            continue
        for record in items:
            data = record.data
            tokens = (
                data.get("tokens")
                if record.kind == "delivered"
                else (data.get("state") or {}).get("tokens")
            )
            if isinstance(tokens, int):
                key = f"{record.rollout_id}/{record.key}"
                kept[key] = max(kept.get(key, 0), tokens)
    return kept


@dataclass
class Redone:
    """Work done more than once, over the episodes that ran again after the loss."""

    rerun: int = 0
    """Episodes whose /run was re-issued under the new attempt."""
    steps: int = 0
    """Completed environment stages and agent steps (model and tool calls) that had completed
    before, in an earlier attempt: each step name of an episode counts once in a clean run. A
    model call answered again from the checkpoint's record (a response held or delivered while
    the checkpoint was open) generates nothing and is not counted."""
    tokens: int = 0
    """Model tokens generated again: generated before the loss and not kept by the restored
    checkpoint (its cut prefixes and held responses), for requests generated again after it."""
    by_step: dict[str, int] = field(default_factory=dict)
    """Steps redone by kind (`model`, `tool`, `seed`, `invoke_agent`, `verify`)."""


def completed_steps(
    stats: Sequence[Mapping[str, Any]], rollout_id: str, after: int | None = None
) -> dict[str, int]:
    """Completions per step name of one rollout, summed over pods and attempts (only the
    attempts later than `after`, when given)."""
    counts: dict[str, int] = defaultdict(int)
    for reply in stats:
        by_attempt = (reply.get("rollouts") or {}).get(rollout_id) or {}
        for attempt, steps in by_attempt.items():
            if after is not None and int(attempt) <= after:
                continue
            for name, events in steps.items():
                if name in ("run", "close", "cleanup"):
                    continue
                counts[name] += int(events.get("completed", 0))
    return counts


def tokens_by_attempt(stats: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, int]]:
    """Model tokens per attempt and request key, summed over model pods."""
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for reply in stats:
        for attempt, entry in (reply.get("tokens") or {}).items():
            for key, count in (entry.get("by_request") or {}).items():
                out[int(attempt)][key] += int(count)
    return out


def started_under(tracker: StatsTracker, attempt: int) -> set[str]:
    """Rollouts whose /run started on an environment under `attempt`."""
    return {
        rid
        for reply in tracker.by_role("environment")
        for rid, by_attempt in (reply.get("rollouts") or {}).items()
        if ((by_attempt.get(str(attempt)) or {}).get("run") or {}).get("started")
    }


def measure_redone(
    tracker: StatsTracker,
    results: Sequence[EpisodeResult],
    first_attempt: int,
    kept_prefixes: Mapping[str, int],
) -> Redone:
    """Steps and tokens redone by the episodes that ran again after the loss of `first_attempt`:
    those that had started under it and finished under a later attempt. (Episodes the client
    had not started yet when the pod died redo nothing.)"""
    workers = tracker.by_role("environment") + tracker.by_role("agent")
    started = started_under(tracker, first_attempt)
    rerun = [r for r in results if r.attempt > first_attempt and r.rollout_id in started]
    redone = Redone(rerun=len(rerun))
    tokens = tokens_by_attempt(tracker.by_role("model"))
    before = tokens.get(first_attempt, {})
    after: dict[str, int] = defaultdict(int)
    for attempt, by_key in tokens.items():
        if attempt > first_attempt:
            for key, count in by_key.items():
                after[key] += count
    for result in rerun:
        rid = result.rollout_id
        later = completed_steps(workers, rid, after=first_attempt)
        for name, count in completed_steps(workers, rid).items():
            kind, _, turn = name.partition("@")
            if kind == "model" and after.get(f"{rid}/{turn}", 0) == 0:
                # Served again from the checkpoint's record (a held or delivered response):
                # the agent's step ran again, the model generated nothing.
                count -= later.get(name, 0)
            if count > 1:
                redone.steps += count - 1
                redone.by_step[kind] = redone.by_step.get(kind, 0) + count - 1
    rerun_ids = {r.rollout_id for r in rerun}
    for key, count in before.items():
        if key.partition("/")[0] in rerun_ids and after.get(key, 0) > 0:
            redone.tokens += max(0, count - kept_prefixes.get(key, 0))
    return redone
