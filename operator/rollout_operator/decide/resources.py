"""Pure builders of the Kubernetes objects a RolloutSet owns: token Secret, pods, Services.

No I/O here: every function takes the parsed RolloutSet and returns a plain manifest dict, so
naming, labels, env, volumes and owner references are unit-tested without a cluster.

Peer wiring (see docs/api.md, "Peers"): a participant reaches its peers through env vars
`ROLLOUT_PEER_<ROLE>_URL` holding the peer pod's `http://<pod IP>:<control port>`. Pod IPs exist
only after a pod starts, so the operator creates an attempt's pods in dependency order: callees
(model, resources) first, then the agent once they have IPs, then the environment. Instance `i`
of a role talks to instance `i mod replicas` of each peer role: a fixed mapping, so an episode
restored into `environment-1` finds its agent session restored in the same `agent-k` as before.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from rollout_protocol import S3_ENV_PREFIX, Role, set_storage_dir

from ..model.api import (
    ANNOTATION_SPEC_HASH,
    ANNOTATION_TEMPLATE_HASH,
    API_VERSION,
    CONTROL_PORT_NAME,
    GROUP,
    LABEL_ATTEMPT,
    LABEL_INDEX,
    LABEL_ROLE,
    LABEL_SET,
    LABEL_STANDBY,
    ROLLOUT_SET_KIND,
    ParticipantSpec,
    PodTemplate,
    RolloutSet,
    RolloutSetSpec,
    StorageSpec,
    dump,
    namespace_or_default,
)

STORAGE_VOLUME_NAME: Final = "rollout-checkpoints"
"""The pod volume the operator adds for spec.storage (the set's volume, or for a bucket the
Secret with its credentials); templates must not use this name."""
CREDENTIALS_MOUNT: Final = "/var/run/secrets/checkpoint.rollout.dev/storage"
"""Where a bucket set's credentials Secret is mounted, read-only, in every participant container
(`ROLLOUT_STORAGE_S3_CREDENTIALS_DIR`)."""


def reserved_volume_notes(rset: RolloutSet) -> list[str]:
    """A message for each role whose template has a volume (or a mount) named
    `STORAGE_VOLUME_NAME`: the operator replaces it with the storage volume, so what the
    template put there never reaches the pod (said in a Warning Event, not silently dropped)."""
    notes = []
    for participant in rset.spec.participants:
        spec = participant.template.model_dump(by_alias=True, exclude_none=True)["spec"]
        if any(v.get("name") == STORAGE_VOLUME_NAME for v in spec.get("volumes") or []):
            notes.append(
                f"the pod template of participant {participant.role.value} has a volume named "
                f"{STORAGE_VOLUME_NAME!r}, a name the operator reserves for spec.storage: it "
                "was replaced by the storage volume; rename the template's volume"
            )
    return notes


TOKEN_KEY: Final = "token"
"""The key of the control token in the set's Secret."""
MANAGED_BY: Final = "rollout-checkpoint-operator"

PEERS: Final[Mapping[Role, tuple[Role, ...]]] = MappingProxyType(
    {
        Role.ENVIRONMENT: (Role.AGENT, Role.MODEL, Role.RESOURCES),
        Role.AGENT: (Role.MODEL, Role.RESOURCES),
        Role.MODEL: (),
        Role.RESOURCES: (),
    }
)
"""Who calls whom. Pods of a role are created only after every pod of its peer roles has an IP."""

ENV_SET: Final = "ROLLOUT_SET"
ENV_ROLE: Final = "ROLLOUT_ROLE"
ENV_INDEX: Final = "ROLLOUT_INDEX"
ENV_ATTEMPT: Final = "ROLLOUT_ATTEMPT"
ENV_CHECKPOINT_ROOT: Final = "ROLLOUT_CHECKPOINT_ROOT"
ENV_SET_DIR: Final = "ROLLOUT_SET_DIR"
"""The set's own directory under the checkpoint root (`set_dir`); for a bucket, the key path
below the prefix."""
ENV_S3_ENDPOINT: Final = f"{S3_ENV_PREFIX}ENDPOINT"
ENV_S3_BUCKET: Final = f"{S3_ENV_PREFIX}BUCKET"
ENV_S3_PREFIX: Final = f"{S3_ENV_PREFIX}PREFIX"
ENV_S3_REGION: Final = f"{S3_ENV_PREFIX}REGION"
ENV_S3_ADDRESSING: Final = f"{S3_ENV_PREFIX}ADDRESSING"
ENV_S3_CREDENTIALS_DIR: Final = f"{S3_ENV_PREFIX}CREDENTIALS_DIR"
"""A bucket set's storage, as the participants read it (`rollout_protocol.bucket_from_env`)."""
ENV_CONTROL_TOKEN: Final = "ROLLOUT_CONTROL_TOKEN"
ENV_POD_IP: Final = "ROLLOUT_POD_IP"
ENV_STANDBY: Final = "ROLLOUT_STANDBY"
"""Set to 1 in a standby pod: its control plane takes the identity a recovery's restore gives."""


def peer_env_name(role: Role) -> str:
    return f"ROLLOUT_PEER_{role.value.upper()}_URL"


# --- names and labels ---------------------------------------------------------------------------


def set_dir(rset: RolloutSet) -> str:
    """The set's directory under the checkpoint root: `<namespace>/<set>/<uid>`.

    Sets share volumes: the namespace and the uid (the API server's, never a user's choice)
    keep two sets of the same name, or a set created again under an old name, apart, and tell
    the operator which records on a volume are this set's and nothing else."""
    if not rset.metadata.uid:
        raise ValueError(f"RolloutSet {rset.metadata.name} has no uid; read it from the API")
    namespace = namespace_or_default(rset.metadata.namespace)
    return set_storage_dir(namespace, rset.metadata.name, rset.metadata.uid)


def pod_name(set_name: str, role: Role, index: int, attempt: int) -> str:
    return f"{set_name}-{role.value}-{index}-a{attempt}"


def service_name(set_name: str, role: Role) -> str:
    return f"{set_name}-{role.value}"


def secret_name(set_name: str) -> str:
    return f"{set_name}-control-token"


def set_labels(set_name: str) -> dict[str, str]:
    return {LABEL_SET: set_name, "app.kubernetes.io/managed-by": MANAGED_BY}


def role_selector(set_name: str, role: Role) -> dict[str, str]:
    return {LABEL_SET: set_name, LABEL_ROLE: role.value}


def pod_labels(set_name: str, role: Role, index: int, attempt: int) -> dict[str, str]:
    return {
        **set_labels(set_name),
        LABEL_ROLE: role.value,
        LABEL_INDEX: str(index),
        LABEL_ATTEMPT: str(attempt),
    }


def attempt_selector(set_name: str, attempt: int) -> str:
    """A label selector string for the pods of one attempt of a set."""
    return f"{LABEL_SET}={set_name},{LABEL_ATTEMPT}={attempt}"


def set_selector(set_name: str) -> str:
    return f"{LABEL_SET}={set_name}"


def owner_reference(rset: RolloutSet) -> dict[str, Any]:
    """Controller reference to the set: deleting the set deletes what it owns (GC cascade)."""
    if not rset.metadata.uid:
        raise ValueError(f"RolloutSet {rset.metadata.name} has no uid; read it from the API")
    return {
        "apiVersion": API_VERSION,
        "kind": ROLLOUT_SET_KIND,
        "name": rset.metadata.name,
        "uid": rset.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(rset: RolloutSet, name: str, labels: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": labels,
        "ownerReferences": [owner_reference(rset)],
    }
    if rset.metadata.namespace:
        meta["namespace"] = rset.metadata.namespace
    return meta


# --- the control token --------------------------------------------------------------------------


def new_control_token() -> str:
    """256 random bits; generated once per set and never rotated under running pods."""
    return secrets.token_urlsafe(32)


def control_token_secret(rset: RolloutSet, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(
            rset, secret_name(rset.metadata.name), set_labels(rset.metadata.name)
        ),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def token_from_secret(secret: Mapping[str, Any]) -> str:
    data = secret.get("data") or {}
    encoded = data.get(TOKEN_KEY)
    if not encoded:
        raise ValueError(f"secret has no {TOKEN_KEY!r} key")
    return base64.b64decode(encoded).decode()


# --- participant pods ---------------------------------------------------------------------------


def control_port(template: PodTemplate) -> int:
    """The containerPort named `control` (the API guarantees there is one)."""
    for container in template.spec.containers:
        for port in container.ports:
            if port.name == CONTROL_PORT_NAME:
                return port.container_port
    raise ValueError('the pod template has no container port named "control"')


def participant_url(pod_ip: str, port: int) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}"


def peer_index(index: int, peer_replicas: int) -> int:
    """Instance `index` always talks to the same peer instance (stable across attempts)."""
    return index % peer_replicas


def _digest(payload: object) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def template_hash(participant: ParticipantSpec) -> str:
    """Digest of one role's pod template; lets a refused spec change name the roles touched."""
    return _digest(dump(participant.template))


def participants_hash(spec: RolloutSetSpec) -> str:
    """Digest of what the pods are built from: participants (roles, replicas, templates) and
    storage. Pods carry it, so a spec change under running pods is detected."""
    payload = {
        "participants": [dump(p) for p in spec.participants],
        "storage": dump(spec.storage),
    }
    return _digest(payload)


def _operator_env(
    rset: RolloutSet, role: Role, index: int, attempt: int, peer_urls: Mapping[Role, str]
) -> list[dict[str, Any]]:
    name = rset.metadata.name
    env: list[dict[str, Any]] = [
        {"name": ENV_SET, "value": name},
        {"name": ENV_ROLE, "value": role.value},
        {"name": ENV_INDEX, "value": str(index)},
        {"name": ENV_ATTEMPT, "value": str(attempt)},
        *_storage_env(rset.spec.storage),
        {"name": ENV_SET_DIR, "value": set_dir(rset)},
        {
            "name": ENV_CONTROL_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": secret_name(name), "key": TOKEN_KEY}},
        },
        {"name": ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    for peer in PEERS[role]:
        if peer in peer_urls:
            env.append({"name": peer_env_name(peer), "value": peer_urls[peer]})
    return env


def _storage_env(storage: StorageSpec) -> list[dict[str, Any]]:
    """Where the participants keep records: the volume's mount path, or the bucket (its
    credentials are files in `CREDENTIALS_MOUNT`, never env values)."""
    if storage.s3 is None:
        return [{"name": ENV_CHECKPOINT_ROOT, "value": storage.path}]
    s3 = storage.s3
    return [
        {"name": ENV_S3_ENDPOINT, "value": s3.endpoint},
        {"name": ENV_S3_BUCKET, "value": s3.bucket},
        {"name": ENV_S3_PREFIX, "value": s3.prefix},
        {"name": ENV_S3_REGION, "value": s3.region},
        {"name": ENV_S3_ADDRESSING, "value": s3.addressing_style.value},
        {"name": ENV_S3_CREDENTIALS_DIR, "value": CREDENTIALS_MOUNT},
    ]


def storage_volume(storage: StorageSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod volume and the container mount of spec.storage: the set's volume at its path,
    or a bucket's credentials Secret, read-only, at `CREDENTIALS_MOUNT`."""
    if storage.s3 is not None:
        volume = {"name": STORAGE_VOLUME_NAME, "secret": {"secretName": storage.s3.secret_name}}
        mount = {"name": STORAGE_VOLUME_NAME, "mountPath": CREDENTIALS_MOUNT, "readOnly": True}
        return volume, mount
    if storage.volume is None or storage.path is None:  # the API refuses it (one backend)
        raise ValueError("spec.storage has neither a volume with a path nor a bucket")
    return (
        {"name": STORAGE_VOLUME_NAME, **storage.volume},
        {"name": STORAGE_VOLUME_NAME, "mountPath": storage.path},
    )


def _container(
    container: Mapping[str, Any], env: list[dict[str, Any]], mount: dict[str, Any]
) -> dict[str, Any]:
    """The template container plus our env (first, so template values may use `$(VAR)` on
    them; template entries with our names are dropped) and the storage mount."""
    ours = {e["name"] for e in env}
    out = dict(container)
    out["env"] = [*env, *(e for e in container.get("env") or [] if e.get("name") not in ours)]
    mounts = [
        m for m in container.get("volumeMounts") or [] if m.get("name") != STORAGE_VOLUME_NAME
    ]
    out["volumeMounts"] = [*mounts, dict(mount)]
    return out


def participant_pod(
    rset: RolloutSet,
    participant: ParticipantSpec,
    index: int,
    attempt: int,
    peer_urls: Mapping[Role, str],
) -> dict[str, Any]:
    """The pod of instance `index` of a role under `attempt`.

    `peer_urls` maps each peer role to the URL of the peer instance this one talks to (see
    `peer_index`); a role without peers gets none.
    """
    role = participant.role
    set_name = rset.metadata.name
    template = dump(participant.template)
    template_meta: dict[str, Any] = template.get("metadata") or {}
    labels = {**(template_meta.get("labels") or {}), **pod_labels(set_name, role, index, attempt)}
    annotations = {
        **(template_meta.get("annotations") or {}),
        ANNOTATION_SPEC_HASH: participants_hash(rset.spec),
        ANNOTATION_TEMPLATE_HASH: template_hash(participant),
    }
    metadata = _metadata(rset, pod_name(set_name, role, index, attempt), labels)
    metadata["annotations"] = annotations

    spec: dict[str, Any] = dict(template["spec"])
    env = _operator_env(rset, role, index, attempt, peer_urls)
    volume, mount = storage_volume(rset.spec.storage)
    spec["containers"] = [_container(c, env, mount) for c in spec["containers"]]
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") != STORAGE_VOLUME_NAME]
    spec["volumes"] = [*volumes, volume]
    spec["restartPolicy"] = "Never"
    spec.setdefault("hostname", f"{role.value}-{index}")
    spec.setdefault("subdomain", service_name(set_name, role))
    spec.setdefault("automountServiceAccountToken", False)
    _place(spec, rset.metadata.annotations.get(ANNOTATION_KUEUE_PLACEMENT), role.value)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


ANNOTATION_KUEUE_PLACEMENT: Final = f"{GROUP}/kueue-placement"
"""Per role, the node selector and tolerations of the flavors Kueue admitted the set on
(written by the queue pass, `decide.queue`)."""


def _place(spec: dict[str, Any], placement: str | None, role: str) -> None:
    """Apply the admitted flavors' node selector and tolerations to a pod spec, as Kueue's own
    integrations do to a job's pod templates (the flavor's labels win over the template's)."""
    if not placement:
        return
    try:
        parsed = json.loads(placement)
    except ValueError:
        return
    entry = parsed.get(role) if isinstance(parsed, dict) else None
    if not isinstance(entry, dict):
        return
    selector = entry.get("nodeSelector")
    if isinstance(selector, dict) and selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **selector}
    tolerations = entry.get("tolerations")
    if isinstance(tolerations, list) and tolerations:
        have = list(spec.get("tolerations") or [])
        spec["tolerations"] = have + [t for t in tolerations if t not in have]


# --- standby pods -------------------------------------------------------------------------------


def standby_pod_name(set_name: str, role: Role, ordinal: int, attempt: int) -> str:
    """`<set>-<role>-standby-<ordinal>-a<attempt it was made under>`: unique across adoptions
    (an adopted standby keeps its name; its replacement is made under the next attempt)."""
    return f"{set_name}-{role.value}-standby-{ordinal}-a{attempt}"


def standby_pod(
    rset: RolloutSet,
    participant: ParticipantSpec,
    ordinal: int,
    attempt: int,
    peer_urls: Mapping[Role, str],
) -> dict[str, Any]:
    """A standby pod of a role: the role's pod under the current template, in no attempt.

    It is the pod instance 0 of the role would be, except that it carries the standby label
    instead of the attempt and index labels (so nothing that selects an attempt's pods sees it),
    runs under attempt 0 with `ROLLOUT_STANDBY=1`, and calls the peers instance 0 calls now. A
    recovery that adopts it relabels it and gives it its instance, attempt and peers in the
    restore call."""
    pod = participant_pod(rset, participant, 0, 0, peer_urls)
    role = participant.role
    labels = {
        k: v for k, v in pod["metadata"]["labels"].items() if k not in (LABEL_ATTEMPT, LABEL_INDEX)
    }
    labels[LABEL_STANDBY] = "true"
    pod["metadata"]["labels"] = labels
    pod["metadata"]["name"] = standby_pod_name(rset.metadata.name, role, ordinal, attempt)
    for container in pod["spec"]["containers"]:
        container["env"] = [{"name": ENV_STANDBY, "value": "1"}, *container["env"]]
    if pod["spec"]["hostname"] == f"{role.value}-0":  # not the template's own
        pod["spec"]["hostname"] = f"{role.value}-standby-{ordinal}"
    return pod


# --- the records cleanup pod --------------------------------------------------------------------

LABEL_RECORDS_OF: Final = f"{GROUP}/records-of"
"""On a cleanup pod: the set whose records it removes. Not `LABEL_SET`: a cleanup pod is no
participant, and nothing that selects a set's pods (its loops, recovery, the trainer) sees it."""
CLEANUP_MOUNT: Final = "/records"
CLEANUP_DEADLINE_SECONDS: Final = 120
"""`activeDeadlineSeconds` of a cleanup pod once running; the operator also gives up on one that
has not finished this long after its creation (never scheduled, image not pulled)."""
_POD_SCHEDULING: Final = ("nodeSelector", "affinity", "tolerations", "imagePullSecrets")


def cleanup_pod_name(rset: RolloutSet, checkpoints: tuple[str, ...] | None) -> str:
    """Deterministic per (set uid, what is removed): a retry finds the pod it made before."""
    what = "*" if checkpoints is None else ",".join(sorted(checkpoints))
    digest = hashlib.sha256(f"{rset.metadata.uid}/{what}".encode()).hexdigest()[:10]
    return f"{rset.metadata.name[:40]}-records-{digest}"


def cleanup_pod(
    rset: RolloutSet, checkpoints: tuple[str, ...] | None, image: str
) -> dict[str, Any]:
    """A short-lived pod that mounts the set's volume and removes records with `rollout-records`
    (the same code as a participant's `remove`), for when no participant of the set runs. For a
    bucket it mounts the bucket's credentials Secret and gets the participants' bucket env
    instead, and `rollout-records` (without `--root`) removes the set's keys from the bucket.

    It runs as the set's participants do (the first template's pod `securityContext`, so it may
    delete what they wrote) and where they may run (their node selector, affinity, tolerations
    and pull secrets): a hostPath volume is reached only on the node the pod lands on. Not owned
    by the set (a set deleted in the foreground would take it before it ran); the operator
    deletes it once it has read its result from the termination message and exit code."""
    first = dump(rset.spec.participants[0].template).get("spec") or {}
    storage = rset.spec.storage
    command = ["rollout-records", "remove"]
    if storage.s3 is None:
        command += ["--root", CLEANUP_MOUNT]
    command += ["--set-dir", set_dir(rset), "--termination-log", "/dev/termination-log"]
    if checkpoints is None:
        command.append("--whole-set")
    else:
        for checkpoint in checkpoints:
            command += ["--checkpoint", checkpoint]
    volume, mount = storage_volume(storage)
    if storage.s3 is None:
        mount = {**mount, "mountPath": CLEANUP_MOUNT}
    spec: dict[str, Any] = {key: first[key] for key in _POD_SCHEDULING if key in first}
    if "securityContext" in first:
        spec["securityContext"] = first["securityContext"]
    spec.update(
        restartPolicy="Never",
        activeDeadlineSeconds=CLEANUP_DEADLINE_SECONDS,
        automountServiceAccountToken=False,
        enableServiceLinks=False,
        terminationGracePeriodSeconds=5,
        containers=[
            {
                "name": "remove-records",
                "image": image,
                "command": command,
                "env": _storage_env(storage) if storage.s3 is not None else [],
                "volumeMounts": [mount],
                "terminationMessagePolicy": "File",
                "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "readOnlyRootFilesystem": True,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            }
        ],
        volumes=[volume],
    )
    metadata: dict[str, Any] = {
        "name": cleanup_pod_name(rset, checkpoints),
        "labels": {
            LABEL_RECORDS_OF: rset.metadata.name,
            "app.kubernetes.io/managed-by": MANAGED_BY,
        },
    }
    if rset.metadata.namespace:
        metadata["namespace"] = rset.metadata.namespace
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


# --- services -----------------------------------------------------------------------------------


def role_service(rset: RolloutSet, participant: ParticipantSpec) -> dict[str, Any]:
    """A headless Service per role.

    Headless because episodes stick to one instance (its records hold their state), so callers
    must address instances, never a load-balanced role: the Service gives each pod the DNS name
    `<role>-<index>.<set>-<role>.<namespace>.svc` on clusters with DNS. It selects by set and
    role only, so it follows the pods across attempts; only Ready pods are published.
    """
    set_name = rset.metadata.name
    role = participant.role
    labels = {**set_labels(set_name), LABEL_ROLE: role.value}
    port = control_port(participant.template)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(rset, service_name(set_name, role), labels),
        "spec": {
            "clusterIP": "None",
            "selector": role_selector(set_name, role),
            "publishNotReadyAddresses": False,
            "ports": [
                {
                    "name": CONTROL_PORT_NAME,
                    "port": port,
                    "targetPort": CONTROL_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }
