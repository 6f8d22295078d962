"""Checkpoint storage: durable layout, create-once manifests, verification before use."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
from rollout_protocol import (
    CheckpointManifest,
    Manifest,
    PublishedParticipant,
    Record,
    Role,
)
from rollout_protocol import _storage as storage


def _records(count: int = 3) -> list[Record]:
    return [
        Record(kind="boundary", rollout_id=f"r{i}", attempt=0, data={"step": i, "text": "a\nb"})
        for i in range(count)
    ]


def _write(directory: Path, records: list[Record] | None = None) -> Manifest:
    return storage.write_records(
        directory,
        role=Role.ENVIRONMENT,
        instance="environment-0",
        checkpoint_id="ck-1",
        attempt=0,
        records=_records() if records is None else records,
    )


def _dir(root: Path) -> Path:
    return storage.checkpoint_dir(root, "demo", "ck-1", "environment-0")


def test_records_round_trip_with_digest_named_file_and_manifest(tmp_path: Path) -> None:
    directory = _dir(tmp_path)
    manifest = _write(directory)

    assert directory == tmp_path / "demo" / "ck-1" / "environment-0"
    assert manifest.records_file == f"records-{manifest.records_sha256}.jsonl"
    assert manifest.record_count == 3
    assert manifest.bytes == (directory / manifest.records_file).stat().st_size
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [manifest.records_file, storage.MANIFEST_NAME]
    ), "no temporary files may be left behind"
    on_disk = json.loads((directory / storage.MANIFEST_NAME).read_text())
    assert on_disk["records_sha256"] == manifest.records_sha256

    read_manifest, records = storage.read_records(directory, expect_checkpoint_id="ck-1")
    assert read_manifest == manifest
    assert records == _records()


def test_empty_records_still_get_a_manifest(tmp_path: Path) -> None:
    manifest = _write(_dir(tmp_path), [])
    assert manifest.record_count == 0
    assert storage.read_records(_dir(tmp_path), expect_checkpoint_id="ck-1") == (manifest, [])


def test_retry_with_same_records_is_idempotent(tmp_path: Path) -> None:
    first = _write(_dir(tmp_path))
    second = _write(_dir(tmp_path))
    assert first == second
    assert len(list(_dir(tmp_path).iterdir())) == 2


def test_existing_manifest_with_other_content_is_never_replaced(tmp_path: Path) -> None:
    first = _write(_dir(tmp_path))
    with pytest.raises(storage.StorageError, match="EEXIST"):
        _write(_dir(tmp_path), _records(5))
    assert storage.read_manifest(_dir(tmp_path)) == first


def test_flipped_byte_is_refused_naming_the_digest(tmp_path: Path) -> None:
    manifest = _write(_dir(tmp_path))
    path = _dir(tmp_path) / manifest.records_file
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(storage.RecordsInvalid, match="sha256"):
        storage.read_records(_dir(tmp_path), expect_checkpoint_id="ck-1")


def test_wrong_count_is_refused(tmp_path: Path) -> None:
    manifest = _write(_dir(tmp_path))
    tampered = manifest.model_copy(update={"record_count": 4})
    (_dir(tmp_path) / storage.MANIFEST_NAME).write_text(tampered.model_dump_json())
    with pytest.raises(storage.RecordsInvalid, match="holds 3 records, the manifest says 4"):
        storage.read_records(_dir(tmp_path), expect_checkpoint_id="ck-1")


def test_schema_violation_is_refused_naming_the_line(tmp_path: Path) -> None:
    directory = _dir(tmp_path)
    manifest = _write(directory, _records(2))
    # A consistent manifest over a bad line: only the schema check can catch it.
    bad = (directory / manifest.records_file).read_bytes() + b'{"kind": ""}\n'
    sha = storage.records_digest(hashlib.sha256(line).digest() for line in bad.splitlines())
    (directory / f"records-{sha}.jsonl").write_bytes(bad)
    forged = manifest.model_copy(
        update={
            "records_file": f"records-{sha}.jsonl",
            "records_sha256": sha,
            "record_count": 3,
            "bytes": len(bad),
        }
    )
    (directory / storage.MANIFEST_NAME).write_text(forged.model_dump_json())
    with pytest.raises(storage.RecordsInvalid, match="line 3"):
        storage.read_records(directory, expect_checkpoint_id="ck-1")


def test_manifest_for_another_checkpoint_or_missing_is_refused(tmp_path: Path) -> None:
    # absent (no folder, or a folder without a manifest): RecordsMissing, a RecordsInvalid
    with pytest.raises(storage.RecordsMissing, match="never finished"):
        storage.read_records(_dir(tmp_path), expect_checkpoint_id="ck-1")
    _dir(tmp_path).mkdir(parents=True)
    with pytest.raises(storage.RecordsMissing, match="never finished"):
        storage.read_records(_dir(tmp_path), expect_checkpoint_id="ck-1")
    _write(_dir(tmp_path))
    with pytest.raises(storage.RecordsInvalid, match="'ck-1', expected 'ck-2'") as other:
        storage.read_records(_dir(tmp_path), expect_checkpoint_id="ck-2")
    assert not isinstance(other.value, storage.RecordsMissing), "present but wrong: not missing"


def test_manifest_cannot_point_outside_its_directory(tmp_path: Path) -> None:
    manifest = _write(_dir(tmp_path))
    forged = manifest.model_copy(update={"records_file": "../../../etc/passwd"})
    (_dir(tmp_path) / storage.MANIFEST_NAME).write_text(forged.model_dump_json())
    with pytest.raises(storage.RecordsInvalid, match="names records file"):
        storage.read_records(_dir(tmp_path), expect_checkpoint_id="ck-1")


@pytest.mark.parametrize(
    ("set_name", "checkpoint_id", "instance"),
    [
        ("demo", "..", "environment-0"),
        ("demo", "../escape", "environment-0"),
        ("demo", "a/b", "environment-0"),
        ("demo", ".hidden", "environment-0"),
        ("demo", "x" * 129, "environment-0"),
        ("demo", "", "environment-0"),
        ("demo", "ok\n", "environment-0"),
        ("..", "ck", "environment-0"),
        ("demo", "ck", "../../x"),
        ("demo", "ck", "environment"),
    ],
)
def test_paths_that_would_escape_are_refused(
    tmp_path: Path, set_name: str, checkpoint_id: str, instance: str
) -> None:
    with pytest.raises(storage.UnsafePath):
        storage.checkpoint_dir(tmp_path, set_name, checkpoint_id, instance)


def test_symlinked_checkpoint_directory_outside_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "demo").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "demo" / "ck").symlink_to(outside)
    with pytest.raises(storage.UnsafePath, match="outside the checkpoint root"):
        storage.checkpoint_dir(root, "demo", "ck", "environment-0")


def _os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def test_full_disk_fails_cleanly_without_leftovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, data: bytes) -> None:
        raise _os_error(errno.ENOSPC)

    monkeypatch.setattr(storage, "_write_all", no_space)
    with pytest.raises(storage.StorageError, match=r"No space left on device \(ENOSPC\)"):
        _write(_dir(tmp_path))
    assert list(_dir(tmp_path).iterdir()) == []


def test_read_only_directory_fails_with_the_os_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root ignores permission bits, so the read-only mount is simulated at the open call.
    def read_only(path: Path) -> int:
        raise _os_error(errno.EROFS)

    monkeypatch.setattr(storage, "_open_new", read_only)
    with pytest.raises(storage.StorageError, match=r"Read-only file system \(EROFS\)"):
        _write(_dir(tmp_path))


def test_fsync_failure_is_a_storage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fd: int) -> None:
        raise _os_error(errno.EIO)

    monkeypatch.setattr(storage, "_fsync", broken)
    with pytest.raises(storage.StorageError, match="EIO"):
        _write(_dir(tmp_path))


def test_root_that_is_a_file_fails_with_the_os_reason(tmp_path: Path) -> None:
    root = tmp_path / "not-a-directory"
    root.write_text("")
    with pytest.raises(storage.StorageError, match="cannot create checkpoint directory"):
        _write(storage.checkpoint_dir(root, "demo", "ck-1", "environment-0"))


def _published(checkpoint_id: str, published_ts: float, manifest: Manifest) -> CheckpointManifest:
    return CheckpointManifest(
        set_name="demo",
        checkpoint_id=checkpoint_id,
        attempt=0,
        published_ts=published_ts,
        rollout_ids=["r0", "r1", "r2"],
        participants=[
            PublishedParticipant(
                instance="environment-0",
                role=Role.ENVIRONMENT,
                manifest_path=f"demo/{checkpoint_id}/environment-0/manifest.json",
                records_sha256=manifest.records_sha256,
                record_count=manifest.record_count,
                bytes=manifest.bytes,
            )
        ],
    )


def test_checkpoint_manifest_publishes_once_and_lists_in_order(tmp_path: Path) -> None:
    manifest = _write(_dir(tmp_path))
    later = _published("ck-1", 200.0, manifest)
    earlier = _published("ck-0", 100.0, manifest)
    storage.checkpoint_dir(tmp_path, "demo", "ck-unpublished", "environment-0").mkdir(parents=True)

    path = storage.write_checkpoint_manifest(tmp_path, later)
    storage.write_checkpoint_manifest(tmp_path, earlier)
    assert path == tmp_path / "demo" / "ck-1" / storage.CHECKPOINT_MANIFEST_NAME
    assert storage.write_checkpoint_manifest(tmp_path, later) == path, "idempotent"
    with pytest.raises(storage.StorageError, match="EEXIST"):
        storage.write_checkpoint_manifest(tmp_path, later.model_copy(update={"attempt": 7}))

    assert storage.read_checkpoint_manifest(tmp_path, "demo", "ck-1") == later
    assert [m.checkpoint_id for m in storage.published_checkpoints(tmp_path, "demo")] == [
        "ck-0",
        "ck-1",
    ]
    with pytest.raises(storage.RecordsInvalid, match="never published"):
        storage.read_checkpoint_manifest(tmp_path, "demo", "ck-unpublished")


def test_remove_checkpoint_deletes_records_and_publication(tmp_path: Path) -> None:
    manifest = _write(_dir(tmp_path))
    storage.write_checkpoint_manifest(tmp_path, _published("ck-1", 1.0, manifest))
    assert storage.remove_checkpoint(tmp_path, "demo", "ck-1") is True
    assert not (tmp_path / "demo" / "ck-1").exists()
    assert storage.published_checkpoints(tmp_path, "demo") == []
    assert storage.remove_checkpoint(tmp_path, "demo", "ck-1") is False
