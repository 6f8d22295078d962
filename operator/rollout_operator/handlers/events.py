"""Kubernetes Events about a RolloutSet, posted from flows that hold its parsed model.

Kopf's `event()` needs only the object reference (apiVersion, kind, name, namespace, uid), so
the flows' models give it one instead of re-reading the object.
"""

from __future__ import annotations

from typing import cast

import kopf

from ..model.api import RolloutSet


def post_set_event(rset: RolloutSet, reason: str, message: str, *, warning: bool) -> None:
    reference = {
        "apiVersion": rset.api_version,
        "kind": rset.kind,
        "metadata": {
            "name": rset.metadata.name,
            "namespace": rset.metadata.namespace,
            "uid": rset.metadata.uid,
        },
    }
    kind = "Warning" if warning else "Normal"
    kopf.event(cast(kopf.Body, reference), type=kind, reason=reason, message=message)
