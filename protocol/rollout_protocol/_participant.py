"""The contract between the control plane and a rollout server.

The control plane (`_control.py`, with `_phases.py` and `_control_state.py`) owns phases,
leases, reply caching, auth and storage; a server only says how to park its work, what to
record, how to install records and how to stop an attempt. Keeping the split here means every
server gets the same protocol behaviour for free, and the protocol can be tested against an
in-process fake participant.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from ._storage import EncodedRecord, encode_record
from ._wire import EpisodeId, Record, Role


@dataclass(frozen=True)
class ParkState:
    """What a participant reports while parking (prepare)."""

    parked: list[EpisodeId] = field(default_factory=list)
    """Episodes at a boundary (or inside a replay step): their state is capturable."""
    blockers: list[EpisodeId] = field(default_factory=list)
    """Episodes still inside a wait-mode step."""
    restarts: list[EpisodeId] = field(default_factory=list)
    """Episodes that cannot be captured and will restart from scratch."""
    parked_sha256: str | None = None
    """`episodes_digest(parked)` when the participant keeps it as episodes come and go (the
    episode runtime does); None: the control plane computes it from `parked`."""

    @property
    def ready(self) -> bool:
        return not self.blockers


DIGEST_MODULUS: Final = 1 << 256


def episode_id_hash(rollout_id: str, attempt: int) -> int:
    """One episode's term of a set digest: sha256 of `rollout_id@attempt`, as an integer."""
    return int.from_bytes(hashlib.sha256(f"{rollout_id}@{attempt}".encode()).digest(), "big")


def episodes_digest(ids: Iterable[EpisodeId]) -> str:
    """`PrepareReply.episodes_sha256`: the sum of the distinct ids' `episode_id_hash`es mod
    2**256, as 64 hex digits. Independent of order, so a participant can keep it up to date as
    episodes begin and end instead of hashing every id inside the pause."""
    total = sum({episode_id_hash(e.rollout_id, e.attempt) for e in ids})
    return f"{total % DIGEST_MODULUS:064x}"


@dataclass(frozen=True)
class EpisodeCounts:
    """Live, parked and restored episodes of a participant, as `/status` reports them."""

    live: int = 0
    parked: int = 0
    restored: int = 0


class Participant(ABC):
    """A rollout server's checkpoint hooks. All methods run on the server's event loop."""

    role: Role

    @abstractmethod
    async def close_admission(self) -> None:
        """Stop starting new steps; new work waits (or is refused) until `reopen`."""

    @abstractmethod
    async def park(self, deadline_ts: float) -> ParkState:
        """Wait until every live episode is parked, or until `deadline_ts`; report either way."""

    @abstractmethod
    def export(self, scope: frozenset[str] | None) -> list[Record]:
        """The records of parked (and still-unclaimed restored) episodes in `scope` (None: all)."""

    def export_encoded(self, scope: frozenset[str] | None) -> Sequence[EncodedRecord]:
        """`export`, each record with its line encoded (`_storage.encode_record`): what a commit
        writes. The default encodes `export()` here, inside the checkpoint's pause; a
        participant that encodes its records when they change (as `RuntimeParticipant` does,
        at every boundary) returns those, and its commit only writes bytes."""
        return [encode_record(record) for record in self.export(scope)]

    def committed_episodes(self, records: Sequence[EncodedRecord]) -> int | None:
        """How many episodes a commit's `records` (those `export_encoded` gave, within the
        commit's scope) hold: `CommitReply.committed_episodes`, what the checkpoint counts
        (docs/protocol.md, "Commit scope"). None (the default): not said, and the coordinator
        counts the checkpoint from the prepare replies. Called inside the pause."""
        return None

    @abstractmethod
    def release_outside(self, scope: frozenset[str]) -> None:
        """Drop restored-but-unclaimed state of rollouts the commit scope leaves out."""

    @abstractmethod
    def validate(self, records: Sequence[Record]) -> None:
        """Raise `ValueError` when records cannot be installed; called before `install`."""

    @abstractmethod
    async def install(self, records: Sequence[Record], attempt: int) -> list[EpisodeId]:
        """Install validated records under `attempt`; returns the restored episodes."""

    @abstractmethod
    async def reopen(self) -> None:
        """Resume: reopen admission and release held work."""

    @abstractmethod
    async def retire(self, attempt: int, rollout_ids: frozenset[str] | None) -> list[EpisodeId]:
        """Stop `attempt`'s work for the rollouts (None: all), wait until stopped, free state."""

    @abstractmethod
    def forget(self, rollout_ids: frozenset[str]) -> int:
        """Drop retire marks of finished rollouts; returns how many were dropped."""

    @abstractmethod
    def counts(self) -> EpisodeCounts:
        """Live, parked and restored episode counts for `/status`."""

    # --- work accounting (optional: the defaults count nothing) ------------------------------

    def checkpointed(self, checkpoint_id: str, records: Sequence[Record]) -> None:
        """A checkpoint now holds `records` of this participant: its commit wrote them, or a
        restore installed them. Work done from here on is what a restore of it would lose
        (`lost_work`). Called after the commit's records are on storage, and after `install`."""
        return None

    def kept_work(self, records: Sequence[Record]) -> dict[str, int] | None:
        """The work these (installed) records hold, by counter (`model_tokens`, `steps`); None:
        this participant does not count work."""
        return None

    def finished_rollouts(self, attempt: int) -> list[str] | None:
        """Called at a retire of `attempt`, after `retire`: the rollouts whose episodes
        finished under it since the last `checkpointed` (their work is not lost), not those the
        retire stopped; None: this participant cannot tell."""
        return None

    def lost_work(self, attempt: int, finished: frozenset[str] | None) -> dict[str, int] | None:
        """After `retire(attempt, ...)`: the work of `attempt` done after the last
        `checkpointed`, except for the `finished` rollouts (None: the ones this participant
        itself saw finish), by counter; None: this participant does not count work."""
        return None

    def rewire(self, peers: Mapping[Role, str]) -> None:
        """Call these peers (base URLs by role) from now on; roles not named keep their URL.

        Optional: a restore that names peers (an InPlace recovery replaced a pod this one
        calls) reaches here before any record is installed. The default refuses, and the
        operator then replaces this participant too (Recreate).
        """
        raise NotImplementedError(f"{self.role} participant cannot re-wire its peers")
