"""devcluster's S3 server (`python -m devcluster up --s3`, `make demo S3=1`): started with the
cluster, a bucket in it, the credentials as the files a mounted Secret holds (and as that Secret in
the cluster), and stopped with its data removed by `down`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import obstore
import pytest
from testsupport.s3_server import s3_store

from devcluster import s3
from devcluster.cluster import Cluster
from devcluster.errors import DevclusterError
from devcluster.procs import is_alive
from devcluster.s3 import S3Credentials
from devcluster.state import read_state


def _devcluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devcluster", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ),
        check=False,
    )


def test_up_with_s3_serves_a_bucket_and_down_removes_it(tmp_path: Path) -> None:
    root = tmp_path / "with-s3"
    up = _devcluster("up", "--dir", str(root), "--node", "solo", "--s3-bucket", "records")
    try:
        assert up.returncode == 0, up.stderr
        state = read_state(root / "state.json")
        assert state is not None
        assert state.s3 is not None
        server = next(r for r in state.processes if r.name == "s3-server")
        files = state.s3.credentials_dir
        credentials = S3Credentials(
            (files / "accessKeyId").read_text(), (files / "secretAccessKey").read_text()
        )
        assert credentials.secret_access_key not in up.stderr + up.stdout
        assert oct((files / "secretAccessKey").stat().st_mode & 0o777) == "0o600"

        store = s3_store(state.s3.endpoint, "records", credentials, prefix="ns/set")
        obstore.put(store, "uid/manifest.json", b"{}", mode="create")
        assert [m["path"] for batch in obstore.list(store) for m in batch] == ["uid/manifest.json"]

        secret = s3.credentials_secret(state.s3, "default", "bucket-credentials")
        cluster = Cluster.attach(root)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(secret))
        stored = cluster.kubectl(
            "get", "secret", "bucket-credentials", "-o", "jsonpath={.data.accessKeyId}"
        )
        assert stored.stdout == secret["data"]["accessKeyId"]

        status = _devcluster("status", "--dir", str(root))
        assert f"{state.s3.endpoint} bucket records" in status.stdout
    finally:
        down = _devcluster("down", "--dir", str(root))

    assert down.returncode == 0, down.stderr
    assert not is_alive(server.pid)
    assert not (root / "s3").exists()


def test_an_s3_server_needs_a_cluster(tmp_path: Path) -> None:
    with pytest.raises(DevclusterError, match="no devcluster state"):
        s3.start_for_cluster(tmp_path / "nothing")
