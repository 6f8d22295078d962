"""Operations on the objects a RolloutSet owns: the control token, Services and pods.

Plain async functions over `Kube` (no Kopf), shared by the set's pass, the recovery and the
checkpoint flow:

- `ensure_control_token` / `read_control_token`: the per-set token Secret;
- `ensure_services`: one Service per role;
- `check_storage_secret`: a bucket set's credentials Secret exists with its keys;
- `observe_pods`: the set's pods as `PodView`s;
- `reconcile_pods(kube, rset, attempt)`: create the pods of an attempt that can be created now
  (peers known); call it again on every pod event until the plan is complete;
- `delete_attempt_pods(kube, rset, attempt)`: remove an attempt's pods (Recreate recovery);
- `eviction_holds(kube, rset)`: which terminating pods the recovery must not act on yet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from ..decide.policy.eviction import TerminatingPod, eviction_checkpoint_name
from ..decide.policy.eviction import eviction_holds as _eviction_holds
from ..decide.policy.views import CheckpointView, SetView, checkpoint_views
from ..decide.resources import (
    attempt_selector,
    control_token_secret,
    new_control_token,
    role_service,
    secret_name,
    set_selector,
    token_from_secret,
)
from ..decide.setplan import AttemptPlan, PodView, plan_attempt
from ..model.api import LABEL_ATTEMPT, RolloutSet, namespace_or_default
from .kube import ApiError, Kube

logger = logging.getLogger(__name__)

STORAGE_SECRET_INVALID: Final = "StorageSecretInvalid"
"""Reason of Degraded for a bucket set whose credentials Secret is missing or lacks a key."""
CLIENT_ERRORS: Final = frozenset({400, 403, 422})
"""API refusals caused by the spec (an invalid template, a quota): reported, not retried fast."""


class SetBlocked(Exception):
    """The set cannot be reconciled until a person acts; becomes Degraded with this reason.
    `recheck_seconds`: look again this soon without an event on the set (what the person fixes
    is another object, such as a Secret), else at the loop's resync."""

    def __init__(self, reason: str, message: str, *, recheck_seconds: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.recheck_seconds = recheck_seconds


# --- owned objects ------------------------------------------------------------------------------

ENSURE_EVERY_SECONDS: Final = 300.0
"""How often a pass checks again that a set's token Secret and Services exist once this process
found them (checking on every pass cost a GET and one refused POST per role, per set,
per pass). A deleted one is created again within this time."""


class OwnedObjects:
    """Which sets' token Secret and Services this process has ensured, and when.

    Keyed by the set's UID and its roles, so a new set under an old name or a new role is
    ensured at once. Process memory only: a restarted operator ensures everything again.

    The process's one instance is part of its `OperatorState` (`flows/state.py`); the set's
    pass (`flows.setpass.SetPass`) is handed it, and is its only writer and reader."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ensured: dict[tuple[str, tuple[str, ...]], float] = {}

    @staticmethod
    def _key(rset: RolloutSet) -> tuple[str, tuple[str, ...]] | None:
        if not rset.metadata.uid:
            return None  # not from the API server (a test's object): always ensure
        roles = tuple(sorted(p.role.value for p in rset.spec.participants))
        return (rset.metadata.uid, roles)

    def fresh(self, rset: RolloutSet) -> bool:
        key = self._key(rset)
        at = self._ensured.get(key) if key is not None else None
        return at is not None and self._clock() - at < ENSURE_EVERY_SECONDS

    def mark(self, rset: RolloutSet) -> None:
        key = self._key(rset)
        if key is None:
            return
        if len(self._ensured) > 4096:  # deleted sets: drop the stale entries
            cutoff = self._clock() - ENSURE_EVERY_SECONDS
            self._ensured = {k: v for k, v in self._ensured.items() if v >= cutoff}
        self._ensured[key] = self._clock()


def _controlled_by(obj: dict[str, Any], rset: RolloutSet) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == rset.metadata.uid and r.get("controller") for r in refs)


async def ensure_control_token(kube: Kube, rset: RolloutSet) -> str:
    """The set's control token, creating its Secret once. Never replaced while it exists:
    running participants hold the token they were started with."""
    namespace = namespace_or_default(rset.metadata.namespace)
    name = secret_name(rset.metadata.name)
    secret = await kube.get_secret(namespace, name)
    if secret is None:
        manifest = control_token_secret(rset, new_control_token())
        if await kube.create_secret(namespace, manifest):
            return token_from_secret(manifest)
        secret = await kube.get_secret(namespace, name)  # created concurrently
        if secret is None:
            raise RuntimeError(f"secret {name} vanished right after a create conflict")
    if not _controlled_by(secret, rset):
        raise SetBlocked(
            "TokenSecretConflict",
            f"secret {name} exists but does not belong to this RolloutSet; the operator will "
            "not hand a token it did not generate to participants. Delete or rename it.",
        )
    return token_from_secret(secret)


async def read_control_token(kube: Kube, namespace: str, set_name: str) -> str | None:
    """The bearer token for the participants' control planes (None before it exists); the one
    this process already read, when it did (a token is never replaced while its Secret exists)."""
    secret = await kube.get_secret(namespace, secret_name(set_name), remembered=True)
    return None if secret is None else token_from_secret(secret)


STORAGE_SECRET_KEYS: Final = ("accessKeyId", "secretAccessKey")
"""The keys a bucket set's credentials Secret must hold (`sessionToken` is optional)."""
STORAGE_SECRET_RECHECK_SECONDS: Final = 15.0
"""How soon a set blocked on its bucket's Secret looks again (a person creates the Secret)."""


async def check_storage_secret(kube: Kube, rset: RolloutSet) -> None:
    """SetBlocked `StorageSecretInvalid` when a bucket set's credentials Secret is missing or
    lacks a key (participants would fail to mount it or to sign a request). Only key names
    are looked at; the Secret is not remembered and nothing of its content is reported."""
    s3 = rset.spec.storage.s3
    if s3 is None:
        return
    namespace = namespace_or_default(rset.metadata.namespace)
    secret = await kube.read_secret(namespace, s3.secret_name)
    data = (secret or {}).get("data") or {}
    missing = [key for key in STORAGE_SECRET_KEYS if not data.get(key)]
    if not missing:
        return
    keys = " and ".join(STORAGE_SECRET_KEYS)
    problem = (
        f"has no {' and no '.join(missing)}"
        if len(missing) < len(STORAGE_SECRET_KEYS)
        else "does not exist or is empty"
    )
    raise SetBlocked(
        STORAGE_SECRET_INVALID,
        f"secret {namespace}/{s3.secret_name} (spec.storage.s3.secretName) {problem}: the "
        f"participants sign their requests to bucket {s3.bucket} with its {keys} (and "
        "sessionToken for temporary credentials); no pod was created. Create the Secret, for "
        f"example kubectl create secret generic {s3.secret_name} -n {namespace} "
        "--from-literal=accessKeyId=... --from-literal=secretAccessKey=... (docs/install.md, "
        '"Records in a bucket")',
        recheck_seconds=STORAGE_SECRET_RECHECK_SECONDS,
    )


async def ensure_services(kube: Kube, rset: RolloutSet) -> None:
    namespace = namespace_or_default(rset.metadata.namespace)
    for participant in rset.spec.participants:
        try:
            await kube.create_service(namespace, role_service(rset, participant))
        except ApiError as error:
            if error.status in CLIENT_ERRORS:
                raise SetBlocked("ServiceCreationFailed", error.message) from error
            raise


# --- pods ---------------------------------------------------------------------------------------


async def observe_pods(kube: Kube, namespace: str, set_name: str) -> list[PodView]:
    """Every pod of the set (all attempts) that carries our labels."""
    pods = await kube.list_pods(namespace, set_selector(set_name))
    return [view for view in (PodView.from_pod(p) for p in pods) if view is not None]


@dataclass(frozen=True)
class PodsOutcome:
    plan: AttemptPlan
    """The plan after this pass's creations (re-observed when anything was created)."""
    created: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """The API server's refusals, by pod: usually an invalid template."""


async def reconcile_pods(
    kube: Kube, rset: RolloutSet, attempt: int, pods: list[PodView] | None = None
) -> PodsOutcome:
    """Create the pods of `attempt` whose peers are known; report what exists and waits.

    Idempotent: pods that exist (in any state) are left alone, so call it on every pod event
    until `outcome.plan.complete`. A spec changed under running pods creates nothing.
    """
    namespace = namespace_or_default(rset.metadata.namespace)
    name = rset.metadata.name
    if pods is None:
        pods = await observe_pods(kube, namespace, name)
    plan = plan_attempt(rset, attempt, pods)
    if plan.stale or not plan.to_create:
        return PodsOutcome(plan)
    created: list[str] = []
    errors: list[str] = []
    for manifest in plan.to_create:
        pod = manifest["metadata"]["name"]
        try:
            if await kube.create_pod(namespace, manifest):
                created.append(pod)
        except ApiError as error:
            if error.status not in CLIENT_ERRORS:
                raise
            errors.append(f"{pod}: {error.message}")
    if created:
        logger.info("RolloutSet %s/%s: created pods %s", namespace, name, ", ".join(created))
    plan = plan_attempt(rset, attempt, await observe_pods(kube, namespace, name))
    return PodsOutcome(plan, created, errors)


async def delete_attempt_pods(
    kube: Kube, rset: RolloutSet, attempt: int, *, grace_seconds: int | None = None
) -> list[str]:
    """Delete every pod of `attempt`; returns the names a delete was sent for."""
    namespace = namespace_or_default(rset.metadata.namespace)
    pods = await kube.list_pods(namespace, attempt_selector(rset.metadata.name, attempt))
    deleted: list[str] = []
    for pod in pods:
        name = pod["metadata"]["name"]
        if pod["metadata"].get("deletionTimestamp"):
            continue
        if await kube.delete_pod(namespace, name, grace_seconds=grace_seconds):
            deleted.append(name)
    return deleted


# --- the reconcile pass -------------------------------------------------------------------------


async def eviction_holds(
    kube: Kube, rset: RolloutSet, *, clock: Callable[[], datetime] = lambda: datetime.now(UTC)
) -> frozenset[str]:
    """The terminating participant pods whose loss a recovery must not act on yet (their
    eviction checkpoint runs or is about to; see `policy.eviction.eviction_holds`)."""
    namespace = namespace_or_default(rset.metadata.namespace)
    pods = await kube.list_pods(namespace, set_selector(rset.metadata.name))
    terminating = [
        t for t in (TerminatingPod.from_pod(p, LABEL_ATTEMPT) for p in pods) if t is not None
    ]
    if not terminating or rset.status.attempt is None:
        return frozenset()
    name = eviction_checkpoint_name(rset.metadata.name, rset.status.attempt)
    raw = await kube.get_checkpoint(namespace, name)
    checkpoints: list[CheckpointView] = [] if raw is None else checkpoint_views([raw])
    view = SetView.from_set(rset, live_pods=len(pods))
    return _eviction_holds(view, terminating, checkpoints, clock())
