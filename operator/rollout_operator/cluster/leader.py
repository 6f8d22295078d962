"""One operator process at a time: the process works only while it holds the leader Lease.

A Deployment replaces a deleted or evicted operator pod at once, whatever its strategy, so the
old pod (still stopping: its checkpoint flows get `HANDOVER_SECONDS`, Kopf's shutdown a little
more) and the new one overlap. Two operators driving the same checkpoint or recovery would each
undo the other's steps (one resumes the participants the other is committing). The chart's
standalone Deployment therefore runs the operator with `--leader-lease NAMESPACE/NAME`:

- **acquire**, at startup, before any handler runs (a Kopf startup handler): the process takes
  the Lease when it has no holder, names this process's identity already (a restarted container
  of the same pod, whose old process is gone for sure), or lapsed (unchanged for
  `leaseDurationSeconds` on this process's clock: its holder died without releasing it).
  Otherwise it waits, reading the Lease every `POLL_SECONDS`, and says so in its log;
- **renew**, every `RENEW_SECONDS` while it runs. A process that finds another holder, or could
  not renew for `RENEW_DEADLINE_SECONDS`, stops itself: the same graceful stop as its pod's
  deletion, which hands every flow over, and ends before its Lease can lapse
  (`LEASE_SECONDS`);
- **release**, at cleanup, the last thing the process does after every handler and daemon has
  stopped, so its successor starts at once instead of waiting for the Lease to lapse.

Identity is the pod's name (`POD_ID`, which the chart sets), else host name and process id.
Every write is a compare-and-swap on the resourceVersion (`Kube.patch_lease`), so two takers
never both win. In steady state this costs one patch every `RENEW_SECONDS`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import anyio

from .kube import Conflict, Kube
from .leases import holder_of, holder_spec

logger = logging.getLogger(__name__)

LEASE_SECONDS: Final = 30
"""How long a Lease left unchanged stays its holder's (its successor waits this long only when
the holder died without releasing it). It covers a holder cut off from the API server: the
renew deadline, then its graceful stop (`HANDOVER_SECONDS` and Kopf's daemon cancellation,
about 10 s), with a margin."""
RENEW_SECONDS: Final = 5.0
"""How often the holder renews."""
RENEW_DEADLINE_SECONDS: Final = 15.0
"""A holder that could not renew for this long, counted from the start of its last successful
renewal, stops working; each renewal try is cut off at this deadline."""
POLL_SECONDS: Final = 1.0
"""How often a waiting process reads the Lease, and a holder retries a failed renewal."""
WAIT_LOG_SECONDS: Final = 30.0
"""How often a waiting process repeats in its log whom it waits for."""


def default_identity() -> str:
    """The pod's name where the chart runs the operator, else this host and process."""
    return os.environ.get("POD_ID") or f"{socket.gethostname()}/{os.getpid()}"


def version_of(lease: Mapping[str, Any] | None) -> str:
    return str(((lease or {}).get("metadata") or {}).get("resourceVersion") or "")


@dataclass(frozen=True)
class Observed:
    """A Lease version as a waiting process saw it first, on its own clock."""

    version: str
    at: float


def may_take(
    lease: Mapping[str, Any], identity: str, now: float, observed: Observed | None
) -> bool:
    """Whether `identity` may hold the Lease now: it has no holder, names `identity`, or has not
    changed for `leaseDurationSeconds` since this process first saw its current version.

    The lapse is measured on the waiter's clock from when it saw the version (as client-go's
    leader election does), never by comparing the holder's `renewTime` with this clock: pods on
    two nodes whose clocks differ by seconds would otherwise take a live holder's Lease."""
    holder = holder_of(lease)
    if holder is None or holder == identity:
        return True
    duration = (lease.get("spec") or {}).get("leaseDurationSeconds")
    if observed is None or observed.version != version_of(lease) or not isinstance(duration, int):
        return False
    return now - observed.at > duration


class LeaderLease:
    """The leader Lease `namespace/name` as held by one process (`identity`)."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        lease_seconds: int = LEASE_SECONDS,
        renew_seconds: float = RENEW_SECONDS,
        renew_deadline_seconds: float = RENEW_DEADLINE_SECONDS,
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self._kube = kube
        self._clock = clock
        """Intervals only (a lapse, the renew deadline): monotonic, so a wall-clock step never
        takes a live holder's Lease or stretches a holder's deadline."""
        self._lease_seconds = lease_seconds
        self._renew_seconds = renew_seconds
        self._renew_deadline = renew_deadline_seconds
        self._poll_seconds = poll_seconds
        self._known: dict[str, Any] | None = None
        """The Lease as this process last wrote or read it."""
        self._observed: Observed | None = None
        """The version of another holder's Lease this process waits on, and since when."""
        self._renewed_at = 0.0

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.name}"

    def _spec(self, base: Mapping[str, Any] | None) -> dict[str, Any]:
        return holder_spec(self.identity, self._lease_seconds, base, time.time())

    async def _read(self) -> dict[str, Any] | None:
        self._known = lease = await self._kube.get_lease(self.namespace, self.name)
        version = version_of(lease)
        if self._observed is None or self._observed.version != version:
            self._observed = Observed(version, self._clock())
        return lease

    async def _swap(self, lease: Mapping[str, Any], spec: Mapping[str, Any]) -> None:
        version = str((lease.get("metadata") or {}).get("resourceVersion") or "")
        self._known = await self._kube.patch_lease(self.namespace, self.name, spec, version)

    async def _try_take(self, lease: dict[str, Any] | None) -> bool:
        """One compare-and-swap round: True once this process holds the Lease."""
        if lease is None:
            manifest = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(None),
            }
            created = await self._kube.create_lease(self.namespace, manifest)
            if created is None:
                return False
            self._known = created
            return True
        if not may_take(lease, self.identity, self._clock(), self._observed):
            return False
        previous = holder_of(lease)
        try:
            await self._swap(lease, self._spec(lease))
        except (Conflict, LookupError):
            return False
        if previous not in (None, self.identity):
            logger.warning(
                "leader Lease %s: %s stopped renewing it; taking over", self.where, previous
            )
        return True

    async def acquire(self) -> None:
        """Hold the Lease, waiting while another live process holds it."""
        logged_at: float | None = None
        while True:
            why: str
            started = self._clock()
            try:
                lease = await self._read()
                if await self._try_take(lease):
                    self._renewed_at = started
                    logger.info("leader Lease %s: held by %s", self.where, self.identity)
                    return
                why = (
                    f"is held by {holder_of(self._known) or 'another writer'}: waiting for it "
                    "to stop (or for the Lease to lapse, unrenewed for "
                    f"{self._lease_seconds}s) before this operator starts working"
                )
            except Exception as error:  # the API server away, RBAC missing: say so, try again
                why = f"cannot be read or written ({type(error).__name__}: {error}); retrying"
            now = self._clock()
            if logged_at is None or now - logged_at >= WAIT_LOG_SECONDS:
                logged_at = now
                logger.warning("leader Lease %s %s", self.where, why)
            await anyio.sleep(self._poll_seconds)

    async def renew_once(self) -> bool:
        """Renew now; False once this process has lost the Lease: another holds it, or it could
        not renew within `RENEW_DEADLINE_SECONDS` of the start of its last successful renewal
        (a try that hangs is cut off at that deadline)."""
        started = self._clock()
        remaining = self._renewed_at + self._renew_deadline - started
        with anyio.move_on_after(max(0.0, remaining)):
            try:
                held = await self._renew()
                if held is not None:
                    if held:
                        self._renewed_at = started
                    return held
            except Exception as error:  # the API server away: keep trying until the deadline
                logger.warning("leader Lease %s: renewal failed: %s", self.where, error)
        if self._clock() - self._renewed_at >= self._renew_deadline:
            logger.error(
                "leader Lease %s: not renewed for %.0fs: this operator stops before another "
                "may take over",
                self.where,
                self._clock() - self._renewed_at,
            )
            return False
        return True

    async def _renew(self) -> bool | None:
        """One renewal: True renewed, False lost to another holder, None not renewed now."""
        lease = self._known
        if lease is None or holder_of(lease) != self.identity:
            lease = await self._read()
        if lease is not None and holder_of(lease) == self.identity:
            try:
                await self._swap(lease, self._spec(lease))
                return True
            except (Conflict, LookupError):
                lease = await self._read()
        if lease is not None and holder_of(lease) not in (None, self.identity):
            logger.error(
                "leader Lease %s is now held by %s: this operator stops",
                self.where,
                holder_of(lease),
            )
            return False
        return True if await self._try_take(lease) else None

    async def keep(self) -> None:
        """Renew until the Lease is lost; returns then (the caller stops the process). A failed
        renewal is retried every `POLL_SECONDS` until the deadline."""
        wait = self._renew_seconds
        while True:
            await anyio.sleep(wait)
            renewed_at = self._renewed_at
            if not await self.renew_once():
                return
            wait = self._renew_seconds if self._renewed_at != renewed_at else self._poll_seconds

    async def release(self) -> None:
        """Give the Lease up if this process holds it, so a successor starts at once."""
        lease = self._known
        for _ in range(2):
            if lease is None or holder_of(lease) != self.identity:
                return
            try:
                await self._swap(lease, {"holderIdentity": None})
                logger.info("leader Lease %s: released", self.where)
                return
            except (Conflict, LookupError):
                lease = await self._read()


__all__ = ["LeaderLease", "Observed", "default_identity", "may_take"]
