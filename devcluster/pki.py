"""The cluster's PKI, generated fresh by every `up` with the `cryptography` package.

Certificates use ECDSA P-256 (instant to generate); the service-account signing key is RSA 2048,
the key type every Kubernetes component and client library accepts for service-account tokens.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=365)
_SKEW = datetime.timedelta(hours=1)  # tolerate clocks a little behind

APISERVER_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
APISERVER_IPS = ("127.0.0.1", "10.0.0.1")
AGENT_USER = "devcluster-node-agent"


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """Paths of the generated files; see `generate` for who uses which."""

    ca: CertPair
    apiserver: CertPair
    serving: CertPair
    admin: CertPair
    controller_manager: CertPair
    scheduler: CertPair
    agent: CertPair
    service_account_key: Path
    service_account_pub: Path
    kubelet_client: CertPair
    """The API server's client certificate towards kubelets (`kubectl logs/exec` on a real node)."""
    node: NodeCerts | None = None
    """The container node's identities; None on the process node."""


@dataclass(frozen=True)
class NodeCerts:
    """A real kubelet's and kube-proxy's credentials: the kubelet authenticates as
    `system:node:<name>` in `system:nodes` (the Node authorizer and NodeRestriction apply to it as
    on any cluster) and serves with a certificate for its node IP; kube-proxy is
    `system:kube-proxy` (RBAC's default `system:node-proxier` binding)."""

    kubelet: CertPair
    kubelet_serving: CertPair
    kube_proxy: CertPair


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


class _Authority:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        subject = _name("devcluster-ca")
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        self.pair = self._save("ca", self.cert, self.key)

    def _save(self, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> CertPair:
        pair = CertPair(self.folder / f"{stem}.crt", self.folder / f"{stem}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(pair.key, key)
        return pair

    def issue(
        self,
        stem: str,
        common_name: str,
        organization: str | None = None,
        dns_names: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        client: bool = False,
        server: bool = False,
    ) -> CertPair:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usages = []
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organization))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if dns_names or ips:
            names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
            names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return self._save(stem, builder.sign(self.key, hashes.SHA256()), key)


def generate(
    folder: Path,
    apiserver_ips: tuple[str, ...] = (),
    node: tuple[str, str] | None = None,
) -> Pki:
    """Writes a CA and every certificate the cluster needs into `folder`.

    The agent authenticates in `system:masters`: it plays the kubelet of several nodes at once,
    and the Node authorizer would need one identity per node (and NodeRestriction would refuse
    cross-node writes), which buys no test fidelity for this project. The controller-manager is
    in `system:masters` too, because it runs all controllers under its own identity (see
    `--use-service-account-credentials` in controlplane.py). Users and service accounts get
    nothing beyond RBAC's defaults: that is the authorization tests exercise.

    `apiserver_ips` are extra addresses the API server's certificate names (the container node
    reaches it on a veth address); `node` is the container node's (name, IP), for `NodeCerts`.
    """
    folder.mkdir(parents=True, exist_ok=True)
    ca = _Authority(folder)
    loopback = ("127.0.0.1",)
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sa_private = folder / "sa.key"
    sa_public = folder / "sa.pub"
    _write_key(sa_private, sa_key)
    sa_public.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return Pki(
        ca=ca.pair,
        apiserver=ca.issue(
            "apiserver",
            "kube-apiserver",
            dns_names=APISERVER_DNS_NAMES,
            ips=APISERVER_IPS + apiserver_ips,
            server=True,
        ),
        serving=ca.issue(
            "serving", "devcluster-loopback", dns_names=("localhost",), ips=loopback, server=True
        ),
        admin=ca.issue("admin", "admin", "system:masters", client=True),
        controller_manager=ca.issue(
            "controller-manager", "system:kube-controller-manager", "system:masters", client=True
        ),
        scheduler=ca.issue("scheduler", "system:kube-scheduler", client=True),
        agent=ca.issue("agent", AGENT_USER, "system:masters", client=True),
        service_account_key=sa_private,
        service_account_pub=sa_public,
        kubelet_client=ca.issue(
            "apiserver-kubelet-client",
            "kube-apiserver-kubelet-client",
            "system:masters",
            client=True,
        ),
        node=None if node is None else _node_certs(ca, *node),
    )


def _node_certs(ca: _Authority, name: str, ip: str) -> NodeCerts:
    return NodeCerts(
        kubelet=ca.issue("kubelet", f"system:node:{name}", "system:nodes", client=True),
        kubelet_serving=ca.issue(
            "kubelet-serving", f"system:node:{name}", dns_names=(name,), ips=(ip,), server=True
        ),
        kube_proxy=ca.issue("kube-proxy", "system:kube-proxy", client=True),
    )


def ca_context(ca: Path) -> ssl.SSLContext:
    """A TLS client context trusting only the cluster CA (httpx takes contexts, not paths)."""
    return ssl.create_default_context(cafile=str(ca))
