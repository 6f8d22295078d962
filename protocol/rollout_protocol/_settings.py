"""The control plane's settings (`ControlSettings`) and the environment variables they are read
from (`ControlSettings.from_env`): one place for every knob a participant's operator sets in its
pod, each checked at start so that a bad value fails the server at once with a message naming
the variable.
"""

from __future__ import annotations

import importlib.util
import math
import multiprocessing
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _storage as storage
from ._objectstore import BucketConfig, BucketConfigError, BucketStore
from ._routes import (
    Dialect,
)
from ._wire import (
    CHECKPOINT_ID_PATTERN,
    MAX_INSTANCE_INDEX,
    MultiProcess,
    Role,
    instance_name,
)

MAX_BODY_BYTES = 16 * 1024 * 1024
"""Default largest request body a participant reads (`ROLLOUT_MAX_BODY_BYTES`), on every route."""
MAX_DEADLINE_SECONDS = 6 * 3600.0
"""Default horizon of `deadline_ts` (`ROLLOUT_MAX_DEADLINE_SECONDS`): a deadline further ahead
is refused, so every lease a call opens lapses within it plus the lease grace."""
MAX_RETIRE_MARKS = 100_000
"""Default bound of per-rollout retire marks of the running attempt (`ROLLOUT_MAX_RETIRE_MARKS`)."""
MAX_HELD_BYTES = 256 * 1024 * 1024
"""Default bound of the record bytes a participant holds for cuts whose persist has not finished
(`ROLLOUT_MAX_HELD_BYTES`): a cut that would hold more while another is held is refused
(`persist_backlog`). A lone cut is always taken, whatever its size (docs/protocol.md, "Persist
after resume")."""


class ControlConfigError(ValueError):
    """The control plane cannot start with this configuration; the message says what to set."""


@dataclass(frozen=True)
class ControlSettings:
    """How one participant's control plane is configured (`from_env` reads the pod's variables)."""

    role: Role
    index: int = 0
    set_name: str = "local"
    checkpoint_root: Path | None = None
    set_dir: str | None = None
    """The set's directory under the checkpoint root (`<namespace>/<set>/<uid>` from the
    operator, see `set_storage_dir`); None: the set name, as without an operator."""
    bucket: BucketConfig | None = None
    """The set's records in an S3-API bucket instead of below `checkpoint_root`
    (`ROLLOUT_STORAGE_S3_*`, see `bucket_from_env`), under the same `set_dir`."""
    attempt: int = 0
    standby: bool = False
    """A standby (`ROLLOUT_STANDBY=1`): a warm spare in no attempt that a recovery adopts for a
    lost instance; the adopting restore gives it the instance's index (`RestoreRequest.index`)."""
    token: str | None = None
    allow_unauthenticated: bool = False
    lease_grace_seconds: float = 30.0
    max_body_bytes: int = MAX_BODY_BYTES
    max_deadline_seconds: float = MAX_DEADLINE_SECONDS
    max_retire_marks: int = MAX_RETIRE_MARKS
    max_held_bytes: int = MAX_HELD_BYTES
    dialects: tuple[Dialect, ...] = (Dialect.ROLLOUT,)
    """The wire dialects the control plane mounts (`ROLLOUT_CONTROL_DIALECTS`, comma separated:
    `rollout`, `gym` or both): ours under `/checkpoint/v1`, NeMo Gym's under `/ng-control/v1`."""
    workers: int = 1
    """Worker processes of this pod's server. Above 1 in the pod's main process of
    `rollout_protocol.workers.serve_workers`: this plane coordinates them all (`managed`)."""
    worker: int | None = None
    """This process's index among its pod's workers (`ROLLOUT_WORKER=<k>/<n>`, set by
    `serve_workers` in each worker): its plane serves the pod's private worker channel instead
    of the control routes. None: not a managed worker."""
    worker_key: str | None = field(default=None, repr=False)
    """A managed worker's key to its private channel (`ROLLOUT_WORKER_KEY`, made at random by
    `serve_workers` for each pod run and known only to the pod's processes): the channel's
    routes answer only a request that carries it, so nothing the pod's public port forwards
    can reach them (docs/protocol.md, "Workers")."""
    unmanaged_workers: int = 1
    """Worker processes this server's own process manager runs without `serve_workers`
    (`WEB_CONCURRENCY`, which uvicorn and gunicorn read for `--workers`): above 1 the status
    route says `multi_process: unmanaged` and the operator refuses to checkpoint the set."""
    waits_on: tuple[Role, ...] | None = None
    """The roles this participant calls from wait-mode steps, declared by its server's code
    (`StatusReply.waits_on`): a prepare parks it before them, and parks roles nobody waits on
    together (docs/design.md#44-order). None: not declared, taken as every role after it in
    prepare order."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        if self.waits_on is not None:
            waits = tuple(dict.fromkeys(Role(role) for role in self.waits_on))
            if self.role in waits:
                raise ControlConfigError(f"waits_on: a {self.role.value} cannot wait on itself")
            object.__setattr__(self, "waits_on", waits)
        try:
            dialects = tuple(dict.fromkeys(Dialect(d) for d in self.dialects))
        except ValueError:
            raise ControlConfigError(
                f"dialects {list(self.dialects)!r}: each must be one of "
                f"{[d.value for d in Dialect]} (ROLLOUT_CONTROL_DIALECTS)"
            ) from None
        if not dialects:
            raise ControlConfigError("dialects: mount at least one (ROLLOUT_CONTROL_DIALECTS)")
        object.__setattr__(self, "dialects", dialects)
        if not 0 <= self.index <= MAX_INSTANCE_INDEX:
            raise ControlConfigError(
                f"index must be between 0 and {MAX_INSTANCE_INDEX}, got {self.index}"
            )
        if self.attempt < 0:
            raise ControlConfigError(f"attempt must be >= 0, got {self.attempt}")
        if re.fullmatch(CHECKPOINT_ID_PATTERN, self.set_name) is None:
            raise ControlConfigError(
                f"set name {self.set_name!r} must match {CHECKPOINT_ID_PATTERN} "
                "(it names a directory under the checkpoint root)"
            )
        if self.set_dir is not None:
            try:
                storage.check_set_dir(self.set_dir)
            except storage.UnsafePath as error:
                raise ControlConfigError(f"ROLLOUT_SET_DIR: {error}") from None
        if self.bucket is not None and self.checkpoint_root is not None:
            raise ControlConfigError(
                "records go to a volume (ROLLOUT_CHECKPOINT_ROOT) or a bucket "
                f"({S3_ENV_PREFIX}*), not both: unset one"
            )
        if not (math.isfinite(self.lease_grace_seconds) and self.lease_grace_seconds > 0):
            raise ControlConfigError(
                f"lease_grace_seconds must be a positive number, got {self.lease_grace_seconds}"
            )
        if self.max_body_bytes < 1024:
            raise ControlConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not (math.isfinite(self.max_deadline_seconds) and self.max_deadline_seconds > 0):
            raise ControlConfigError(
                f"max_deadline_seconds must be a positive number, got {self.max_deadline_seconds}"
            )
        if self.max_retire_marks < 1:
            raise ControlConfigError(f"max_retire_marks must be >= 1, got {self.max_retire_marks}")
        if self.max_held_bytes < 0:
            raise ControlConfigError(f"max_held_bytes must be >= 0, got {self.max_held_bytes}")
        if self.workers < 1 or self.unmanaged_workers < 1:
            raise ControlConfigError("workers must be >= 1")
        if self.worker is not None and not 0 <= self.worker < self.workers:
            raise ControlConfigError(f"worker {self.worker} is not one of {self.workers} workers")
        if self.worker is not None and not self.worker_key:
            raise ControlConfigError(
                f"worker {self.worker} has no key to its private channel: {WORKER_KEY_ENV} is "
                f"set by serve_workers together with {WORKER_ENV}"
            )
        if self.token is not None and not self.token:
            raise ControlConfigError("the control token is empty; unset it or give a real one")
        if self.token is None and not self.allow_unauthenticated:
            raise ControlConfigError(
                "no control token: set ROLLOUT_CONTROL_TOKEN, or allow unauthenticated control "
                "explicitly (allow_unauthenticated=True) on a trusted network only"
            )

    @classmethod
    def from_env(
        cls,
        role: Role,
        *,
        index: int | None = None,
        allow_unauthenticated: bool = False,
        environ: Mapping[str, str] | None = None,
        waits_on: Collection[Role] | None = None,
    ) -> ControlSettings:
        """Settings from the variables the operator puts into every participant pod, and the
        roles the server's code waits on (`waits_on`, not a variable: it is what the code does).

        `ROLLOUT_SET_DIR` (set by the operator) is the set's directory under the checkpoint
        root; without it (a participant run by hand) records go under the set name."""
        env = os.environ if environ is None else environ
        root = env.get("ROLLOUT_CHECKPOINT_ROOT") or None
        grace = env.get("ROLLOUT_LEASE_GRACE_SECONDS")
        return cls(
            role=Role(role),
            index=index if index is not None else _int_from_env(env, "ROLLOUT_INDEX", 0),
            set_name=env.get("ROLLOUT_SET") or "local",
            checkpoint_root=Path(root) if root is not None else None,
            set_dir=env.get("ROLLOUT_SET_DIR") or None,
            bucket=bucket_from_env(env),
            attempt=_int_from_env(env, "ROLLOUT_ATTEMPT", 0),
            standby=env.get("ROLLOUT_STANDBY", "") in ("1", "true"),
            token=env.get("ROLLOUT_CONTROL_TOKEN") or None,
            allow_unauthenticated=allow_unauthenticated,
            lease_grace_seconds=_float_from_env(grace, 30.0),
            max_body_bytes=_int_from_env(env, "ROLLOUT_MAX_BODY_BYTES", MAX_BODY_BYTES),
            max_deadline_seconds=_float_from_env(
                env.get("ROLLOUT_MAX_DEADLINE_SECONDS"),
                MAX_DEADLINE_SECONDS,
                "ROLLOUT_MAX_DEADLINE_SECONDS",
            ),
            max_retire_marks=_int_from_env(env, "ROLLOUT_MAX_RETIRE_MARKS", MAX_RETIRE_MARKS),
            max_held_bytes=_int_from_env(env, "ROLLOUT_MAX_HELD_BYTES", MAX_HELD_BYTES),
            dialects=_dialects_from_env(env.get("ROLLOUT_CONTROL_DIALECTS")),
            waits_on=None if waits_on is None else tuple(waits_on),
            **_workers_from_env(env),
        )

    @property
    def multi_process(self) -> MultiProcess:
        """`single`, `managed` (a pod of `serve_workers`: its main process or one of its
        workers) or `unmanaged` (several workers nobody here coordinates)."""
        if self.workers > 1 or self.worker is not None:
            return MultiProcess.MANAGED
        return MultiProcess.UNMANAGED if self.unmanaged_workers > 1 else MultiProcess.SINGLE

    @property
    def instance(self) -> str:
        return instance_name(self.role, self.index)

    @property
    def storage_dir(self) -> str:
        """Where this set's checkpoints go under the checkpoint root."""
        return self.set_dir if self.set_dir is not None else self.set_name

    def records_store(self, deadline_ts: float) -> storage.RecordsStore | None:
        """Where this participant's records go: its bucket (each request retried until
        `deadline_ts`), else the volume at its checkpoint root; None when it has neither."""
        if self.bucket is not None:
            return BucketStore(self.bucket, deadline_ts=deadline_ts)
        if self.checkpoint_root is not None:
            return storage.VolumeStore(self.checkpoint_root)
        return None


S3_ENV_PREFIX = "ROLLOUT_STORAGE_S3_"
"""The variables of a set whose records are in an S3-API bucket (docs/operations.md)."""


def bucket_from_env(env: Mapping[str, str] | None = None) -> BucketConfig | None:
    """The bucket the `ROLLOUT_STORAGE_S3_*` variables name, or None when none is set:
    `ENDPOINT` (an http or https URL), `BUCKET`, `PREFIX` (may be empty), `REGION` (default
    us-east-1), `ADDRESSING` (`path`, the default, or `virtual`), and `CREDENTIALS_DIR` (the
    folder where the Secret is mounted: `accessKeyId`, `secretAccessKey`, optional
    `sessionToken`, read again on every call). A bad or missing value is a
    `ControlConfigError` naming the variable."""
    env = os.environ if env is None else env
    names = ("ENDPOINT", "BUCKET", "PREFIX", "REGION", "ADDRESSING", "CREDENTIALS_DIR")
    values = {name: env.get(S3_ENV_PREFIX + name, "") for name in names}
    if not any(values.values()):
        return None
    missing = [
        S3_ENV_PREFIX + name
        for name in ("ENDPOINT", "BUCKET", "CREDENTIALS_DIR")
        if not values[name]
    ]
    if missing:
        raise ControlConfigError(
            f"records in a bucket need {', '.join(missing)} (set with the other "
            f"{S3_ENV_PREFIX}* variables)"
        )
    if importlib.util.find_spec("obstore") is None:
        raise ControlConfigError(
            f"records in a bucket ({S3_ENV_PREFIX}*) need obstore: install rollout-protocol[s3]"
        )
    try:
        return BucketConfig(
            endpoint=values["ENDPOINT"],
            bucket=values["BUCKET"],
            credentials_dir=Path(values["CREDENTIALS_DIR"]),
            prefix=values["PREFIX"],
            region=values["REGION"] or "us-east-1",
            addressing=values["ADDRESSING"] or "path",
        )
    except BucketConfigError as error:
        raise ControlConfigError(f"{S3_ENV_PREFIX}{error.setting.upper()}: {error}") from None


WORKER_ENV = "ROLLOUT_WORKER"
"""`<k>/<n>`: set by `serve_workers` in the environment of worker k of n."""
WORKER_KEY_ENV = "ROLLOUT_WORKER_KEY"
"""The pod's private worker channel key: set by `serve_workers` in each worker's environment."""


def _workers_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """`worker`, `workers` from `ROLLOUT_WORKER`; else `unmanaged_workers` from
    `WEB_CONCURRENCY` (uvicorn's and gunicorn's default for their `--workers`)."""
    slot = env.get(WORKER_ENV)
    if slot:
        try:
            k, n = (int(part) for part in slot.split("/", 1))
        except ValueError:
            raise ControlConfigError(f"{WORKER_ENV}={slot!r}: expected <k>/<n>") from None
        return {"worker": k, "workers": n, "worker_key": env.get(WORKER_KEY_ENV) or None}
    declared = declared_workers(env)
    # uvicorn --workers N starts each worker with multiprocessing (gunicorn forks): a server
    # process that is a multiprocessing child and no managed worker runs beside others.
    spawned = 2 if multiprocessing.parent_process() is not None else 1
    return {"unmanaged_workers": max(1, declared, spawned)}


def declared_workers(env: Mapping[str, str]) -> int:
    """The worker processes `WEB_CONCURRENCY` declares (1 when unset): the variable uvicorn and
    gunicorn read for `--workers`, parsed as strictly as every other count here."""
    return _int_from_env(env, "WEB_CONCURRENCY", 1)


def _int_from_env(env: Mapping[str, str], name: str, default: int) -> int:
    """A whole number of ASCII digits (`int()` alone would also take ` 3`, `3_0` or Arabic-Indic
    digits, and `str.isdigit()` takes `²`, which `int()` then refuses)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if re.fullmatch(r"[0-9]{1,18}", raw) is None:
        raise ControlConfigError(f"{name}={raw!r} is not a whole number (ASCII digits)")
    return int(raw)


def _dialects_from_env(raw: str | None) -> tuple[Dialect, ...]:
    if raw is None or not raw.strip():
        return (Dialect.ROLLOUT,)
    names = [name.strip() for name in raw.split(",") if name.strip()]
    try:
        return tuple(Dialect(name) for name in names)
    except ValueError:
        raise ControlConfigError(
            f"ROLLOUT_CONTROL_DIALECTS={raw!r}: name {[d.value for d in Dialect]}, comma separated"
        ) from None


def _float_from_env(
    raw: str | None, default: float, name: str = "ROLLOUT_LEASE_GRACE_SECONDS"
) -> float:
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ControlConfigError(f"{name}={raw!r} is not a number") from None
