"""Failure-mode class 1 (docs/operations.md#failure-modes) on a real API server: storage paths that
cannot be right are refused by the CRD's CEL rule with the same message as the models
(`api.RULE_STORAGE_PATH`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollout_operator.model import api
from shared import BAD_PATHS, set_object

from devcluster.cluster import Cluster
from harness.objects import apply_crds

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> Cluster:
    apply_crds(cluster)
    return cluster


def _create(cluster: Cluster, namespace: str, path: str) -> tuple[int, str]:
    obj = set_object(namespace, "unused", Path("/srv/ckpt"))
    del obj["metadata"]["uid"], obj["metadata"]["generation"], obj["status"]
    obj["spec"]["storage"]["path"] = path
    done = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(obj), check=False)
    return done.returncode, done.stderr


@pytest.mark.parametrize("path", list(BAD_PATHS.values()), ids=list(BAD_PATHS))
def test_the_api_server_refuses_storage_paths_that_cannot_be_right(
    crds: Cluster, namespace: str, path: str
) -> None:
    code, stderr = _create(crds, namespace, path)
    assert code != 0, f"the API server accepted storage.path {path!r}"
    assert api.RULE_STORAGE_PATH.message in stderr, stderr


def test_the_api_server_accepts_a_storage_folder_of_its_own(crds: Cluster, namespace: str) -> None:
    code, stderr = _create(crds, namespace, "/checkpoints")
    assert code == 0, stderr
