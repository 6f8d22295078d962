"""Production settings for Kopf, applied in the startup hook from the runner's options.

Kopf's defaults suit a demo; an operator that owns GPU pods needs a few changes, each with a
reason:

- its own finalizer and annotation prefix (`checkpoint.rollout.dev`), so objects show whose
  marks they carry and another Kopf operator in the cluster never shares state with us;
- handler progress and the diff-base in annotations only: our CRDs have structural status
  schemas, so anything Kopf wrote into status would be pruned (and it would clutter status);
  the diff-base is compact (`CompactDiffBaseStorage`): a field whose JSON is larger than
  `MAX_DIFFBASE_FIELD_BYTES` is kept as its digest, so an object with a large spec (a big pod
  template) never needs more than the 256 KiB all annotations of an object may hold
  (docs/operations.md#failure-modes, class 3: every update and the deletion failed on such an
  object); and it is built only for the kinds with change handlers (`DIFF_BASE_KINDS`): Kopf
  builds one for every event of every kind it watches, a deep copy of the object, and only
  change handlers read it;
- watch requests with a server-side timeout and a slightly longer client timeout, so a silently
  dead connection is noticed and re-established instead of hanging forever;
- finite API request timeouts; events reported as `rollout-operator` with the pod name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from typing import Any, Final, cast

import kopf
from pydantic import BaseModel, ConfigDict, Field

from .api import FINALIZER, GROUP, MAX_REPLICAS, ROLLOUT_SET_KIND

DIFFBASE_KEY: Final = "last-handled-configuration"
MAX_DIFFBASE_FIELD_BYTES: Final = 2048
"""A field of the diff-base (a spec's top-level field, labels, annotations) larger than this as
JSON is stored as its digest: a change still shows as a change, in a few bytes."""
DEFAULT_RESYNC_SECONDS: Final = 300
"""How often each set's loops look again without an event (`--resync-seconds`). Every change
of a set, its pods and its checkpoints wakes them, and a pass that waits for a time (a progress
deadline, an interval tick) asks for that time; the resync only heals a missed event. It was
30 s: at 100 sets that alone was 0.15 API requests per second per set at idle (bench/fleet.py)."""
DEFAULT_API_CONCURRENCY: Final = 32
"""At most this many of the operator's own API requests at once (`--api-concurrency`; Kopf's
watches and its annotation patches are not counted)."""
DEFAULT_MAX_CONCURRENT_CHECKPOINTS: Final = 16
"""At most this many checkpoints prepare, commit and resume at once across every set
(`--max-concurrent-checkpoints`); the others wait in phase Queued, and their prepare timeout
starts when they run. Eviction and Deadline checkpoints (a pod's grace period, a must-save-by
time) never wait for this. A hundred sets checkpointing at once on one operator made every
checkpoint slow (the operator's one event loop and the API server shared between them) and
most failed their prepare deadline (bench/fleet.py)."""
DEFAULT_RETIRE_SECONDS: Final = 30.0
"""How long the pods an InPlace recovery keeps may take to retire the lost attempt before the
try falls back to Recreate (`--inplace-retire-seconds`)."""
DEFAULT_RESTORE_FLOOR_SECONDS: Final = 30.0
"""The least time a recovery's restore (and its resume) call gets, even when the try's own
deadline (`restoreTimeoutSeconds`) is nearer (`--restore-floor-seconds`): a slow pod start must
not leave the restore no time at all."""
DEFAULT_MAX_REPLICAS_PER_ROLE: Final = 256
"""The operator's default limit of `replicas` per role (the API allows up to `api.MAX_REPLICAS`;
the chart's `operator.maxReplicasPerRole` sets it at install)."""


def _digest(value: Any) -> dict[str, str]:
    encoded = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return {"sha256": hashlib.sha256(encoded.encode()).hexdigest()}


def compact_essence(essence: dict[str, Any]) -> dict[str, Any]:
    """The essence with every large field (two levels deep) replaced by its digest."""
    compact: dict[str, Any] = {}
    for key, value in essence.items():
        if isinstance(value, dict):
            compact[key] = {
                inner: _digest(item)
                if len(json.dumps(item, default=str)) > MAX_DIFFBASE_FIELD_BYTES
                else item
                for inner, item in value.items()
            }
        elif len(json.dumps(value, default=str)) > MAX_DIFFBASE_FIELD_BYTES:
            compact[key] = _digest(value)
        else:
            compact[key] = value
    return compact


DIFF_BASE_KINDS: Final = frozenset({ROLLOUT_SET_KIND})
"""The kinds the operator has Kopf change handlers on (`on.create`, `on.update`, `on.resume`,
`on.delete`; `handlers/`), the only readers of a diff-base. Pods, nodes, Workloads and
RolloutCheckpoints have event handlers, indexes and daemons only
(tests/unit/test_checkpoint_handlers.py holds this to Kopf's registry)."""


class CompactDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """Kopf's annotation diff-base with large fields kept as digests, built only for the kinds
    with change handlers (see the module docstring).

    Kopf compares the stored essence with the one it builds from the object now, both built
    here, so a changed large field differs in its digest and the change handlers still run. For
    any other kind the essence is empty: Kopf then sees no change, which only a change handler
    or an idle timer (none here) would act on."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        kind = body.get("kind")
        if kind is not None and kind not in DIFF_BASE_KINDS:
            return cast(kopf.BodyEssence, {})
        essence = super().build(body=body, extra_fields=extra_fields)
        return cast(kopf.BodyEssence, compact_essence(cast(dict[str, Any], essence)))


LEADER_LEASE_PATTERN: Final = (
    r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
)
"""`--leader-lease`: a namespace (a DNS label) and a Lease name (a DNS subdomain)."""


class RunOptions(BaseModel):
    """What `rollout-operator run` was asked to do; shared with the startup hook via memo."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    liveness: str | None = None
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    peering: str | None = None
    priority: int = 0
    watch_timeout_seconds: int = Field(default=300, ge=10)
    resync_seconds: int = Field(default=DEFAULT_RESYNC_SECONDS, ge=5)
    api_concurrency: int = Field(default=DEFAULT_API_CONCURRENCY, ge=1)
    request_timeout_seconds: int = Field(default=60, ge=1)
    worker_limit: int | None = Field(default=None, ge=1)
    max_replicas_per_role: int = Field(default=DEFAULT_MAX_REPLICAS_PER_ROLE, ge=1, le=MAX_REPLICAS)
    max_concurrent_checkpoints: int = Field(default=DEFAULT_MAX_CONCURRENT_CHECKPOINTS, ge=1)
    inplace_retire_seconds: float = Field(default=DEFAULT_RETIRE_SECONDS, gt=0, le=3600)
    restore_floor_seconds: float = Field(default=DEFAULT_RESTORE_FLOOR_SECONDS, gt=0, le=3600)
    leader_lease: str | None = Field(default=None, pattern=LEADER_LEASE_PATTERN)
    """`NAMESPACE/NAME` of the Lease that lets one operator process work at a time
    (`cluster/leader.py`); None: no leader election (a single process, or Kopf peering)."""

    @property
    def standalone(self) -> bool:
        return self.peering is None

    @property
    def leader_lease_key(self) -> tuple[str, str] | None:
        """The leader Lease as (namespace, name)."""
        if self.leader_lease is None:
            return None
        namespace, name = self.leader_lease.split("/")
        return namespace, name


def configure(settings: kopf.OperatorSettings, options: RunOptions) -> None:
    """Apply our settings to Kopf's (see the module docstring for why each one)."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP, v1=False)
    settings.persistence.diffbase_storage = CompactDiffBaseStorage(
        prefix=GROUP, key=DIFFBASE_KEY, v1=False
    )

    settings.watching.server_timeout = options.watch_timeout_seconds
    settings.watching.client_timeout = options.watch_timeout_seconds + 30
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = options.request_timeout_seconds
    settings.networking.connect_timeout = 10

    settings.posting.level = logging.INFO
    settings.posting.reporting_component = "rollout-operator"
    settings.posting.reporting_instance = os.environ.get("HOSTNAME", "rollout-operator")
    settings.posting.event_name_prefix = "rollout-operator-"

    # Kopf >= 1.40 processes each object's events in order with one worker per object; the
    # old time-window batching is gone. Bound the workers when many objects churn at once.
    settings.queueing.worker_limit = options.worker_limit
    settings.queueing.error_delays = (1, 2, 5, 10, 20, 30, 60)

    settings.peering.standalone = options.standalone
    if options.peering is not None:
        settings.peering.name = options.peering
        settings.peering.priority = options.priority
        settings.peering.mandatory = True
