"""What the control plane keeps beside its phase machine, each bounded: the retire marks (which
rollouts of the running attempt must never run again here), the garbage collector held off
during a checkpoint, the claims of checkpoints whose records are being removed, and the records
held by cuts until their persist (`HeldCuts`).
"""

from __future__ import annotations

import gc
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import anyio

from ._phases import REMEMBERED
from ._settings import MAX_RETIRE_MARKS
from ._storage import EncodedRecord
from ._wire import (
    CommitReply,
    ErrorCode,
    ProtocolError,
)

# --- retire marks ---------------------------------------------------------------------------


class RetireMarks:
    """Which (attempt, rollout) pairs must never run again here, in bounded memory.

    A participant only ever runs its current attempt, so every rollout of an attempt below it
    is refused for good: once the attempt moves on (`settle`), the per-rollout marks of older
    attempts fold into one whole-attempt mark each, and whole-attempt marks beyond the newest
    `_WHOLE_KEPT` fold into `floor` (every attempt at or below it is retired). Per-rollout marks
    of the running (or a later) attempt are real state: they are bounded by `limit`, and a
    retire that would pass it is refused (`limit_exceeded`) until `forget` frees marks.
    """

    _WHOLE_KEPT = 64

    def __init__(self, limit: int = MAX_RETIRE_MARKS) -> None:
        self.limit = limit
        self.floor = -1
        self._whole: set[int] = set()
        self._rollouts: dict[int, set[str]] = {}

    def room(self, attempt: int, rollout_ids: frozenset[str] | None) -> None:
        """Refuse a retire whose marks would not fit (before anything is marked)."""
        if self.covers_attempt(attempt):
            return
        if rollout_ids is None:
            if len(self._whole) >= self.limit:
                raise ProtocolError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"{len(self._whole)} attempts are retired here already (limit {self.limit})",
                )
            return
        marked = self._rollouts.get(attempt, set())
        new = len(rollout_ids - marked)
        if self.count() + new > self.limit:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"retiring {new} more rollouts would hold {self.count() + new} retire marks "
                f"(limit {self.limit}); forget finished rollouts first",
            )

    def add(self, attempt: int, rollout_ids: frozenset[str] | None) -> None:
        if self.covers_attempt(attempt):
            return
        if rollout_ids is None:
            self._whole.add(attempt)
            self._rollouts.pop(attempt, None)  # the whole-attempt mark covers them
        else:
            self._rollouts.setdefault(attempt, set()).update(rollout_ids)

    def settle(self, current: int) -> None:
        """The participant runs `current` now: fold the marks of older attempts."""
        for attempt in [a for a in self._rollouts if a < current]:
            del self._rollouts[attempt]
            self._whole.add(attempt)
        older = sorted(a for a in self._whole if a < current)
        for attempt in older[: max(0, len(older) - self._WHOLE_KEPT)]:
            self._whole.discard(attempt)
            self.floor = max(self.floor, attempt)

    def count(self) -> int:
        """Per-rollout marks held (whole-attempt marks cost one integer each)."""
        return sum(len(marked) for marked in self._rollouts.values())

    def covers_attempt(self, attempt: int) -> bool:
        return attempt <= self.floor or attempt in self._whole

    def covers(self, attempt: int, rollout_id: str) -> bool:
        return self.covers_attempt(attempt) or rollout_id in self._rollouts.get(attempt, ())

    def whole_attempts(self) -> list[int]:
        return sorted(self._whole)

    def forget(self, rollout_ids: frozenset[str]) -> int:
        """Drop per-rollout marks; whole-attempt marks stay (they describe the attempt)."""
        dropped = 0
        for attempt in list(self._rollouts):
            marked = self._rollouts[attempt]
            gone = marked & rollout_ids
            dropped += len(gone)
            marked -= gone
            if not marked:
                del self._rollouts[attempt]
        return dropped


# --- the garbage collector during a checkpoint ----------------------------------------------


class CollectorHold:
    """Keeps Python's cyclic garbage collector off while a participant is prepared.

    Once prepared, every episode of the set is parked and waits for the commit and the resume.
    A collection then lengthens every episode's pause by its own length, and the commit itself
    allocates enough to trigger several: in a reference server holding 1,000 episodes a full
    collection took 60-150 ms, about the whole rest of the pause. Reference counting still frees
    nearly everything meanwhile, the window is bounded by the lease, and the collector runs
    again, catching up, as soon as the checkpoint closes.

    The collector is process-wide, so holds are counted (several control planes can share a
    process, as in tests), and a collector the application had switched off stays off.
    """

    _holds = 0
    _switched_off = False

    def __init__(self) -> None:
        self.held = False

    def hold(self) -> None:
        if self.held:
            return
        self.held = True
        if CollectorHold._holds == 0 and gc.isenabled():
            gc.disable()
            CollectorHold._switched_off = True
        CollectorHold._holds += 1

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        CollectorHold._holds -= 1
        if CollectorHold._holds == 0 and CollectorHold._switched_off:
            CollectorHold._switched_off = False
            gc.enable()


# --- checkpoints whose records are being removed ---------------------------------------------


@dataclass
class RemovalClaim:
    """One removal's hold on the checkpoints it names (`RemovalClaims.claim`)."""

    checkpoint_ids: tuple[str, ...]
    whole_set: bool
    state: Literal["claimed", "running", "done"] = "claimed"
    """claimed (taken under the control lock), running (its worker thread began), done."""


class RemovalClaims:
    """The checkpoints a removal is deleting: the promise it takes under the control lock.

    A removal claims its checkpoints (every one, for `whole_set`) in the same lock as the check
    that none is open, and gives them back only when its worker thread has ended, also when the
    call itself failed at its deadline and the thread still runs. Meanwhile a prepare or restore
    of a claimed id is refused (`ControlPlane._refuse_removing`), so a checkpoint is never open
    while its files are being deleted, and nothing else waits on the removal's I/O. The counts
    are shared with worker threads, hence the (never contended for long) thread lock.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._ids: Counter[str] = Counter()
        self._whole_set = 0

    def covers(self, checkpoint_id: str) -> bool:
        with self._guard:
            return self._whole_set > 0 or self._ids[checkpoint_id] > 0

    def claim(self, checkpoint_ids: Sequence[str], *, whole_set: bool) -> RemovalClaim:
        claim = RemovalClaim(tuple(dict.fromkeys(checkpoint_ids)), whole_set)
        with self._guard:
            self._ids.update(claim.checkpoint_ids)
            self._whole_set += whole_set
        return claim

    def begin(self, claim: RemovalClaim) -> bool:
        """The worker thread starts: False when its caller has given up already (the claim is
        back, so the thread must not delete anything)."""
        with self._guard:
            if claim.state != "claimed":
                return False
            claim.state = "running"
            return True

    def end(self, claim: RemovalClaim) -> None:
        """The worker thread has ended: give the claim back."""
        with self._guard:
            self._give_back(claim)

    def abandon(self, claim: RemovalClaim) -> None:
        """The caller is done waiting: give the claim back unless a thread runs with it (that
        thread gives it back when it ends)."""
        with self._guard:
            if claim.state == "claimed":
                self._give_back(claim)

    def _give_back(self, claim: RemovalClaim) -> None:
        if claim.state == "done":
            return
        claim.state = "done"
        self._ids.subtract(claim.checkpoint_ids)
        self._ids += Counter()  # drop the ids now at zero
        self._whole_set -= claim.whole_set


# --- records held by cuts until their persist -----------------------------------------------

MAX_HELD_CUTS = 8
"""At most this many cuts held at once, whatever their bytes (each is one checkpoint whose
persist has not finished; a second is the usual most)."""


@dataclass(eq=False)
class HeldCut:
    """The records one cut fixed, held until a persist writes them (docs/protocol.md, "Persist
    after resume"). `encoded` are the records as encoded at their boundaries: a write uses only
    their lines and digests, immutable bytes shared with the participant's own encodings until
    its episodes move on; `reply` is the cut's answer, whose manifest is the one a persist of
    them writes to the participant's records store."""

    reply: CommitReply
    encoded: tuple[EncodedRecord, ...] | None
    expires_ts: float
    """The cut's lease: a persist that has not begun by then (or a write still running, whose
    callers all gave up) is discarded by the participant itself."""
    done: anyio.Event = field(default_factory=anyio.Event)
    writing: bool = False
    abandoned: bool = False
    """Discarded (or its lease lapsed) while its write ran: the write's files are removed."""
    outcome: CommitReply | ProtocolError | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.reply.checkpoint_id

    @property
    def held_bytes(self) -> int:
        return self.reply.manifest.bytes if self.encoded is not None else 0


class HeldCuts:
    """The cuts a participant holds, bounded in bytes and count, and the outcome of each ended
    one (a durable reply to replay, or the refusal to repeat), the newest `REMEMBERED`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.cuts: dict[str, HeldCut] = {}
        self.ended: OrderedDict[str, CommitReply | ProtocolError] = OrderedDict()
        self.changed = anyio.Event()

    def held_bytes(self) -> int:
        return sum(cut.held_bytes for cut in self.cuts.values())

    def room(self, checkpoint_id: str, size: int) -> None:
        """Refuse a cut of `size` bytes that would pass the bound while other cuts are held (a
        lone cut is always taken: it holds what the participant holds anyway)."""
        held = [cut for cut in self.cuts.values() if cut.encoded is not None]
        if not held:
            return
        total = sum(cut.held_bytes for cut in held)
        if total + size > self.max_bytes or len(held) >= MAX_HELD_CUTS:
            names = ", ".join(sorted(cut.checkpoint_id for cut in held))
            raise ProtocolError(
                ErrorCode.PERSIST_BACKLOG,
                f"checkpoint {checkpoint_id!r} would hold {size} bytes of records beside "
                f"{total} bytes held for {len(held)} checkpoint(s) not yet persisted ({names}); "
                f"the bound is {self.max_bytes} bytes (ROLLOUT_MAX_HELD_BYTES) and "
                f"{MAX_HELD_CUTS} checkpoints: persist or discard those first",
            )

    def hold(self, cut: HeldCut) -> None:
        self.cuts[cut.checkpoint_id] = cut
        self.changed.set()

    def end(self, cut: HeldCut, outcome: CommitReply | ProtocolError) -> None:
        """The cut ended (durable, failed, discarded or lapsed): its bytes are released and its
        outcome is what a later persist of it answers."""
        cut.encoded = None
        cut.outcome = outcome
        if self.cuts.get(cut.checkpoint_id) is cut:
            del self.cuts[cut.checkpoint_id]
        self.remember(cut.checkpoint_id, outcome)
        cut.done.set()
        self.changed.set()

    def remember(self, checkpoint_id: str, outcome: CommitReply | ProtocolError) -> None:
        self.ended[checkpoint_id] = outcome
        self.ended.move_to_end(checkpoint_id)
        while len(self.ended) > REMEMBERED:
            self.ended.popitem(last=False)
