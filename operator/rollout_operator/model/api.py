"""API models of the two custom resources (group `checkpoint.rollout.dev`, version `v1alpha1`).

These pydantic classes are the single source of the API: `crdgen` turns them into the CRD
schemas in `crds/`, and the operator parses every object it reads through them. Each
cross-field rule exists twice, once as a Python validator (so the operator and unit tests see
the same refusal) and once as a CEL rule in the schema (so the API server refuses a bad spec
before the operator ever sees it). Both are built from the same `Rule` constants below, so the
message a user reads is identical wherever the spec is refused.

Conventions (Kubernetes API conventions): camelCase wire names, integer durations named
`...Seconds`, string enums, `metav1.Condition` shaped conditions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Final

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    StringConstraints,
    model_validator,
)
from pydantic.alias_generators import to_camel
from rollout_protocol import ROLLOUT_ID_PATTERN, Role

GROUP: Final = "checkpoint.rollout.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"

ROLLOUT_SET_KIND: Final = "RolloutSet"
ROLLOUT_SET_PLURAL: Final = "rolloutsets"
ROLLOUT_CHECKPOINT_KIND: Final = "RolloutCheckpoint"
ROLLOUT_CHECKPOINT_PLURAL: Final = "rolloutcheckpoints"
CHECKPOINT_SET_FIELD: Final = "rolloutSet"
"""The checkpoint's spec field naming its set: a selectable field (a list filters on it)."""

FINALIZER: Final = f"{GROUP}/finalizer"
"""Kopf's finalizer under our name (on RolloutSets, for their deletion handler), so Kopf never
adds its generic `kopf.zalando.org` marker."""
RECORDS_FINALIZER: Final = f"{GROUP}/records"
"""The operator's own finalizer on every RolloutCheckpoint: its records go before the object
does (docs/design.md#65-retention-and-records). Not Kopf's: the checkpoint kind has no Kopf
change handlers, and Kopf removes its own finalizer wherever no handler needs it."""

LABEL_SET: Final = f"{GROUP}/set"
LABEL_ROLE: Final = f"{GROUP}/role"
LABEL_INDEX: Final = f"{GROUP}/index"
LABEL_ATTEMPT: Final = f"{GROUP}/attempt"
LABEL_KUEUE_QUEUE: Final = "kueue.x-k8s.io/queue-name"
"""Kueue's own label: the set is submitted to this LocalQueue (decide/queue.py)."""
ANNOTATION_ADOPTED: Final = f"{GROUP}/adopted-as"
"""On a standby pod a recovery adopted: the instance it took and the attempt it took it under
(`role-index@attempt`)."""
LABEL_STANDBY: Final = f"{GROUP}/standby"
"""On a standby pod (value "true"): a Ready spare of its role that belongs to no attempt
(`kubectl get pods -l checkpoint.rollout.dev/standby=true`). A recovery that adopts it replaces
this label with the attempt and index labels."""
MAX_STANDBY: Final = 16
"""Bound of `spec.standby` per role."""
ANNOTATION_SPEC_HASH: Final = f"{GROUP}/spec-hash"
"""On every participant pod: the digest of the participants spec it was built from."""
ANNOTATION_LATEST_CHECKPOINT: Final = f"{GROUP}/latest-checkpoint"
"""On every participant pod: the newest Ready checkpoint that covers it."""
ANNOTATION_LATEST_CHECKPOINT_TIME: Final = f"{GROUP}/latest-checkpoint-time"
"""On every participant pod: when that checkpoint completed (RFC 3339). Losing the pod loses the
work done since: schedulers and people choosing a pod to preempt can prefer the newest time."""
ANNOTATION_TEMPLATE_HASH: Final = f"{GROUP}/template-hash"
"""On every participant pod: the digest of its role's pod template (names what changed)."""
ANNOTATION_RETRY_RECOVERY: Final = f"{GROUP}/retry-recovery"
"""On a RolloutSet: set it to a new value to retry recovery after `RecoveryLimitReached`."""
ANNOTATION_TRAINER_STEP: Final = f"{GROUP}/trainer-step"
"""On a RolloutSet: a trainer reports a trainer checkpoint at this step (docs/policy.md,
"Triggers")."""

CONTROL_PORT_NAME: Final = "control"
"""The container port through which the operator and the peers reach a participant."""

ROLE_ORDER: Final[tuple[Role, ...]] = (Role.ENVIRONMENT, Role.MODEL, Role.AGENT, Role.RESOURCES)

MAX_SET_NAME_LENGTH: Final = 50
"""`<set>-environment` must stay a 63-character DNS label (it names the role's Service)."""
MAX_CHECKPOINT_NAME_LENGTH: Final = 128
"""A RolloutCheckpoint's name is its checkpoint id on storage (`CHECKPOINT_ID_PATTERN`)."""
MAX_CONTAINERS: Final = 32
MAX_PORTS: Final = 64
MAX_KEPT_PODS: Final = 1024
MAX_REPLICAS: Final = 1024
"""The API's bound of `replicas` per role (the operator's own, lower limit is set at install:
`--max-replicas-per-role`, the chart's `operator.maxReplicasPerRole`)."""
MAX_INSTANCES: Final = MAX_REPLICAS * 4
"""Bound of the per-instance lists in status (four roles of at most `MAX_REPLICAS`)."""
MAX_SCOPE_EPISODES: Final = 10000
"""Bound of a RolloutCheckpoint's `spec.episodes` (the commit scope)."""
MAX_TEMPLATE_BYTES: Final = 256 * 1024
"""The largest pod template (as JSON) the operator creates pods from; checked by the operator
(no schema can bound an open object's size), condition Degraded, reason TemplateTooLarge."""
MAX_RECOVERY_STARTS: Final = 64
"""Bound of the recovery start times a set keeps (more than any maxRestarts a window needs)."""
"""Bound of the pod lists a recovery records in status."""

DNS_LABEL_PATTERN: Final = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
CONDITION_REASON_PATTERN: Final = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


# --- validation rules shared by pydantic and CEL ---------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One validation rule: the CEL expression the API server runs and the message both show."""

    cel: str
    message: str

    def schema(self) -> dict[str, Any]:
        return {"rule": self.cel, "message": self.message}


RULE_UNIQUE_ROLES: Final = Rule(
    cel="self.all(p, self.exists_one(q, q.role == p.role))",
    message="participant roles must be unique: each entry is one tier of the rollout servers "
    "and the checkpoint protocol addresses a tier by its role; use replicas for more instances",
)
RULE_CONTROL_PORT: Final = Rule(
    cel="self.template.spec.containers.exists(c, has(c.ports) && "
    "c.ports.exists(p, has(p.name) && p.name == 'control'))",
    message='the pod template needs a container port named "control": the operator runs the '
    "checkpoint protocol through it and the peers of this role call it",
)
RULE_RESTART_NEVER: Final = Rule(
    cel="!has(self.template.spec.restartPolicy) || self.template.spec.restartPolicy == 'Never'",
    message="template.spec.restartPolicy must be Never (or unset): a restarted container comes "
    "back without its in-memory episodes while their state is counted as live; the operator "
    "replaces lost pods itself, under attempt + 1, from the latest checkpoint",
)
RULE_NEVER_SAVES: Final = Rule(
    cel="!(self.recovery.targetLevel == 'turn' && !self.checkpointPolicy.onTrainerCheckpoint"
    " && !has(self.checkpointPolicy.intervalSeconds) && !has(self.checkpointPolicy.mustSaveBy))",
    message="recovery.targetLevel turn would never save: checkpointPolicy.onTrainerCheckpoint "
    "is false and neither intervalSeconds nor mustSaveBy is set, so no checkpoint would capture "
    "unfinished turns (eviction checkpoints alone do not cover crashes or node loss); set one "
    "of them, or use targetLevel sibling",
)
RULE_STANDBY_ROLES: Final = Rule(
    cel="!has(self.standby) || ["
    + ", ".join(
        f"!has(self.standby.{r}) || self.standby.{r} == 0 || "
        f"self.participants.exists(p, p.role == '{r}')"
        for r in ("environment", "model", "agent", "resources")
    )
    + "].all(ok, ok)",
    message="standby names a role the set has no participants of: a standby pod is a spare of "
    "one of the set's roles, made from that role's template",
)
RULE_SIBLING_INTERVAL: Final = Rule(
    cel="!(self.recovery.targetLevel == 'sibling' && has(self.checkpointPolicy.intervalSeconds))",
    message="checkpointPolicy.intervalSeconds with recovery.targetLevel sibling would pause "
    "rollouts for checkpoints no recovery restores (at sibling level unfinished episodes "
    "restart); unset intervalSeconds, or use targetLevel turn",
)
RULE_STORAGE_IMMUTABLE: Final = Rule(
    cel="self == oldSelf",
    message="storage is immutable: the records of earlier checkpoints live there and a restore "
    "reads them from the same volume and path",
)
STORAGE_PATH_CLEAN: Final = r"^(/[^/]+)+$"
"""Absolute, no empty segment (no '//', no trailing slash, not '/' itself)."""
STORAGE_PATH_DOT_SEGMENT: Final = r"(^|/)[.][.]?(/|$)"
STORAGE_PATH_SYSTEM: Final = (
    r"^/(proc|sys|dev|etc|bin|sbin|lib|lib32|lib64|libx32|usr|boot|run|var/run)(/|$)"
)
"""System directories and everything below them: a volume mounted there hides what the image
needs (or what the kernel shows there)."""
STORAGE_PATH_TOP_LEVEL: Final = r"^/(tmp|var|home|root|opt|srv|mnt|media)$"
"""Top-level directories themselves (below them is fine): mounting over them hides the image's."""
RULE_STORAGE_PATH: Final = Rule(
    cel=f"!has(self.path) || (self.path.matches('{STORAGE_PATH_CLEAN}')"
    f" && !self.path.matches('{STORAGE_PATH_DOT_SEGMENT}')"
    f" && !self.path.matches('{STORAGE_PATH_SYSTEM}')"
    f" && !self.path.matches('{STORAGE_PATH_TOP_LEVEL}'))",
    message="storage.path must be a clean absolute path (no '.', '..' or empty segments, no "
    "trailing slash) that is neither '/' nor a system directory (/proc, /sys, /dev, /etc, /bin, "
    "/sbin, /lib*, /usr, /boot, /run and below) nor a top-level directory itself (/tmp, /var, "
    "/home, /root, /opt, /srv, /mnt, /media): it is the mount path in every container, which "
    "hides what the image has there, and the root every participant writes records under; use "
    "a folder of its own such as /checkpoints",
)


RULE_STORAGE_ONE_BACKEND: Final = Rule(
    cel="has(self.volume) != has(self.s3)",
    message="storage takes exactly one backend: volume (with path) or s3 (a bucket), not both "
    "and not neither; every participant writes its records to the one place a restore reads "
    "them from",
)
RULE_STORAGE_VOLUME_PATH: Final = Rule(
    cel="has(self.volume) == has(self.path)",
    message="storage.path is where storage.volume is mounted: set path with volume, and leave "
    "it out with s3 (a bucket is reached over its endpoint, not mounted)",
)
S3_PREFIX_PATTERN: Final = r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$"
"""A key prefix: '/'-separated names of letters, digits, '.', '_' and '-', none starting with
'.' or '-' (so no '.' or '..' segment) and none empty (no leading, trailing or doubled '/'): the
prefixes the participants' bucket store takes."""
RULE_S3_PREFIX: Final = Rule(
    cel=f"!has(self.prefix) || self.prefix == '' || self.prefix.matches('{S3_PREFIX_PATTERN}')",
    message="s3.prefix must be names of letters, digits, '.', '_' and '-' joined by '/', none "
    "starting with '.' or '-', with no leading or trailing '/': keys are "
    "<prefix>/<namespace>/<set>/<uid>/..., and removal relies on every set's keys being apart",
)


def s3_prefix_refused(prefix: str) -> bool:
    """The Python side of `RULE_S3_PREFIX` (the same pattern as the CEL rule)."""
    return prefix != "" and re.search(S3_PREFIX_PATTERN, prefix) is None


def storage_path_refused(path: str) -> bool:
    """The Python side of `RULE_STORAGE_PATH` (the same patterns as the CEL rule)."""
    return (
        re.search(STORAGE_PATH_CLEAN, path) is None
        or re.search(STORAGE_PATH_DOT_SEGMENT, path) is not None
        or re.search(STORAGE_PATH_SYSTEM, path) is not None
        or re.search(STORAGE_PATH_TOP_LEVEL, path) is not None
    )


RULE_SET_NAME: Final = Rule(
    cel=f"size(self.metadata.name) <= {MAX_SET_NAME_LENGTH} && "
    f"self.metadata.name.matches('{DNS_LABEL_PATTERN}')",
    message=f"a RolloutSet name must be a DNS label of at most {MAX_SET_NAME_LENGTH} characters "
    "(lower-case letters, digits and '-', starting with a letter): it prefixes the names of the "
    "pods and of the Services of each role, and is a label value",
)
RULE_CHECKPOINT_NAME: Final = Rule(
    cel=f"size(self.metadata.name) <= {MAX_CHECKPOINT_NAME_LENGTH}",
    message=f"a RolloutCheckpoint name must be at most {MAX_CHECKPOINT_NAME_LENGTH} characters: "
    "it is the checkpoint id, which names the checkpoint's directory on storage",
)
RULE_CHECKPOINT_SPEC_IMMUTABLE: Final = Rule(
    cel="self == oldSelf",
    message="a RolloutCheckpoint's spec is immutable: it records what one checkpoint was asked "
    "to capture; create another RolloutCheckpoint instead",
)
RULE_TRAINER_STEP: Final = Rule(
    cel="self.trigger != 'TrainerCheckpoint' || has(self.trainerStep)",
    message="trigger TrainerCheckpoint needs trainerStep: the step pairs this environment state "
    "with the trainer checkpoint it belongs to",
)


# --- shared field types -------------------------------------------------------------------------


def format_time(value: datetime) -> str:
    """`metav1.Time`: RFC 3339 in UTC with whole seconds, as the API server writes it."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


Timestamp = Annotated[datetime, PlainSerializer(format_time, return_type=str, when_used="json")]


def format_micro_time(value: datetime) -> str:
    """`metav1.MicroTime`: RFC 3339 in UTC with microseconds, for times that order events
    which can fall in the same second (two checkpoints completing together)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


MicroTimestamp = Annotated[
    datetime, PlainSerializer(format_micro_time, return_type=str, when_used="json")
]
RolloutIdStr = Annotated[str, StringConstraints(pattern=ROLLOUT_ID_PATTERN)]


class ApiModel(BaseModel):
    """Spec models: camelCase on the wire, unknown fields refused (a typo is an error)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class StatusModel(BaseModel):
    """Status models ignore unknown fields, so an older operator can read a newer status."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class OpenModel(BaseModel):
    """A Kubernetes core object we only partly describe; every other field passes through."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="allow",
        frozen=True,
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


def dump(model: BaseModel) -> dict[str, Any]:
    """The wire form of a model: camelCase, JSON types, unset optional fields left out."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- conditions ---------------------------------------------------------------------------------


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(StatusModel):
    """A `metav1.Condition`: one aspect of the object's state, with why and since when."""

    type: str = Field(
        description="The aspect this condition describes, in CamelCase (e.g. Ready).",
        max_length=316,
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        description="A CamelCase word saying why the condition is in this status; meant for "
        "programs and alerts.",
        pattern=CONDITION_REASON_PATTERN,
        max_length=1024,
    )
    message: str = Field(
        default="", description="A human-readable explanation of the reason.", max_length=32768
    )
    last_transition_time: Timestamp = Field(
        description="When the status last changed (not when the condition was last written)."
    )
    observed_generation: int | None = Field(
        default=None,
        ge=0,
        description="The metadata.generation of the spec the condition was computed from.",
    )


_CONDITIONS_LIST: Final[dict[str, Any]] = {
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
}


# --- RolloutSet spec ----------------------------------------------------------------------------


class AfterDeadline(StrEnum):
    SUSPEND = "Suspend"
    CONTINUE = "Continue"


class TargetLevel(StrEnum):
    TURN = "turn"
    SIBLING = "sibling"


class RestorePolicy(StrEnum):
    RECREATE = "Recreate"
    IN_PLACE = "InPlace"


class ContainerPort(OpenModel):
    """The part of a `ContainerPort` the operator reads."""

    name: str | None = Field(default=None, description="The port's name; see `control`.")
    container_port: int = Field(ge=1, le=65535, description="The port number in the pod.")


class Container(OpenModel):
    """The part of a `Container` the operator reads; every other field is passed to the pod."""

    name: str = Field(description="The container's name.")
    ports: list[ContainerPort] = Field(
        default_factory=list,
        max_length=MAX_PORTS,
        description="Container ports; one of the pod's containers needs a port named "
        '"control" (the participant control plane, also the URL its peers call).',
    )


class PodSpecPart(OpenModel):
    """The part of a `PodSpec` the operator reads; every other field is passed to the pod."""

    containers: list[Container] = Field(
        min_length=1, max_length=MAX_CONTAINERS, description="The pod's containers."
    )
    restart_policy: str | None = Field(
        default=None,
        description="Must be Never or unset; the operator sets Never (lost pods are replaced "
        "under attempt + 1, never restarted in place).",
    )


class PodTemplate(OpenModel):
    """A `PodTemplateSpec`. Only the fields the operator reads are described here; the whole
    template (any PodSpec field) is kept and used for the participant pods."""

    metadata: dict[str, Any] | None = Field(
        default=None,
        description="Labels and annotations for the pods; the operator adds its own labels.",
    )
    spec: PodSpecPart = Field(description="The PodSpec of each participant pod of this role.")


class ParticipantSpec(ApiModel):
    """One tier of rollout servers: a role, how many instances and their pod template."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [RULE_CONTROL_PORT.schema(), RULE_RESTART_NEVER.schema()]
        }
    )

    role: Role = Field(
        description="The participant's role: environment (runs episodes), model (the policy "
        "model), agent (the multi-turn loop) or resources (tools and verifiers)."
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description="How many instances of this role run. Each has a stable index; an "
        "episode stays with one instance across attempts. At most 1024 in the API; the "
        "operator's install sets a lower limit (default 256; condition Degraded, reason "
        "ReplicasOverLimit).",
    )
    template: PodTemplate = Field(
        description="The pod template of every instance of this role (a PodTemplateSpec). "
        'One container needs a port named "control". The operator adds env, labels, owner '
        "references and the storage volume."
    )

    @model_validator(mode="after")
    def _check_template(self) -> ParticipantSpec:
        containers = self.template.spec.containers
        if not any(p.name == CONTROL_PORT_NAME for c in containers for p in c.ports):
            raise ValueError(RULE_CONTROL_PORT.message)
        if self.template.spec.restart_policy not in (None, "Never"):
            raise ValueError(RULE_RESTART_NEVER.message)
        return self


class AddressingStyle(StrEnum):
    """How a bucket is addressed: in the URL path (MinIO, most S3-compatible servers) or as a
    host name (`<bucket>.<endpoint host>`, AWS's virtual-hosted style)."""

    PATH = "path"
    VIRTUAL = "virtual"


class S3Storage(ApiModel):
    """An S3-API bucket (AWS S3, GCS through its S3-compatible endpoint, MinIO, Ceph) that holds
    the records; the participants reach it over `endpoint` with the credentials of `secretName`."""

    endpoint: str = Field(
        pattern=r"^https?://[^/?#@\s]+/?$",
        max_length=2048,
        description="The S3 API's URL, for example https://s3.us-east-1.amazonaws.com, "
        "https://storage.googleapis.com or http://minio.storage.svc:9000 "
        "(ROLLOUT_STORAGE_S3_ENDPOINT): scheme, host and port, no path. No credentials in it: "
        "they come from secretName.",
    )
    bucket: str = Field(
        pattern=r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$",
        min_length=3,
        max_length=63,
        description="The bucket (ROLLOUT_STORAGE_S3_BUCKET); it must exist: the operator and "
        "the participants never create or delete buckets.",
    )
    prefix: str = Field(
        default="",
        max_length=512,
        description="A key prefix, without leading or trailing '/' (ROLLOUT_STORAGE_S3_PREFIX). "
        "Keys are <prefix>/<namespace>/<set>/<uid>/<checkpoint>/<role>-<index>/...; sets may "
        "share a prefix, each removes only its own keys.",
    )
    region: str = Field(
        default="us-east-1",
        pattern=r"^[a-z0-9][a-z0-9-]*$",
        max_length=64,
        description="The region requests are signed for (ROLLOUT_STORAGE_S3_REGION); GCS and "
        "MinIO accept us-east-1 (or auto for GCS).",
    )
    addressing_style: AddressingStyle = Field(
        default=AddressingStyle.PATH,
        description="path: https://<endpoint>/<bucket>/<key> (MinIO, most self-hosted "
        "servers); virtual: https://<bucket>.<endpoint host>/<key> (the style AWS S3 prefers) "
        "(ROLLOUT_STORAGE_S3_ADDRESSING).",
    )
    secret_name: str = Field(
        pattern=DNS_SUBDOMAIN_PATTERN,
        max_length=253,
        description="A Secret in the set's namespace with keys accessKeyId and secretAccessKey "
        "(and sessionToken for temporary credentials), mounted read-only into every "
        "participant pod (ROLLOUT_STORAGE_S3_CREDENTIALS_DIR) and read by the operator when "
        "it removes the set's keys. Its content is never copied into a status, an Event, a "
        "log line or a metric. A missing Secret or key: condition Degraded, reason "
        "StorageSecretInvalid.",
    )

    @model_validator(mode="after")
    def _check_prefix(self) -> S3Storage:
        if s3_prefix_refused(self.prefix):
            raise ValueError(RULE_S3_PREFIX.message)
        return self


class StorageSpec(ApiModel):
    """Where checkpoint records are written: a volume mounted at the same path in every
    participant, or an S3-API bucket every participant reaches over the network."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                RULE_STORAGE_IMMUTABLE.schema(),
                RULE_STORAGE_ONE_BACKEND.schema(),
                RULE_STORAGE_VOLUME_PATH.schema(),
                RULE_STORAGE_PATH.schema(),
            ]
        }
    )

    path: str | None = Field(
        default=None,
        pattern=r"^/",
        max_length=1024,
        description="With volume: the mount path in every participant container and the "
        "checkpoint root (ROLLOUT_CHECKPOINT_ROOT). Records go to <path>/<namespace>/<set>/"
        "<uid>/<checkpoint>/<role>-<index>/ (ROLLOUT_SET_DIR is <namespace>/<set>/<uid>). Not "
        "/ or a system directory. Not set with s3.",
    )
    volume: dict[str, Any] | None = Field(
        default=None,
        min_length=1,
        description="A Volume source (for example persistentVolumeClaim with a ReadWriteMany "
        "claim, or hostPath on devcluster), mounted at path in every participant pod.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    s3: S3Storage | None = Field(
        default=None,
        description="An S3-API bucket instead of a volume: no folder shared between nodes is "
        "needed, so a set survives the loss of a node without a ReadWriteMany volume.",
        json_schema_extra={"x-kubernetes-validations": [RULE_S3_PREFIX.schema()]},
    )

    @model_validator(mode="after")
    def _check_backend(self) -> StorageSpec:
        if (self.volume is None) == (self.s3 is None):
            raise ValueError(RULE_STORAGE_ONE_BACKEND.message)
        if (self.volume is None) != (self.path is None):
            raise ValueError(RULE_STORAGE_VOLUME_PATH.message)
        if self.path is not None and storage_path_refused(self.path):
            raise ValueError(RULE_STORAGE_PATH.message)
        return self


class CheckpointPolicy(ApiModel):
    """When checkpoints are taken, beyond the ones people or trainers create directly."""

    interval_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Take a checkpoint every this many seconds (unset: no timer). A tick "
        "while a checkpoint of the set runs is skipped.",
    )
    on_trainer_checkpoint: bool = Field(
        default=True,
        description="Checkpoint when the trainer reports a trainer checkpoint (annotation "
        "checkpoint.rollout.dev/trainer-step on the RolloutSet). Ignored with targetLevel "
        "sibling: the trainer checkpoint already holds that state.",
    )
    must_save_by: Timestamp | None = Field(
        default=None,
        description="RFC 3339 time (a walltime or reservation end) by which a checkpoint is "
        "Ready; it starts saveReserveSeconds earlier. Then afterDeadline applies.",
    )
    after_deadline: AfterDeadline = Field(
        default=AfterDeadline.SUSPEND,
        description="What happens after the mustSaveBy checkpoint: Suspend releases the pods "
        "(and their GPUs; condition Suspended, reason DeadlineReached) until mustSaveBy is moved "
        "later or removed or this is set to Continue; Continue keeps running.",
    )
    on_eviction: bool = Field(
        default=True,
        description="Checkpoint inside the grace period when a participant pod is evicted, "
        "drained or preempted.",
    )
    keep_latest: int = Field(
        default=2, ge=1, description="How many Ready checkpoints (and their records) to keep."
    )
    prepare_timeout_seconds: int = Field(
        default=300,
        ge=1,
        description="How long the prepare phase may wait for every episode to park at a "
        "boundary before the checkpoint is aborted and participants resume.",
    )
    pod_hints: bool = Field(
        default=False,
        description="After every Ready checkpoint, annotate each participant pod it covers with "
        "the checkpoint's name and time (checkpoint.rollout.dev/latest-checkpoint, "
        "latest-checkpoint-time), for whoever picks a pod to evict or preempt by them (a "
        "person, a scheduler extension). One patch per pod per checkpoint; trainers read the "
        "set's status.latestCheckpoint and need none.",
    )


class RecoverySpec(ApiModel):
    """What happens when a participant pod of the current attempt is lost."""

    target_level: TargetLevel = Field(
        default=TargetLevel.TURN,
        description="turn: unfinished episodes continue from their last boundary (needs "
        "checkpoints); sibling: unfinished episodes restart from their first turn.",
    )
    restore_policy: RestorePolicy = Field(
        default=RestorePolicy.RECREATE,
        description="Recreate: every participant pod is replaced under attempt + 1. InPlace: "
        "only the lost pods are replaced; the others are kept (same process, memory and GPU), "
        "retire the old attempt and take the restore under attempt + 1 with the fresh pods; "
        "when that cannot be done safely the recovery falls back to Recreate and says why.",
    )
    max_restarts: int = Field(
        default=10,
        ge=0,
        description="The bound on trouble: failed restore tries within one recovery, and "
        "recoveries within windowSeconds. Past it the set stays Degraded (MaxRestartsExceeded, "
        "RecoveryLimitReached) until the spec changes or the retry-recovery annotation does.",
    )
    window_seconds: int = Field(
        default=3600,
        ge=60,
        description="The sliding window in which recoveries count against maxRestarts; "
        "recoveries in it are also spaced out exponentially (5 s, 10 s, 20 s, ... at most 5 "
        "minutes after the previous one).",
    )
    restore_timeout_seconds: int = Field(
        default=600,
        ge=1,
        description="How long fresh pods may take to become Ready and restore before the try "
        "counts as failed.",
    )


class StandbySpec(ApiModel):
    """How many standby pods to keep per role (none by default)."""

    environment: int = Field(
        default=0, ge=0, le=MAX_STANDBY, description="Standby environment pods."
    )
    model: int = Field(default=0, ge=0, le=MAX_STANDBY, description="Standby model pods.")
    agent: int = Field(default=0, ge=0, le=MAX_STANDBY, description="Standby agent pods.")
    resources: int = Field(default=0, ge=0, le=MAX_STANDBY, description="Standby resources pods.")

    def count(self, role: Role) -> int:
        return int(getattr(self, role.value))

    def wanted(self) -> list[tuple[Role, int]]:
        """(role, count) for every role with standby pods, in the protocol's role order."""
        return [(role, self.count(role)) for role in ROLE_ORDER if self.count(role) > 0]


class RolloutSetSpec(ApiModel):
    """Desired state of a RolloutSet: the participants and how they are protected."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                RULE_NEVER_SAVES.schema(),
                RULE_SIBLING_INTERVAL.schema(),
                RULE_STANDBY_ROLES.schema(),
            ]
        }
    )

    participants: list[ParticipantSpec] = Field(
        min_length=1,
        max_length=len(ROLE_ORDER),
        description="The rollout servers, one entry per role (environment, model, agent, "
        "resources); roles are unique. Each instance runs as a pod named "
        "<set>-<role>-<index>-a<attempt>. Changing replicas or templates while pods run is "
        "refused (condition Degraded, reason SpecChangeRefused).",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["role"],
            "x-kubernetes-validations": [RULE_UNIQUE_ROLES.schema()],
        },
    )
    storage: StorageSpec = Field(
        description="Where checkpoint records go: a volume mounted at the same path in every "
        "participant pod (path and volume), or an S3-API bucket (s3). Immutable."
    )
    checkpoint_policy: CheckpointPolicy = Field(
        default_factory=CheckpointPolicy,
        description="When checkpoints are taken beyond the RolloutCheckpoints people and trainers "
        "create (a timer, trainer checkpoints, a walltime deadline, evictions) and how many are "
        "kept. With recovery.targetLevel turn at least one of onTrainerCheckpoint, "
        "intervalSeconds or mustSaveBy must be set.",
        json_schema_extra={"default": {}},
    )
    recovery: RecoverySpec = Field(
        default_factory=RecoverySpec,
        description="What happens when a participant pod of the current attempt fails, is "
        "deleted or loses its node: fresh pods under attempt + 1, restored from the latest "
        "Ready checkpoint.",
        json_schema_extra={"default": {}},
    )
    suspend: bool = Field(
        default=False,
        description="true: checkpoint, then release all participant pods; false again: fresh "
        "pods restore the checkpoint and continue.",
    )
    progress_deadline_seconds: int = Field(
        default=600,
        ge=1,
        description="How long the pods of an attempt may take to become Ready before the set "
        "is Degraded with reason PodsNotStarting (as Deployment.spec.progressDeadlineSeconds).",
    )
    standby: StandbySpec = Field(
        default_factory=lambda: StandbySpec(),
        json_schema_extra={"default": {}},
        description="Warm spare pods per role (for example {environment: 1, model: 1}; none by "
        "default): Ready pods of the set made from the role's current template, model loaded, "
        "in no attempt (label checkpoint.rollout.dev/standby=true). A recovery adopts one for "
        "a lost instance instead of waiting for a fresh pod to start, and a replacement starts "
        "right after. A standby holds what its template requests (a model standby its GPUs).",
    )

    @model_validator(mode="after")
    def _check_rules(self) -> RolloutSetSpec:
        roles = [p.role for p in self.participants]
        if len(set(roles)) != len(roles):
            raise ValueError(RULE_UNIQUE_ROLES.message)
        policy = self.checkpoint_policy
        if (
            self.recovery.target_level is TargetLevel.TURN
            and not policy.on_trainer_checkpoint
            and policy.interval_seconds is None
            and policy.must_save_by is None
        ):
            raise ValueError(RULE_NEVER_SAVES.message)
        sibling = self.recovery.target_level is TargetLevel.SIBLING
        if sibling and policy.interval_seconds is not None:
            raise ValueError(RULE_SIBLING_INTERVAL.message)
        if any(self.participant(role) is None for role, _ in self.standby.wanted()):
            raise ValueError(RULE_STANDBY_ROLES.message)
        return self

    def participant(self, role: Role) -> ParticipantSpec | None:
        return next((p for p in self.participants if p.role is role), None)


# --- RolloutSet status --------------------------------------------------------------------------


class SetConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    RECOVERING = "Recovering"
    SUSPENDED = "Suspended"
    DEGRADED = "Degraded"
    DEADLINE_SAVED = "DeadlineSaved"
    QUOTA_PENDING = "QuotaPending"
    """A Kueue-queued set waits for admission (decide/queue.py)."""
    PREEMPTED = "Preempted"
    """Kueue evicted the set's Workload (decide/queue.py)."""


class ParticipantStatus(StatusModel):
    """One participant pod of the attempt shown in status.attempt (or the recovery target)."""

    role: Role = Field(description="The participant's role.")
    index: int = Field(ge=0, description="The instance index within the role.")
    pod: str = Field(
        description="The pod's name (<set>-<role>-<index>-a<attempt it was created under>)."
    )
    attempt: int | None = Field(
        default=None,
        ge=1,
        description="The attempt the pod runs (its attempt label). A pod an InPlace recovery "
        "kept runs a later attempt than its name says.",
    )
    ready: bool = Field(description="Whether the pod is Ready (its readiness probe passes).")
    phase: str | None = Field(default=None, description="The pod's phase.")
    address: str | None = Field(
        default=None,
        description="Base URL of the participant (http://<pod IP>:<control port>), once the "
        "pod has an IP; clients and the coordinator use it directly.",
    )


class RecoveryPhase(StrEnum):
    STOPPING_ATTEMPT = "StoppingAttempt"
    STARTING_PODS = "StartingPods"
    RESTORING = "Restoring"
    RESUMING = "Resuming"
    BACKING_OFF = "BackingOff"


_SECONDS_BY_PHASE: Final[dict[str, Any]] = {
    "additionalProperties": {"type": "number", "description": "Seconds, by phase name."}
}


class Work(StatusModel):
    """Amounts of rollout work: model tokens generated and episode steps completed."""

    model_tokens: int = Field(default=0, ge=0, description="Tokens generated by model servers.")
    steps: int = Field(
        default=0,
        ge=0,
        description="Episode steps completed (environment stages, agent model and tool calls).",
    )


class LostWorkReport(Work):
    """What one kept participant's retire said the lost attempt did after a checkpoint."""

    instance: str = Field(description="The participant (role-index).")
    since: str | None = Field(
        default=None,
        description="The checkpoint it counts from (the last it committed or restored); the "
        "report counts only when that is the checkpoint the recovery restores.",
    )


class RecoveryStatus(StatusModel):
    """A recovery in progress; kept in status so a restarted operator continues it."""

    phase: RecoveryPhase = Field(description="Where the recovery is.")
    from_attempt: int = Field(ge=1, description="The attempt whose pod was lost.")
    target_attempt: int = Field(ge=1, description="The attempt the fresh pods run under.")
    started_at: Timestamp = Field(description="When the loss was detected.")
    checkpoint: str | None = Field(
        default=None, description="The Ready checkpoint being restored (unset: fresh start)."
    )
    tries: int = Field(default=0, ge=0, description="Restore tries so far in this recovery.")
    next_try_at: Timestamp | None = Field(
        default=None, description="When the next try starts (phase BackingOff)."
    )
    reason: str | None = Field(default=None, description="Why the recovery started (CamelCase).")
    message: str | None = Field(default=None, description="What was lost, for people.")
    restore_policy: RestorePolicy = Field(
        default=RestorePolicy.RECREATE,
        description="How this try replaces pods: InPlace (only the lost ones) or Recreate (all). "
        "An InPlace recovery that cannot be done safely falls back to Recreate.",
    )
    kept: list[str] = Field(
        default_factory=list,
        max_length=MAX_KEPT_PODS,
        description="Pods of the lost attempt kept under the target attempt (InPlace).",
    )
    replaced: list[str] = Field(
        default_factory=list,
        max_length=MAX_KEPT_PODS,
        description="Participant instances (role-index) that get fresh pods.",
    )
    adopted: list[str] = Field(
        default_factory=list,
        max_length=MAX_KEPT_PODS,
        description="Standby pods this try adopts for lost instances, as role-index=pod: they "
        "take the instance's identity and peers in the restore call.",
    )
    fallback: str | None = Field(
        default=None, description="Why an InPlace recovery fell back to Recreate."
    )
    phase_seconds: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds spent in each finished phase of this recovery.",
        json_schema_extra=_SECONDS_BY_PHASE,
    )
    phase_started_at: Timestamp | None = Field(
        default=None, description="When the current phase began."
    )
    episodes_restored: int | None = Field(
        default=None, ge=0, description="Episodes the restore installed (continue from there)."
    )
    lost_work: list[LostWorkReport] = Field(
        default_factory=list,
        max_length=MAX_INSTANCES,
        description="The lost attempt's work after its checkpoint, as each participant that "
        "outlived the loss reported it when it retired that attempt.",
    )
    kept_work: Work | None = Field(
        default=None, description="The work the restored records hold (restore replies)."
    )


class RecoveryHold(StatusModel):
    """Recovery stopped: the set lost participants too often (`RecoveryLimitReached`)."""

    since: Timestamp = Field(description="When recovery stopped.")
    message: str = Field(description="The last loss and the bound it crossed, for people.")
    generation: int | None = Field(
        default=None, description="The spec generation it stopped at; a spec change retries."
    )
    retry_token: str | None = Field(
        default=None,
        description="The retry-recovery annotation's value it stopped at; a new value retries.",
    )


class LastRecovery(StatusModel):
    """What the last finished recovery cost: the work it kept and the work it lost."""

    completed_at: Timestamp = Field(description="When the set ran again.")
    reason: str = Field(description="Why it started (PodFailed, PodDeleted, NodeLost, ...).")
    attempt: int = Field(ge=1, description="The attempt it brought up.")
    restore_policy: RestorePolicy = Field(description="How pods were replaced in the end.")
    kept: int = Field(ge=0, description="Participant pods kept (InPlace).")
    replaced: int = Field(ge=0, description="Participant pods replaced by fresh ones.")
    checkpoint: str | None = Field(
        default=None, description="The checkpoint restored (unset: episodes restarted)."
    )
    adopted: list[str] = Field(
        default_factory=list,
        max_length=MAX_KEPT_PODS,
        description="Instances taken from standby pods (role-index=pod) instead of fresh pods.",
    )
    checkpoint_age_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Time from the restored checkpoint's completion to the loss: the work "
        "done since then was lost.",
    )
    episodes_restored: int = Field(
        default=0,
        ge=0,
        description="Episodes the restored checkpoint installed at their last boundary (each "
        "continues from it if the trainer re-issues it; one that had finished before the loss "
        "is not run again).",
    )
    episodes_restarted: int = Field(
        default=0,
        ge=0,
        description="Episodes the checkpoint could not capture (they restart from scratch).",
    )
    duration_seconds: float = Field(ge=0, description="From the loss to the set running again.")
    phase_seconds: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds spent in each recovery phase.",
        json_schema_extra=_SECONDS_BY_PHASE,
    )
    model_tokens_kept: int = Field(
        default=0,
        ge=0,
        description="Model tokens the restored checkpoint held for generations in flight (cut "
        "prefixes, held responses): continued, not generated again.",
    )
    model_tokens_generated_again: int = Field(
        default=0,
        ge=0,
        description="Model tokens the lost attempt generated after the restored checkpoint for "
        "unfinished episodes, as the model pods that outlived the loss counted them: generated "
        "again now. A lower bound while workUncounted names a model.",
    )
    steps_kept: int = Field(
        default=0,
        ge=0,
        description="Episode steps the restored records had completed (environment and agent).",
    )
    steps_redone: int = Field(
        default=0,
        ge=0,
        description="Episode steps unfinished episodes completed after the restored checkpoint, "
        "as the environment and agent pods that outlived the loss counted them: done again "
        "now. A lower bound while workUncounted names an environment or agent.",
    )
    work_uncounted: list[str] = Field(
        default_factory=list,
        max_length=MAX_INSTANCES,
        description="Participants (role-index) whose work after the checkpoint nobody could "
        "count: the lost pods, and kept ones that did not report it against the restored "
        "checkpoint.",
    )


class StandbyStatus(ApiModel):
    """The standby pods: how many are Ready of how many the spec asks for."""

    desired: int = Field(ge=0, description="Standby pods spec.standby asks for, all roles.")
    ready: int = Field(ge=0, description="Standby pods Ready, made from the current templates.")
    shown: str = Field(description="ready/desired, for kubectl get.")
    pods: list[str] = Field(
        default_factory=list,
        max_length=MAX_STANDBY * 4,
        description="The standby pods that exist (Ready or starting).",
    )


class RolloutSetStatus(StatusModel):
    """Observed state of a RolloutSet."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation this status was computed from."
    )
    attempt: int | None = Field(
        default=None,
        ge=1,
        description="The current attempt (starts at 1; each recovery adds one). Episodes are "
        "identified by (rollout id, attempt).",
    )
    created_attempt: int | None = Field(
        default=None,
        ge=1,
        description="The latest attempt whose pods were all created and Ready together; a pod "
        "of that attempt that fails or disappears afterwards is lost (recovered), never silently "
        "recreated.",
    )
    restarts: int = Field(
        default=0,
        ge=0,
        description="Recoveries after a lost participant so far (a resume after suspend is "
        "not one).",
    )
    latest_checkpoint: str | None = Field(
        default=None, description="The newest Ready RolloutCheckpoint: what a recovery restores."
    )
    latest_checkpoint_time: Timestamp | None = Field(
        default=None, description="When the latest Ready checkpoint was published."
    )
    active_checkpoint: str | None = Field(
        default=None, description="The RolloutCheckpoint running now (at most one per set)."
    )
    last_trainer_step: int | None = Field(
        default=None,
        ge=0,
        description="The last trainer step a TrainerCheckpoint checkpoint was created for.",
    )
    save_reserve_seconds: int | None = Field(
        default=None,
        ge=0,
        description="How long before mustSaveBy the deadline checkpoint starts, estimated from "
        "recent checkpoint durations plus a margin.",
    )
    recent_checkpoint_seconds: list[float] = Field(
        default_factory=list,
        max_length=20,
        description="Total durations of the most recent Ready checkpoints (newest last).",
    )
    participants: list[ParticipantStatus] = Field(
        default_factory=list,
        max_length=MAX_INSTANCES,
        description="The participant pods and their addresses.",
    )
    standby: StandbyStatus | None = Field(
        default=None, description="The standby pods (present when spec.standby asks for any)."
    )
    recovery: RecoveryStatus | None = Field(
        default=None, description="Present while a recovery runs."
    )
    last_recovery: LastRecovery | None = Field(
        default=None, description="What the last finished recovery kept and lost."
    )
    recovery_starts: list[Timestamp] = Field(
        default_factory=list,
        max_length=MAX_RECOVERY_STARTS,
        description="When the most recent recoveries started (newest last): losses counted "
        "against recovery.maxRestarts in a sliding window.",
    )
    recovery_hold: RecoveryHold | None = Field(
        default=None,
        description="Present while recovery is stopped after too many losses in the window.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Recovering, Suspended, Degraded, and DeadlineSaved "
        "while mustSaveBy is set (reason Waiting, Saving, Saved, Missed, CheckpointFailed or "
        "NothingToSave).",
        json_schema_extra=_CONDITIONS_LIST,
    )


DEFAULT_NAMESPACE: Final = "default"
"""Where the API server puts a namespaced object whose manifest names no namespace."""


def namespace_or_default(namespace: object) -> str:
    """The namespace an object's metadata (or a Kopf event) names; `DEFAULT_NAMESPACE` when it
    names none, as the API server reads it."""
    return str(namespace) if namespace else DEFAULT_NAMESPACE


class ObjectMeta(BaseModel):
    """The part of `metav1.ObjectMeta` the operator reads."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    name: str
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    deletion_timestamp: datetime | None = None


class RolloutSet(BaseModel):
    """A RolloutSet object as read from the API server."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    api_version: str = API_VERSION
    kind: str = ROLLOUT_SET_KIND
    metadata: ObjectMeta
    spec: RolloutSetSpec
    status: RolloutSetStatus = Field(default_factory=RolloutSetStatus)

    @model_validator(mode="after")
    def _check_name(self) -> RolloutSet:
        name = self.metadata.name
        if len(name) > MAX_SET_NAME_LENGTH or not re.match(DNS_LABEL_PATTERN, name):
            raise ValueError(RULE_SET_NAME.message)
        return self


# --- RolloutCheckpoint --------------------------------------------------------------------------


class Trigger(StrEnum):
    MANUAL = "Manual"
    INTERVAL = "Interval"
    TRAINER_CHECKPOINT = "TrainerCheckpoint"
    DEADLINE = "Deadline"
    EVICTION = "Eviction"
    SUSPEND = "Suspend"


class RolloutCheckpointSpec(ApiModel):
    """What to checkpoint and why."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                RULE_CHECKPOINT_SPEC_IMMUTABLE.schema(),
                RULE_TRAINER_STEP.schema(),
            ]
        }
    )

    rollout_set: str = Field(
        min_length=1,
        max_length=MAX_SET_NAME_LENGTH,
        pattern=DNS_LABEL_PATTERN,
        description="The RolloutSet (same namespace) whose participants are checkpointed.",
    )
    trigger: Trigger = Field(
        default=Trigger.MANUAL,
        description="Why the checkpoint was taken: Manual, Interval, TrainerCheckpoint, "
        "Deadline, Eviction or Suspend.",
    )
    trainer_step: int | None = Field(
        default=None,
        ge=0,
        description="The trainer step this checkpoint belongs to (required for "
        "TrainerCheckpoint); recorded with the checkpoint.",
    )
    episodes: list[RolloutIdStr] | None = Field(
        default=None,
        max_length=MAX_SCOPE_EPISODES,
        description="Restrict the commit scope to these rollout ids (unset: every parked "
        "episode); at most 10000.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )

    @model_validator(mode="after")
    def _check_trainer_step(self) -> RolloutCheckpointSpec:
        if self.trigger is Trigger.TRAINER_CHECKPOINT and self.trainer_step is None:
            raise ValueError(RULE_TRAINER_STEP.message)
        return self


class CheckpointPhase(StrEnum):
    PENDING = "Pending"
    QUEUED = "Queued"
    PREPARING = "Preparing"
    COMMITTING = "Committing"
    RESUMING = "Resuming"
    PERSISTING = "Persisting"
    READY = "Ready"
    FAILED = "Failed"


CHECKPOINT_RUNNING: Final = frozenset(
    {
        CheckpointPhase.PREPARING,
        CheckpointPhase.COMMITTING,
        CheckpointPhase.RESUMING,
        CheckpointPhase.PERSISTING,
    }
)
"""Phases of a checkpoint that holds its set's slot and has closed the participants' admission
(or, Persisting, holds their cut records); a restarted operator continues them."""
CHECKPOINT_FINISHED: Final = frozenset({CheckpointPhase.READY, CheckpointPhase.FAILED})


class CheckpointConditionType(StrEnum):
    PREPARED = "Prepared"
    COMMITTED = "Committed"
    READY = "Ready"
    FAILED = "Failed"


class RestoreVerdict(StrEnum):
    """Reasons on a RolloutCheckpoint's Ready=False condition that a restore refused it
    (docs/design.md#62-recovery): the recovery's own verdicts, never repaired back to Ready."""

    RECORDS_INVALID = "RecordsInvalid"
    """A participant found its records and they failed verification (damaged, another
    checkpoint's, too new, refused)."""
    RECORDS_UNREACHABLE = "RecordsUnreachable"
    """A participant found no records of it on the storage it sees (the checkpoint's folder or
    manifest absent there: a volume only a lost node had)."""


class CheckpointParticipant(StatusModel):
    """One participant's committed records."""

    instance: str = Field(description="The participant instance (<role>-<index>).")
    manifest: str = Field(description="The manifest path, relative to the checkpoint root.")
    records_sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the records file."
    )
    record_count: int = Field(ge=0, description="Records in the file.")
    bytes: int = Field(ge=0, description="Size of the records file.")
    rollout_ids: list[str] | None = Field(
        default=None,
        description="The rollouts whose records the participant wrote, kept only for a "
        "participant whose restore must name them (one speaking the NeMo Gym dialect); unset: "
        "a restore asks for every record.",
    )


class CheckpointDurations(StatusModel):
    """How long each part took, in seconds with millisecond resolution (pauses are often well
    under a second, so whole seconds would hide what matters)."""

    prepare_seconds: float | None = Field(
        default=None, ge=0, description="Prepare: until every episode parked."
    )
    commit_seconds: float | None = Field(
        default=None,
        ge=0,
        description="The cut: every participant fixing its records (writing them, for a "
        "participant that persists inside the pause).",
    )
    pause_seconds: float | None = Field(
        default=None, ge=0, description="Admission closed: prepare start to resume done."
    )
    persist_seconds: float | None = Field(
        default=None,
        ge=0,
        description="After the resume: until every participant's records and manifest were "
        "durable and verified.",
    )
    total_seconds: float | None = Field(
        default=None, ge=0, description="Creation of the checkpoint to its outcome."
    )


class RolloutCheckpointStatus(StatusModel):
    """Observed state of a RolloutCheckpoint; Ready=True means published and restorable."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation this status was computed from."
    )
    phase: CheckpointPhase | None = Field(
        default=None,
        description="Pending, Queued, Preparing, Committing, Resuming, Persisting, Ready or "
        "Failed; persisted so a restarted operator continues or fails it cleanly.",
    )
    attempt: int | None = Field(
        default=None, ge=1, description="The attempt whose state the checkpoint captured."
    )
    episodes: int | None = Field(
        default=None, ge=0, description="Episodes committed (they continue after a restore)."
    )
    restarts: int | None = Field(
        default=None, ge=0, description="Episodes that could not be captured and will restart."
    )
    blockers: list[str] = Field(
        default_factory=list,
        max_length=100,
        description="Episodes (rollout@attempt) not parked at the prepare deadline (first 100).",
    )
    blocker_count: int | None = Field(
        default=None, ge=0, description="How many episodes were not parked at the deadline."
    )
    participants: list[CheckpointParticipant] = Field(
        default_factory=list,
        max_length=MAX_INSTANCES,
        description="Each participant's manifest and records.",
    )
    durations: CheckpointDurations | None = Field(
        default=None, description="How long the phases took."
    )
    started_at: Timestamp | None = Field(default=None, description="When prepare started.")
    deadline: Timestamp | None = Field(
        default=None, description="The prepare deadline given to the participants."
    )
    completed_at: MicroTimestamp | None = Field(
        default=None, description="When the checkpoint became Ready or Failed."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Prepared, Committed, Ready (published and restorable), Failed.",
        json_schema_extra=_CONDITIONS_LIST,
    )


class RolloutCheckpoint(BaseModel):
    """A RolloutCheckpoint object as read from the API server."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    api_version: str = API_VERSION
    kind: str = ROLLOUT_CHECKPOINT_KIND
    metadata: ObjectMeta
    spec: RolloutCheckpointSpec
    status: RolloutCheckpointStatus = Field(default_factory=RolloutCheckpointStatus)

    @model_validator(mode="after")
    def _check_name(self) -> RolloutCheckpoint:
        if len(self.metadata.name) > MAX_CHECKPOINT_NAME_LENGTH:
            raise ValueError(RULE_CHECKPOINT_NAME.message)
        return self
