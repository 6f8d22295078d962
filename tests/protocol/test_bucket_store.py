"""Records in an S3-API bucket (`BucketStore`), against the real S3 server of `make s3-server`:
the key layout, the manifest created once and last, bounded and verified reads, publication,
removal of a set's own keys only, and the credentials read from the mounted Secret's folder.

The faults (an unreachable, slow, failing or full bucket, at commit and at restore) are in
tests/adversarial/test_bucket_faults.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import obstore
import pytest
from rollout_protocol import (
    BucketConfig,
    BucketError,
    BucketStore,
    CheckpointManifest,
    ControlConfigError,
    ControlSettings,
    PublishedParticipant,
    Record,
    RecordsInvalid,
    RecordsMissing,
    Role,
    bucket_from_env,
    encode_record,
)
from rollout_protocol import _records_cli as records_cli
from testsupport.s3_server import S3Bucket

SET_DIR = "team/train/uid-1"
PREFIX = "ckpts/run"


def _records(*rollouts: str, data: str = "x") -> list[Record]:
    return [
        Record(kind="boundary", rollout_id=rollout, attempt=0, data={"d": data})
        for rollout in rollouts
    ]


def _config(bucket: S3Bucket, folder: Path, prefix: str = PREFIX) -> BucketConfig:
    return BucketConfig(
        endpoint=bucket.endpoint,
        bucket=bucket.name,
        credentials_dir=bucket.write_credentials(folder),
        prefix=prefix,
    )


def _store(bucket: S3Bucket, folder: Path, prefix: str = PREFIX) -> BucketStore:
    return BucketStore(_config(bucket, folder, prefix), deadline_ts=time.time() + 20)


def _write(
    store: BucketStore,
    checkpoint_id: str,
    records: list[Record],
    *,
    set_dir: str = SET_DIR,
    instance: str = "environment-0",
) -> None:
    store.write_records(
        set_dir,
        checkpoint_id,
        instance,
        role=Role.ENVIRONMENT,
        attempt=0,
        encoded=[encode_record(record) for record in records],
    )


def _keys(bucket: S3Bucket, prefix: str | None = None) -> list[str]:
    return sorted(meta["path"] for batch in obstore.list(bucket.store(), prefix) for meta in batch)


def test_records_then_manifest_under_the_key_layout_and_read_back(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    store = _store(s3_bucket, tmp_path / "creds")
    _write(store, "ck-1", _records("r1", "r2"))

    manifest, records = store.read_records(SET_DIR, "ck-1", "environment-0")

    base = f"{PREFIX}/{SET_DIR}/ck-1/environment-0/"
    assert _keys(s3_bucket) == [base + "manifest.json", base + manifest.records_file]
    assert [record.rollout_id for record in records] == ["r1", "r2"]
    assert manifest.record_count == 2
    assert store.read_manifest(f"{SET_DIR}/ck-1/environment-0/manifest.json") == manifest


def test_a_manifest_is_never_replaced_and_a_retry_finds_its_own(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    store = _store(s3_bucket, tmp_path / "creds")
    _write(store, "ck-1", _records("r1"))
    key = f"{PREFIX}/{SET_DIR}/ck-1/environment-0/manifest.json"
    before = bytes(obstore.get(s3_bucket.store(), key).bytes())

    _write(store, "ck-1", _records("r1"))  # the same records again: a retry, a no-op
    with pytest.raises(BucketError, match="refusing to replace a different manifest") as refused:
        _write(store, "ck-1", _records("r1", "r2"))

    assert refused.value.reason == "refused"
    assert bytes(obstore.get(s3_bucket.store(), key).bytes()) == before
    _, records = store.read_records(SET_DIR, "ck-1", "environment-0")
    assert [record.rollout_id for record in records] == ["r1"]


def test_reads_are_bounded_by_the_manifest_and_verified_before_returning(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    store = _store(s3_bucket, tmp_path / "creds")
    _write(store, "ck-1", _records("r1", "r2"))
    manifest, _ = store.read_records(SET_DIR, "ck-1", "environment-0")
    key = f"{PREFIX}/{SET_DIR}/ck-1/environment-0/{manifest.records_file}"
    raw = bytes(obstore.get(s3_bucket.store(), key).bytes())

    # larger than the manifest says: refused on its size, before its body is read
    obstore.put(s3_bucket.store(), key, raw + b"x" * (8 << 20))
    with pytest.raises(RecordsInvalid, match=f"has {len(raw) + (8 << 20)} bytes"):
        store.read_records(SET_DIR, "ck-1", "environment-0")

    # the declared size, other bytes: refused on its digest
    obstore.put(s3_bucket.store(), key, raw.replace(b'"x"', b'"y"'))
    with pytest.raises(RecordsInvalid, match="has sha256"):
        store.read_records(SET_DIR, "ck-1", "environment-0")

    # a huge manifest is not read whole
    manifest_key = f"{PREFIX}/{SET_DIR}/ck-2/environment-0/manifest.json"
    obstore.put(s3_bucket.store(), manifest_key, b"{" * (1 << 20))
    with pytest.raises(RecordsInvalid, match="larger than"):
        store.read_records(SET_DIR, "ck-2", "environment-0")


def test_only_a_missing_manifest_is_a_missing_checkpoint(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    store = _store(s3_bucket, tmp_path / "creds")
    with pytest.raises(RecordsMissing, match="no manifest at team/train/uid-1/ck-9/"):
        store.read_records(SET_DIR, "ck-9", "environment-0")

    no_bucket = BucketStore(
        BucketConfig(
            endpoint=s3_bucket.endpoint,
            bucket="no-such-bucket-here",
            credentials_dir=tmp_path / "creds",
        ),
        deadline_ts=time.time() + 20,
    )
    with pytest.raises(BucketError) as refused:
        no_bucket.read_records(SET_DIR, "ck-9", "environment-0")
    assert not isinstance(refused.value, RecordsMissing)
    assert refused.value.reason == "no_bucket"
    assert "NoSuchBucket" in str(refused.value)


def test_publish_creates_checkpoint_json_once_and_lists_published_checkpoints(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    store = _store(s3_bucket, tmp_path / "creds")
    set_name = "train"  # without an operator, the set's directory is its name
    _write(store, "ck-1", _records("r1"), set_dir=set_name)
    _write(store, "ck-2", _records("r1"), set_dir=set_name)  # committed, never published
    manifest, _ = store.read_records(set_name, "ck-1", "environment-0")
    published = CheckpointManifest(
        set_name=set_name,
        checkpoint_id="ck-1",
        attempt=0,
        published_ts=1.0,
        rollout_ids=["r1"],
        participants=[
            PublishedParticipant(
                instance="environment-0",
                role=Role.ENVIRONMENT,
                manifest_path=f"{set_name}/ck-1/environment-0/manifest.json",
                records_sha256=manifest.records_sha256,
                record_count=1,
                bytes=manifest.bytes,
            )
        ],
    )

    where = store.write_checkpoint_manifest(published)
    assert where == f"s3://{s3_bucket.name}/{PREFIX}/{set_name}/ck-1/checkpoint.json"
    assert store.write_checkpoint_manifest(published) == where  # identical again: a no-op
    with pytest.raises(BucketError, match="refusing to replace a different checkpoint manifest"):
        store.write_checkpoint_manifest(published.model_copy(update={"published_ts": 2.0}))

    assert store.read_checkpoint_manifest(set_name, "ck-1") == published
    assert store.published_checkpoints(set_name) == [published]
    with pytest.raises(RecordsInvalid, match="was never published"):
        store.read_checkpoint_manifest(set_name, "ck-2")


def test_removal_takes_only_the_sets_own_keys_never_a_prefix_sharing_neighbours(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    """Two sets whose names are prefixes of each other (`train` and `train2`), and two
    checkpoints likewise (`ck-1`, `ck-10`): removing one never takes a key of the other."""
    store = _store(s3_bucket, tmp_path / "creds")
    other_set = "team/train2/uid-1"
    for set_dir in (SET_DIR, other_set):
        for checkpoint_id in ("ck-1", "ck-10"):
            _write(store, checkpoint_id, _records("r1"), set_dir=set_dir)
    stranger = f"{PREFIX}/{SET_DIR}/ck-1/notes.txt"
    obstore.put(s3_bucket.store(), stranger, b"not the protocol's")
    others = _keys(s3_bucket, f"{PREFIX}/{other_set}/")
    sibling = _keys(s3_bucket, f"{PREFIX}/{SET_DIR}/ck-10/")

    reply = store.remove_records(SET_DIR, ["ck-1", "ck-3"])

    assert reply.removed == ["ck-1"]
    assert reply.absent == ["ck-3"]
    assert reply.kept == [f"{SET_DIR}/ck-1/notes.txt"]
    assert _keys(s3_bucket, f"{PREFIX}/{SET_DIR}/ck-1/") == [stranger]
    assert _keys(s3_bucket, f"{PREFIX}/{SET_DIR}/ck-10/") == sibling
    assert _keys(s3_bucket, f"{PREFIX}/{other_set}/") == others

    whole = store.remove_records(SET_DIR, [], whole_set=True)

    assert whole.removed == [SET_DIR]
    assert whole.kept_count == 1
    assert _keys(s3_bucket, f"{PREFIX}/{SET_DIR}/") == [stranger]
    assert _keys(s3_bucket, f"{PREFIX}/{other_set}/") == others


def test_wrong_credentials_name_the_folder_never_the_secret_and_rotation_is_picked_up(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    folder = tmp_path / "creds"
    store = _store(s3_bucket, folder)
    (folder / "secretAccessKey").write_text("not-the-secret-at-all")

    with pytest.raises(BucketError) as refused:
        _write(store, "ck-1", _records("r1"))

    message = str(refused.value)
    assert refused.value.reason == "credentials"
    assert f"check the credentials in {folder}" in message
    assert "SignatureDoesNotMatch" in message
    assert s3_bucket.credentials.access_key_id not in message
    assert "not-the-secret-at-all" not in message
    assert s3_bucket.credentials.secret_access_key not in message
    assert _keys(s3_bucket) == []

    (folder / "secretAccessKey").unlink()
    with pytest.raises(BucketError, match=f"{folder}/secretAccessKey is missing"):
        _write(store, "ck-1", _records("r1"))

    s3_bucket.write_credentials(folder)
    (folder / "sessionToken").write_text("a-token-from-another-session\n")
    with pytest.raises(BucketError, match="InvalidToken") as expired:
        _write(store, "ck-1", _records("r1"))  # the optional token is read and sent
    assert expired.value.reason == "credentials"
    assert "a-token-from-another-session" not in str(expired.value)

    (folder / "sessionToken").unlink()  # the Secret rotated back: the next call reads it
    _write(store, "ck-1", _records("r1"))
    assert store.read_records(SET_DIR, "ck-1", "environment-0")[1][0].rollout_id == "r1"


def test_the_bucket_settings_come_from_the_environment_with_errors_naming_the_variable(
    tmp_path: Path,
) -> None:
    env = {
        "ROLLOUT_STORAGE_S3_ENDPOINT": "http://127.0.0.1:9000",
        "ROLLOUT_STORAGE_S3_BUCKET": "records",
        "ROLLOUT_STORAGE_S3_CREDENTIALS_DIR": str(tmp_path),
    }
    config = bucket_from_env(env)
    assert config == BucketConfig(
        endpoint="http://127.0.0.1:9000", bucket="records", credentials_dir=tmp_path
    )
    assert config.region == "us-east-1"
    assert config.addressing == "path"
    assert bucket_from_env({}) is None

    bad = {
        "ROLLOUT_STORAGE_S3_ENDPOINT": "ftp://host",
        "ROLLOUT_STORAGE_S3_BUCKET": "Records_",
        "ROLLOUT_STORAGE_S3_PREFIX": "/a//b",
        "ROLLOUT_STORAGE_S3_ADDRESSING": "dns",
        "ROLLOUT_STORAGE_S3_CREDENTIALS_DIR": "relative/dir",
    }
    for name, value in bad.items():
        with pytest.raises(ControlConfigError, match=name):
            bucket_from_env({**env, name: value})
    with pytest.raises(ControlConfigError, match="ROLLOUT_STORAGE_S3_BUCKET"):
        bucket_from_env({k: v for k, v in env.items() if k != "ROLLOUT_STORAGE_S3_BUCKET"})
    with pytest.raises(ControlConfigError, match="not both"):
        ControlSettings.from_env(
            Role.ENVIRONMENT,
            allow_unauthenticated=True,
            environ={**env, "ROLLOUT_CHECKPOINT_ROOT": str(tmp_path)},
        )


def test_rollout_records_removes_from_the_bucket_of_its_environment(
    s3_bucket: S3Bucket,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`rollout-records remove` without `--root`, as a cleanup pod of a bucket set runs it."""
    folder = tmp_path / "creds"
    store = _store(s3_bucket, folder)
    _write(store, "ck-1", _records("r1"))
    args = ["remove", "--set-dir", SET_DIR, "--checkpoint", "ck-1"]

    assert records_cli.main(args) == 2, "neither --root nor a bucket: a usage error"
    assert "give --root (a volume) or set the ROLLOUT_STORAGE_S3_*" in capsys.readouterr().err

    for name, value in s3_bucket.env(folder, prefix=PREFIX).items():
        monkeypatch.setenv(name, value)
    (folder / "secretAccessKey").write_text("a-wrong-secret")
    assert records_cli.main(args) == 1
    refused = capsys.readouterr()
    assert f"check the credentials in {folder}" in refused.err
    assert "a-wrong-secret" not in refused.err + refused.out
    assert s3_bucket.credentials.access_key_id not in refused.err + refused.out

    s3_bucket.write_credentials(folder)
    assert records_cli.main(args) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == ["ck-1"]
    assert _keys(s3_bucket) == []
