"""devcluster's Kueue wiring, without Kueue: the manifests it writes from a (tiny, made-up)
module folder, and certificates that Kueue's certificate rotator keeps (the rules it checks are
cert-controller's: a CA valid for the DNS name `kueue-ca`, a serving certificate for the
webhook Service's name, PKCS#1 keys). The real controller runs in tests/e2e/test_kueue.py."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from devcluster import kueue

pytestmark = pytest.mark.unit

WEBHOOKS = """
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: mutating-webhook-configuration}
webhooks:
- name: mworkload.kb.io
  clientConfig:
    service: {name: webhook-service, path: /mutate-kueue-x-k8s-io-v1beta2-workload}
- name: mpod.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}}
- name: mjob.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate-batch-v1-job}}
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: validating-webhook-configuration}
webhooks:
- name: vclusterqueue.kb.io
  clientConfig:
    service: {name: webhook-service, path: /validate-kueue-x-k8s-io-v1beta2-clusterqueue}
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "crds").mkdir()
    for name in ("workloads.kueue.x-k8s.io", "resourceflavors.kueue.x-k8s.io"):
        crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition"}
        crd |= {"metadata": {"name": name}, "spec": {"group": "kueue.x-k8s.io"}}
        (tmp_path / "crds" / f"{name}.yaml").write_text(yaml.safe_dump(crd))
    (tmp_path / "webhook.yaml").write_text(WEBHOOKS)
    return tmp_path


def test_webhooks_are_kueues_own_and_jobs_on_loopback(folder: Path) -> None:
    configs = kueue.webhooks(folder, 9443, b"CA")
    by_kind = {c["kind"]: c for c in configs}
    mutating = by_kind["MutatingWebhookConfiguration"]
    assert mutating["metadata"]["name"] == kueue.MUTATING
    assert [h["name"] for h in mutating["webhooks"]] == ["mworkload.kb.io", "mjob.kb.io"]
    assert mutating["webhooks"][0]["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate-kueue-x-k8s-io-v1beta2-workload",
        "caBundle": "Q0E=",
    }
    assert by_kind["ValidatingWebhookConfiguration"]["metadata"]["name"] == kueue.VALIDATING


def test_converted_crds_get_a_loopback_conversion_webhook(folder: Path) -> None:
    crds = {c["metadata"]["name"]: c for c in kueue.crds(folder, 9443, b"CA")}
    conversion = crds["workloads.kueue.x-k8s.io"]["spec"]["conversion"]
    assert conversion["strategy"] == "Webhook"
    assert conversion["webhook"]["clientConfig"]["url"] == "https://127.0.0.1:9443/convert"
    assert "conversion" not in crds["resourceflavors.kueue.x-k8s.io"]["spec"]


def test_configuration_listens_on_loopback_only_and_registers_rolloutset(tmp_path: Path) -> None:
    config = kueue.configuration(9443, 8081, tmp_path, ["batch/job"], [kueue.ROLLOUT_SET_FRAMEWORK])
    assert config["health"]["healthProbeBindAddress"] == "127.0.0.1:8081"
    assert config["webhook"]["host"] == "127.0.0.1"
    assert config["metrics"]["bindAddress"] == "0"
    assert config["leaderElection"]["leaderElect"] is False
    assert config["integrations"]["externalFrameworks"] == [
        "RolloutSet.v1alpha1.checkpoint.rollout.dev"
    ]


def test_certificates_are_ones_the_rotator_keeps() -> None:
    certs = kueue._certificates()
    ca = x509.load_pem_x509_certificate(certs.ca_pem)
    cert = x509.load_pem_x509_certificate(certs.cert_pem)
    ca_names = ca.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ca_names.get_values_for_type(x509.DNSName) == [kueue.CA_NAME]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["kueue-webhook-service.kueue-system.svc"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usages
    assert cert.issuer == ca.subject
    # Beyond the rotator's 90-day lookahead, else it would replace them at once.
    lookahead = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=91)
    assert cert.not_valid_after_utc > lookahead
    assert ca.not_valid_after_utc > lookahead
    for key in (certs.ca_key_pem, certs.key_pem):
        assert key.startswith(b"-----BEGIN RSA PRIVATE KEY-----")  # PKCS#1
        serialization.load_pem_private_key(key, password=None)
