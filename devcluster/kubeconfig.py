"""Kubeconfig files with the credentials embedded, so a copied file keeps working."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import yaml

from devcluster.pki import CertPair

CONTEXT = "devcluster"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write(path: Path, server: str, ca: Path, client: CertPair, user: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CONTEXT,
                "cluster": {"server": server, "certificate-authority-data": _b64(ca)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(client.cert),
                    "client-key-data": _b64(client.key),
                },
            }
        ],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user}}],
        "current-context": CONTEXT,
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config, handle, sort_keys=False)
