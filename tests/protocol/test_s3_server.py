"""The S3 server the object-storage tests run against, spoken to with `obstore` as the SDK does.

What a set's records in a bucket rely on (docs/install.md, "Records in a bucket"): a conditional
create (`If-None-Match: *`) that refuses a second create of the same key with 412, ListObjectsV2
under a prefix, DeleteObject and DeleteObjects, path-style addressing and a static key whose
secret is checked. A server that quietly replaced the object would let two writers both believe
they published a manifest, so this is checked against the real server, not assumed.
"""

from __future__ import annotations

import base64
from pathlib import Path

import obstore
import pytest
from obstore.exceptions import AlreadyExistsError, GenericError, PermissionDeniedError
from testsupport.s3_server import S3Bucket, requests_logged, s3_store

from devcluster import s3
from devcluster.errors import DevclusterError
from devcluster.procs import is_alive
from devcluster.s3 import S3Credentials, S3Server


def _keys(store: obstore.store.S3Store, prefix: str | None = None) -> list[str]:
    return sorted(meta["path"] for batch in obstore.list(store, prefix) for meta in batch)


def test_conditional_create_refuses_a_second_create(s3_bucket: S3Bucket) -> None:
    store = s3_bucket.store("ns/set/uid")
    obstore.put(store, "ckpt-1/manifest.json", b"first", mode="create")

    with pytest.raises(AlreadyExistsError) as refused:
        obstore.put(store, "ckpt-1/manifest.json", b"second", mode="create")

    assert "412 Precondition Failed" in str(refused.value)
    assert bytes(obstore.get(store, "ckpt-1/manifest.json").bytes()) == b"first"


def test_listing_under_a_prefix_and_deletion(s3_bucket: S3Bucket) -> None:
    store = s3_bucket.store("prefix")
    own = [f"ns/a/uid/ckpt-{i}/agent-0/records-{i}.jsonl" for i in range(3)]
    other = "ns/ab/uid/ckpt-0/agent-0/records-0.jsonl"
    for key in [*own, other]:
        obstore.put(store, key, key.encode())

    assert _keys(store, "ns/a/") == own
    assert _keys(store) == sorted([*own, other])

    obstore.delete(store, own[:2])  # DeleteObjects
    obstore.delete(store, own[2])  # DeleteObject
    assert _keys(store) == [other]
    with pytest.raises(FileNotFoundError):
        obstore.get(store, own[0])


def test_a_wrong_secret_is_refused(s3_bucket: S3Bucket) -> None:
    wrong = S3Credentials(s3_bucket.credentials.access_key_id, "not-the-secret")
    store = s3_store(s3_bucket.endpoint, s3_bucket.name, wrong)

    with pytest.raises(PermissionDeniedError, match="403 Forbidden"):
        obstore.put(store, "key", b"data")
    assert _keys(s3_bucket.store()) == []


def test_a_removed_bucket_is_gone(s3_server: S3Server) -> None:
    s3_server.create_bucket("removed-bucket")
    store = s3_store(s3_server.endpoint, "removed-bucket", s3_server.credentials)
    obstore.put(store, "key", b"data")

    s3_server.remove_bucket("removed-bucket")

    with pytest.raises(GenericError, match="NoSuchBucket"):
        _keys(store)


def test_a_launcher_runs_the_server_listening_on_the_host_given(tmp_path: Path) -> None:
    # 127.0.0.2 is loopback too, but not where the server listens by default: the endpoint and
    # the health check `start` waits on follow the host. `env` stands for `nsenter --net=...`
    # (tests/kind/conftest.py): a launcher that execs the server in its own process.
    server = s3.start(
        tmp_path / "data",
        tmp_path / "s3.log",
        host="127.0.0.2",
        launcher=("env",),
        access_log=tmp_path / "access.log",
    )
    try:
        assert server.endpoint == f"http://127.0.0.2:{server.port}"
        assert Path(f"/proc/{server.pid}/exe").resolve() == s3.find_s3_server().resolve()
        server.create_bucket("launched")
        store = s3_store(server.endpoint, "launched", server.credentials)
        obstore.put(store, "key", b"data", mode="create")
        assert bytes(obstore.get(store, "key").bytes()) == b"data"
    finally:
        server.stop()
    assert not is_alive(server.pid)
    # One line per request, naming the bucket, the caller's address, the operation and the key.
    logged = requests_logged(tmp_path / "access.log")
    assert [(r.bucket, r.operation, r.key, r.status) for r in logged] == [
        ("launched", "s3_PutObject", "key", 200),
        ("launched", "s3_GetObject", "key", 200),
    ]
    assert all(r.remote.startswith("127.") for r in logged), logged


def test_a_host_that_is_not_an_address_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DevclusterError, match="must be an IP address"):
        s3.start(tmp_path / "data", tmp_path / "s3.log", host="localhost")
    assert not (tmp_path / "data").exists()


def test_credentials_as_a_secret_and_back_from_its_files(tmp_path: Path) -> None:
    credentials = S3Credentials.generate()
    assert S3Credentials.read(credentials.write(tmp_path / "files")) == credentials
    secret = credentials.secret("team-a", "bucket-creds")
    assert secret["metadata"] == {"name": "bucket-creds", "namespace": "team-a"}
    decoded = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    assert decoded == {
        "accessKeyId": credentials.access_key_id,
        "secretAccessKey": credentials.secret_access_key,
    }
