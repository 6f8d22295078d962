"""Kueue on a devcluster: the real controller manager, built from the pinned Go module.

`make kueue-binaries` (devcluster/build-kueue.sh) builds `sigs.k8s.io/kueue/cmd/kueue` and copies
the module's own CRDs (`config/components/crd/bases/`) and webhook manifests next to it, cached per
machine by a digest of the pin; `.bin/kueue` links to that folder (`$DEVCLUSTER_KUEUE` overrides).
`start(cluster)` (and `python -m devcluster up --kueue`) then:

- applies the CRDs with their conversion webhooks and the admission webhooks of Kueue's own
  kinds and of `batch/v1` Jobs, all as `url` webhooks on `https://127.0.0.1:<port>`: the process
  node has no Service routing, and the API server runs on loopback next to the controller;
- keeps Kueue's internal certificate management on (the controller's metrics server needs it) but
  hands it a CA and a serving certificate of our own in the Secret it reads: the certificate names
  both the Service Kueue expects (`kueue-webhook-service.kueue-system.svc`, which is what the
  rotator checks) and 127.0.0.1 (what the API server dials), so the rotator keeps them and
  injects the same CA into the webhook configurations; the files are written into the webhook
  server's folder as a Secret volume would hold them;
- runs the controller with the admin kubeconfig, its health probe and webhook server on loopback,
  metrics and the visibility API server off, leader election off, and
  `integrations.externalFrameworks` set (RolloutSet by default), recorded in the cluster's state
  so `down` stops it;
- waits until the API server reaches the webhook (a server-side dry-run create of a
  ResourceFlavor passes Kueue's mutating webhook).

Nothing listens beyond loopback and nothing is fetched from the network.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from devcluster.cluster import Cluster
from devcluster.errors import DevclusterError
from devcluster.paths import REPO_ROOT
from devcluster.ports import pick_free
from devcluster.procs import is_alive, spawn, stop_groups
from devcluster.state import MARKER_ENV, ProcessRecord, read_state, write_state
from devcluster.waiting import wait_for_sync

NAMESPACE: Final = "kueue-system"
WEBHOOK_SERVICE: Final = "kueue-webhook-service"
WEBHOOK_SECRET: Final = "kueue-webhook-server-cert"
MUTATING: Final = "kueue-mutating-webhook-configuration"
VALIDATING: Final = "kueue-validating-webhook-configuration"
CA_NAME: Final = "kueue-ca"
"""The rotator checks its CA for this DNS name (cert-controller's CAName in Kueue)."""
ROLLOUT_SET_FRAMEWORK: Final = "RolloutSet.v1alpha1.checkpoint.rollout.dev"
CONVERTED_CRDS: Final = (
    "localqueues.kueue.x-k8s.io",
    "clusterqueues.kueue.x-k8s.io",
    "workloads.kueue.x-k8s.io",
    "cohorts.kueue.x-k8s.io",
    "multikueueclusters.kueue.x-k8s.io",
)
"""The CRDs Kueue's own kustomization gives a conversion webhook (and whose caBundle the
rotator injects; it fails on a CRD without one)."""
WEBHOOK_PATH_PARTS: Final = ("kueue-x-k8s-io", "batch-v1-job")
"""Admission webhooks registered: Kueue's own kinds and the `batch/job` integration."""
_VALIDITY: Final = datetime.timedelta(days=365)
"""Beyond the rotator's 90-day lookahead, else it would replace the certificates."""

Progress = Callable[[str], None]


def kueue_dir() -> Path:
    """The built Kueue (bin/kueue, crds/, webhook.yaml): `$DEVCLUSTER_KUEUE` or `.bin/kueue`."""
    override = os.environ.get("DEVCLUSTER_KUEUE")
    return Path(override) if override else REPO_ROOT / ".bin" / "kueue"


def find_kueue() -> Path:
    folder = kueue_dir()
    binary = folder / "bin" / "kueue"
    if not (binary.is_file() and os.access(binary, os.X_OK) and (folder / "crds").is_dir()):
        raise DevclusterError(
            f"Kueue is not built in {folder}: run `make kueue-binaries` (the first build takes "
            "minutes) or point DEVCLUSTER_KUEUE at a folder that holds bin/kueue and crds/"
        )
    return folder


# --- certificates -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Certs:
    ca_pem: bytes
    ca_key_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def _rsa_pem(key: rsa.RSAPrivateKey) -> bytes:
    # PKCS#1: the rotator parses the CA key with x509.ParsePKCS1PrivateKey.
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _certificates() -> _Certs:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(CA_NAME)]), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=False,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    dns = f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc"
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(dns), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return _Certs(ca.public_bytes(pem), _rsa_pem(ca_key), cert.public_bytes(pem), _rsa_pem(key))


# --- manifests ----------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def crds(folder: Path, webhook_port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """The module's CRDs; those Kueue converts get its conversion webhook on loopback (as the
    module's own kustomization patches them, with a URL instead of the Service)."""
    out = []
    for path in sorted((folder / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text(encoding="utf-8"))
        if crd["metadata"]["name"] in CONVERTED_CRDS:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{webhook_port}/convert",
                        "caBundle": _b64(ca_pem),
                    },
                    "conversionReviewVersions": ["v1"],
                },
            }
        out.append(crd)
    return out


def webhooks(folder: Path, webhook_port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """Kueue's admission webhooks for its own kinds and Jobs, as URL webhooks on loopback."""
    out = []
    names = {"MutatingWebhookConfiguration": MUTATING, "ValidatingWebhookConfiguration": VALIDATING}
    for doc in yaml.safe_load_all((folder / "webhook.yaml").read_text(encoding="utf-8")):
        if not doc or doc.get("kind") not in names:
            continue
        kept = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            if any(part in path for part in WEBHOOK_PATH_PARTS):
                hook["clientConfig"] = {
                    "url": f"https://127.0.0.1:{webhook_port}{path}",
                    "caBundle": _b64(ca_pem),
                }
                kept.append(hook)
        out.append(
            {
                "apiVersion": doc["apiVersion"],
                "kind": doc["kind"],
                "metadata": {"name": names[doc["kind"]]},
                "webhooks": kept,
            }
        )
    return out


def configuration(
    webhook_port: int,
    health_port: int,
    cert_dir: Path,
    frameworks: Sequence[str],
    external_frameworks: Sequence[str],
) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": WEBHOOK_SERVICE,
            "webhookSecretName": WEBHOOK_SECRET,
        },
        "integrations": {
            "frameworks": list(frameworks),
            "externalFrameworks": list(external_frameworks),
        },
    }


# --- the controller -----------------------------------------------------------------------------


@dataclass
class Kueue:
    """A running Kueue controller manager of one devcluster."""

    cluster: Cluster
    pid: int
    log: Path
    webhook_port: int
    health_port: int

    def alive(self) -> bool:
        return is_alive(self.pid)

    def stop(self, grace_seconds: float = 10.0) -> None:
        """Stop the controller and remove its admission webhooks (with the controller gone they
        would refuse every Job and Kueue object); the CRDs and their objects stay."""
        stop_groups([self.pid], grace_seconds)
        self.cluster.kubectl(
            "delete",
            "mutatingwebhookconfiguration",
            MUTATING,
            "--ignore-not-found",
            check=False,
        )
        self.cluster.kubectl(
            "delete",
            "validatingwebhookconfiguration",
            VALIDATING,
            "--ignore-not-found",
            check=False,
        )


def _apply(cluster: Cluster, objects: list[dict[str, Any]], timeout: float) -> None:
    # Server-side: the Workload CRD is far larger than the annotation client-side apply writes.
    cluster.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=devcluster",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
        timeout=timeout,
    )


def apply_crds(cluster: Cluster, timeout: float = 60.0) -> None:
    """Only Kueue's CRDs (no controller, no webhooks): enough for the operator to watch, create
    and patch Workloads, as the RBAC tests need (tests/e2e/conftest.py `crds`)."""
    folder = find_kueue()
    docs = [
        yaml.safe_load(path.read_text(encoding="utf-8"))
        for path in sorted((folder / "crds").glob("*.yaml"))
    ]
    _apply(cluster, docs, timeout)
    names = [f"crd/{doc['metadata']['name']}" for doc in docs]
    established = (
        '{range .items[*]}{.status.conditions[?(@.type=="Established")].status}{"\\n"}{end}'
    )

    # Polled, not `kubectl wait`: on a CRD whose status has no conditions yet that fails at once.
    def all_established() -> bool:
        shown = cluster.kubectl("get", *names, "-o", f"jsonpath={established}", check=False)
        return shown.returncode == 0 and shown.stdout.split() == ["True"] * len(names)

    wait_for_sync(all_established, timeout, "Kueue's CRDs Established", interval=0.2)


def _ready(health_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _webhook_serves(cluster: Cluster) -> bool:
    probe = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": "devcluster-webhook-probe"},
    }
    result = cluster.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False
    )
    return result.returncode == 0


def start(
    cluster: Cluster,
    *,
    frameworks: Sequence[str] = ("batch/job",),
    external_frameworks: Sequence[str] = (ROLLOUT_SET_FRAMEWORK,),
    timeout: float = 90.0,
    progress: Progress | None = None,
) -> Kueue:
    """Install Kueue's CRDs and webhooks into `cluster` and start its controller (see the
    module docstring); returns once the API server reaches its webhooks."""
    say = progress or (lambda _message: None)
    folder = find_kueue()
    deadline = time.monotonic() + timeout
    work = cluster.dir / "kueue"
    cert_dir = work / "certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    taken: set[int] = set()
    webhook_port, health_port = pick_free(taken), pick_free(taken)
    certs = _certificates()
    # What a pod would find where its Secret volume is mounted: the rotator only checks that the
    # files are there (it never writes them), and the webhook server serves them.
    for file, data in (("tls.crt", certs.cert_pem), ("tls.key", certs.key_pem)):
        path = cert_dir / file
        path.write_bytes(data)
        path.chmod(0o600)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": WEBHOOK_SECRET, "namespace": NAMESPACE},
        "type": "Opaque",
        "data": {
            "ca.crt": _b64(certs.ca_pem),
            "ca.key": _b64(certs.ca_key_pem),
            "tls.crt": _b64(certs.cert_pem),
            "tls.key": _b64(certs.key_pem),
        },
    }
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    _apply(cluster, [namespace, secret], timeout)
    _apply(cluster, crds(folder, webhook_port, certs.ca_pem), timeout)
    _apply(cluster, webhooks(folder, webhook_port, certs.ca_pem), timeout)
    config = work / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            configuration(webhook_port, health_port, cert_dir, frameworks, external_frameworks)
        ),
        encoding="utf-8",
    )
    state = read_state(cluster.layout.state_file)
    if state is None:
        raise DevclusterError(f"no devcluster state in {cluster.dir}")
    log = cluster.layout.log("kueue")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KUBE")},
        "KUBECONFIG": str(cluster.kubeconfig),
        MARKER_ENV: state.cluster_id,
    }
    argv: list[str | Path] = [
        folder / "bin" / "kueue",
        f"--config={config}",
        "--feature-gates=VisibilityOnDemand=false",
    ]
    child = spawn(argv, log, env, cwd=work)
    record = ProcessRecord(name="kueue", pid=child.pid, log=log)
    write_state(
        cluster.layout.state_file,
        state.model_copy(update={"processes": [*state.processes, record]}),
    )
    say(f"kueue started (pid {child.pid}, log {log})")
    running = Kueue(cluster, child.pid, log, webhook_port, health_port)

    def serving() -> bool:
        if child.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            raise DevclusterError(f"kueue exited with code {child.returncode}:\n{tail}")
        return _ready(health_port) and _webhook_serves(cluster)

    try:
        wait_for_sync(
            serving, max(1.0, deadline - time.monotonic()), "Kueue's webhooks", interval=0.3
        )
    except BaseException:
        running.stop(grace_seconds=2.0)
        raise
    say(f"kueue ready: webhooks on https://127.0.0.1:{webhook_port}")
    return running
