"""The fake network in front of the real S3 server: what it forwards is the server's answer, and
each fault it is told to make reaches the client as a bucket's failure would.

The object-storage fault tests (a bucket slow, answering 500 or 503, full, unreachable) rely on it,
so it is checked here on its own: healthy it is invisible (signatures, 412, listing survive the
relay), and each fault is met by exactly the requests it names, then gone after `heal`.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING

import obstore
import pytest
from obstore.exceptions import AlreadyExistsError, GenericError
from testsupport.fake_network import (
    INSUFFICIENT_STORAGE,
    QUOTA_EXCEEDED,
    SERVER_ERROR,
    SLOW_DOWN,
    FakeNetwork,
    S3Error,
)
from testsupport.s3_server import S3Bucket

from devcluster.waiting import wait_for_sync

if TYPE_CHECKING:  # obstore declares it for type checkers only
    from obstore.store import RetryConfig

NO_RETRIES: RetryConfig = {"max_retries": 0, "retry_timeout": timedelta(seconds=5)}


def _keys(store: obstore.store.S3Store) -> list[str]:
    return sorted(meta["path"] for batch in obstore.list(store) for meta in batch)


def test_a_healthy_network_relays_the_server_unchanged(
    s3_bucket: S3Bucket, s3_network: FakeNetwork
) -> None:
    store = s3_bucket.through(s3_network).store("p")
    obstore.put(store, "a/manifest.json", b"first", mode="create")
    with pytest.raises(AlreadyExistsError, match="412"):
        obstore.put(store, "a/manifest.json", b"second", mode="create")
    obstore.put(store, "a/records.jsonl", b"x" * 100_000)

    assert _keys(store) == ["a/manifest.json", "a/records.jsonl"]
    assert obstore.head(store, "a/records.jsonl")["size"] == 100_000
    obstore.delete(store, ["a/manifest.json", "a/records.jsonl"])
    assert _keys(s3_bucket.store("p")) == []
    assert s3_network.seen
    assert all(seen.fault is None for seen in s3_network.seen)


def test_one_slow_down_is_retried_by_the_client(
    s3_bucket: S3Bucket, s3_network: FakeNetwork
) -> None:
    s3_network.fail(SLOW_DOWN, methods={"PUT"}, times=1)
    store = s3_bucket.through(s3_network).store()

    obstore.put(store, "key", b"data")

    assert len(s3_network.faulted("503 SlowDown")) == 1
    assert [seen.method for seen in s3_network.seen] == ["PUT", "PUT"]
    assert bytes(obstore.get(s3_bucket.store(), "key").bytes()) == b"data"


@pytest.mark.parametrize(
    "error", [SERVER_ERROR, SLOW_DOWN, INSUFFICIENT_STORAGE, QUOTA_EXCEEDED], ids=lambda e: e.code
)
def test_an_error_reaches_the_client_until_healed(
    s3_bucket: S3Bucket, s3_network: FakeNetwork, error: S3Error
) -> None:
    s3_network.fail(error, methods={"PUT"})
    store = s3_bucket.through(s3_network).store(retry_config=NO_RETRIES)
    obstore.put(s3_bucket.store(), "existing", b"old")

    with pytest.raises(Exception, match=rf"(?s){error.status}.*<Code>{error.code}</Code>"):
        obstore.put(store, "key", b"data")
    assert bytes(obstore.get(store, "existing").bytes()) == b"old"  # GET is not faulted

    s3_network.heal()
    obstore.put(store, "key", b"data")
    assert _keys(s3_bucket.store()) == ["existing", "key"]


def test_a_slow_network_delays_the_answer_past_the_clients_timeout(
    s3_bucket: S3Bucket, s3_network: FakeNetwork
) -> None:
    s3_network.slow(30.0, path_contains="slow-key")
    store = s3_bucket.through(s3_network).store(
        client_options={"timeout": timedelta(milliseconds=300)}, retry_config=NO_RETRIES
    )

    with pytest.raises(GenericError, match=r"(?i)timed? ?out"):
        obstore.put(store, "slow-key", b"data")
    obstore.put(store, "other-key", b"data")  # a request the fault does not name is on time

    assert len(s3_network.faulted("slow 30.0 s")) == 1
    assert _keys(s3_bucket.store()) == ["other-key"]


def test_a_dropped_connection_is_an_unreachable_bucket(
    s3_bucket: S3Bucket, s3_network: FakeNetwork
) -> None:
    s3_network.drop()
    store = s3_bucket.through(s3_network).store(retry_config=NO_RETRIES)

    with pytest.raises(GenericError):
        obstore.put(store, "key", b"data")
    assert s3_network.faulted("dropped")
    assert _keys(s3_bucket.store()) == []


def test_closing_the_network_ends_its_threads_and_delays(s3_bucket: S3Bucket) -> None:
    network = FakeNetwork(s3_bucket.server.endpoint).start()
    before = set(threading.enumerate())
    network.slow(600.0)
    store = s3_bucket.through(network).store(retry_config=NO_RETRIES)
    failures: list[Exception] = []

    def put() -> None:
        try:
            obstore.put(store, "key", b"data")
        except Exception as error:
            failures.append(error)

    client = threading.Thread(target=put)
    client.start()
    wait_for_sync(lambda: network.faulted("slow 600.0 s"), 10.0, "the request held by the delay")
    network.close()
    client.join(timeout=10.0)

    assert not client.is_alive()
    assert len(failures) == 1
    assert set(threading.enumerate()) - before == set()
