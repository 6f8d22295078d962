"""Production settings for Kopf, applied in the startup hook from the runner's options.

Kopf's defaults suit a demo; an operator that owns GPU pods needs a few changes, each with a
reason:

- its own finalizer and annotation prefix (`checkpoint.rollout.dev`), so objects show whose
  marks they carry and another Kopf operator in the cluster never shares state with us;
- handler progress and the diff-base in annotations only: our CRDs have structural status
  schemas, so anything Kopf wrote into status would be pruned (and it would clutter status);
- watch requests with a server-side timeout and a slightly longer client timeout, so a silently
  dead connection is noticed and re-established instead of hanging forever;
- finite API request timeouts; events reported as `rollout-operator` with the pod name.
"""

from __future__ import annotations

import logging
import os
from typing import Final

import kopf
from pydantic import BaseModel, ConfigDict, Field

from .api import FINALIZER, GROUP

DIFFBASE_KEY: Final = "last-handled-configuration"


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
    request_timeout_seconds: int = Field(default=60, ge=1)
    worker_limit: int | None = Field(default=None, ge=1)

    @property
    def standalone(self) -> bool:
        return self.peering is None


def configure(settings: kopf.OperatorSettings, options: RunOptions) -> None:
    """Apply our settings to Kopf's (see the module docstring for why each one)."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP, v1=False)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
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
