"""The S3 server the object-storage tests run against, spoken to with `obstore` as the SDK does.

What a set's records in a bucket rely on (docs/install.md, "Records in a bucket"): a conditional
create (`If-None-Match: *`) that refuses a second create of the same key with 412, ListObjectsV2
under a prefix, DeleteObject and DeleteObjects, path-style addressing and a static key whose
secret is checked. A server that quietly replaced the object would let two writers both believe
they published a manifest, so this is checked against the real server, not assumed.
"""

from __future__ import annotations

import obstore
import pytest
from obstore.exceptions import AlreadyExistsError, GenericError, PermissionDeniedError
from testsupport.s3_server import S3Bucket, s3_store

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
