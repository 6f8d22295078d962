"""The rollout checkpoint contract: what a rollout server needs to be checkpointed and restored.

A server author builds on five things (docs/sdk.md is the guide):

* the **episode runtime** (`EpisodeRuntime`, `Episode`, `Boundary`, `StepMode`): describe an
  episode as steps with boundaries between them; the runtime parks, exports and restores them;
* the **participant** (`RuntimeParticipant`, or your own `Participant`): the contract the control
  plane calls into;
* the **control plane** (`ControlPlane`, `ControlSettings`): the `/checkpoint/v1` routes, mounted
  in any FastAPI app with `ControlPlane.install(app)`;
* the **`/run` duties** (`RunRoute`): refusing retired and other attempts, attaching repeated
  calls, answering finished episodes and mapping errors, in the one right order;
* the **wire models and route table** (`ROUTES`, `PrepareRequest`, ..., `ErrorCode`,
  `ProtocolError`): what crosses the wire, declared once for both sides.

A coordinator (an operator, a Slurm job, `rollout-coordinate`) drives participants through
`Coordinator` and `HttpParticipantClient`; `storage` functions read and write the published
records.

This package is its own distribution, `rollout-protocol` (protocol/pyproject.toml), and depends on
pydantic, httpx, anyio, FastAPI/Starlette and opentelemetry-api only. aiohttp
(`HttpParticipantClient`, imported at its first call: the `client` extra) and uvicorn
(`rollout_protocol.serving`, the conformance kit: the `serve` and `kit` extras) are needed only by
what uses them; `import rollout_protocol` imports neither. obstore (the `s3` extra) is imported only
when records go to an S3-API bucket (`BucketStore`). It never imports the operator or the
reference servers; everything not listed in `__all__` (and the public submodules `conformance`,
`serving`, `tracing` and `model_api`) is private.

Traces: `rollout_protocol.tracing` uses the OpenTelemetry API (`opentelemetry-api`, a dependency);
the SDK and its OTLP/HTTP exporter (the `tracing` extra) are imported only when
`OTEL_EXPORTER_OTLP_ENDPOINT` is set. Without them every span is the API's no-op one.
"""

import importlib as _importlib
import typing as _typing

from ._counters import StepCounters
from ._episodes import (
    STEPS_COUNTER,
    AttemptRetired,
    Boundary,
    Episode,
    EpisodeCancelled,
    EpisodeError,
    EpisodeExists,
    EpisodeRuntime,
    EpisodeTimeout,
    RuntimeParticipant,
    StaleAttempt,
    StepMode,
    TaskMismatch,
)
from ._objectstore import BucketConfig, BucketConfigError, BucketError, BucketStore
from ._participant import EpisodeCounts, ParkState, Participant
from ._routes import (
    COMMIT,
    CONTROL_ROUTES,
    DISCARD,
    FORGET,
    PERSIST,
    PERSIST_ROUTES,
    PREPARE,
    REMOVE,
    RENEW,
    RESTORE,
    RESUME,
    RETIRE,
    ROUTES,
    STATUS,
    Dialect,
    Route,
)
from ._settings import S3_ENV_PREFIX, ControlConfigError, ControlSettings, bucket_from_env
from ._stages import SEQUENTIAL_STAGES, PrepareStages, prepare_stages
from ._storage import (
    EncodedRecord,
    RecordsInvalid,
    RecordsMissing,
    RecordsStore,
    Removal,
    StorageError,
    VolumeStore,
    checkpoint_base,
    encode_record,
    published_checkpoints,
    read_checkpoint_manifest,
    read_manifest,
    read_records,
    remove_checkpoint,
    remove_checkpoint_files,
    remove_records,
    remove_set_files,
    set_storage_dir,
)
from ._wire import (
    API_PREFIX,
    CHECKPOINT_ID_PATTERN,
    MAX_INSTANCE_INDEX,
    MAX_KEPT_LISTED,
    PREPARE_ORDER,
    RESTORE_CODES,
    RESUME_ORDER,
    RETIRE_ORDER,
    ROLLOUT_ID_PATTERN,
    Capability,
    CheckpointManifest,
    CommitReply,
    CommitRequest,
    DiscardReply,
    DiscardRequest,
    EpisodeId,
    ErrorBody,
    ErrorCode,
    ErrorDetail,
    ForgetReply,
    ForgetRequest,
    Manifest,
    MultiProcess,
    PersistRequest,
    Phase,
    PrepareReply,
    PrepareRequest,
    ProtocolError,
    PublishedParticipant,
    Record,
    RemoveReply,
    RemoveRequest,
    RenewReply,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    Role,
    RolloutId,
    StatusReply,
    task_digest,
)

if _typing.TYPE_CHECKING:
    from ._client import (
        MAX_ERROR_REPLY_BYTES,
        MAX_REPLY_BYTES,
        MAX_SMALL_REPLY_BYTES,
        HttpParticipantClient,
        ParticipantClient,
        ParticipantError,
    )
    from ._control import ControlPlane
    from ._coordinator import (
        CheckpointDurations,
        CheckpointResult,
        CommitOutcome,
        Coordinator,
        DiscardOutcome,
        Failure,
        ForgetOutcome,
        LostWork,
        PrepareOutcome,
        RestoreOutcome,
        ResumeOutcome,
        RetireOutcome,
        StatusOutcome,
    )
    from ._gym import gym_rollout_id
    from ._runs import RunRoute


_LAZY_MODULES: _typing.Final[dict[str, frozenset[str]]] = {
    "._control": frozenset({"ControlPlane"}),
    "._runs": frozenset({"RunRoute"}),
    "._gym": frozenset({"gym_rollout_id"}),
    "._client": frozenset(
        {
            "MAX_ERROR_REPLY_BYTES",
            "MAX_REPLY_BYTES",
            "MAX_SMALL_REPLY_BYTES",
            "HttpParticipantClient",
            "ParticipantClient",
            "ParticipantError",
        }
    ),
    "._coordinator": frozenset(
        {
            "CheckpointDurations",
            "CheckpointResult",
            "CommitOutcome",
            "Coordinator",
            "DiscardOutcome",
            "Failure",
            "ForgetOutcome",
            "LostWork",
            "PrepareOutcome",
            "RestoreOutcome",
            "ResumeOutcome",
            "RetireOutcome",
            "StatusOutcome",
        }
    ),
}
"""The public names imported at their first use, by the private module that holds them."""


def __getattr__(name: str) -> _typing.Any:
    """The coordinator side (`Coordinator`, `HttpParticipantClient`, ...) is imported at its
    first use: a server never uses it, and its import (the client, NeMo Gym's wire models) is
    a tenth of a server's start (docs/operations.md, "What a server start costs"). So is the
    serving side (`ControlPlane`, `RunRoute`: FastAPI), which a coordinator never uses: a fifth
    of the operator's start."""
    for module, names in _LAZY_MODULES.items():
        if name in names:
            value = getattr(_importlib.import_module(module, __name__), name)
            globals()[name] = value
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy names too, before their first use."""
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "API_PREFIX",
    "CHECKPOINT_ID_PATTERN",
    "COMMIT",
    "CONTROL_ROUTES",
    "DISCARD",
    "FORGET",
    "MAX_ERROR_REPLY_BYTES",
    "MAX_INSTANCE_INDEX",
    "MAX_KEPT_LISTED",
    "MAX_REPLY_BYTES",
    "MAX_SMALL_REPLY_BYTES",
    "PERSIST",
    "PERSIST_ROUTES",
    "PREPARE",
    "PREPARE_ORDER",
    "REMOVE",
    "RENEW",
    "RESTORE",
    "RESTORE_CODES",
    "RESUME",
    "RESUME_ORDER",
    "RETIRE",
    "RETIRE_ORDER",
    "ROLLOUT_ID_PATTERN",
    "ROUTES",
    "S3_ENV_PREFIX",
    "SEQUENTIAL_STAGES",
    "STATUS",
    "STEPS_COUNTER",
    "AttemptRetired",
    "Boundary",
    "BucketConfig",
    "BucketConfigError",
    "BucketError",
    "BucketStore",
    "Capability",
    "CheckpointDurations",
    "CheckpointManifest",
    "CheckpointResult",
    "CommitOutcome",
    "CommitReply",
    "CommitRequest",
    "ControlConfigError",
    "ControlPlane",
    "ControlSettings",
    "Coordinator",
    "Dialect",
    "DiscardOutcome",
    "DiscardReply",
    "DiscardRequest",
    "EncodedRecord",
    "Episode",
    "EpisodeCancelled",
    "EpisodeCounts",
    "EpisodeError",
    "EpisodeExists",
    "EpisodeId",
    "EpisodeRuntime",
    "EpisodeTimeout",
    "ErrorBody",
    "ErrorCode",
    "ErrorDetail",
    "Failure",
    "ForgetOutcome",
    "ForgetReply",
    "ForgetRequest",
    "HttpParticipantClient",
    "LostWork",
    "Manifest",
    "MultiProcess",
    "ParkState",
    "Participant",
    "ParticipantClient",
    "ParticipantError",
    "PersistRequest",
    "Phase",
    "PrepareOutcome",
    "PrepareReply",
    "PrepareRequest",
    "PrepareStages",
    "ProtocolError",
    "PublishedParticipant",
    "Record",
    "RecordsInvalid",
    "RecordsMissing",
    "RecordsStore",
    "Removal",
    "RemoveReply",
    "RemoveRequest",
    "RenewReply",
    "RenewRequest",
    "RestoreOutcome",
    "RestoreReply",
    "RestoreRequest",
    "ResumeOutcome",
    "ResumeReply",
    "ResumeRequest",
    "RetireOutcome",
    "RetireReply",
    "RetireRequest",
    "Role",
    "RolloutId",
    "Route",
    "RunRoute",
    "RuntimeParticipant",
    "StaleAttempt",
    "StatusOutcome",
    "StatusReply",
    "StepCounters",
    "StepMode",
    "StorageError",
    "TaskMismatch",
    "VolumeStore",
    "bucket_from_env",
    "checkpoint_base",
    "encode_record",
    "gym_rollout_id",
    "prepare_stages",
    "published_checkpoints",
    "read_checkpoint_manifest",
    "read_manifest",
    "read_records",
    "remove_checkpoint",
    "remove_checkpoint_files",
    "remove_records",
    "remove_set_files",
    "set_storage_dir",
    "task_digest",
]
