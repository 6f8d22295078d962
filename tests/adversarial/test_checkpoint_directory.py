"""Failure-mode class 5 (docs/operations.md#failure-modes): the checkpoint directory is untrusted.

Anyone who can write the volume can put a symlink, a FIFO or a device file where a manifest or
records file belongs, or a file far larger than its manifest says. A participant must refuse
each without following it, without reading more than the manifest declares, and without holding
its control lock past the request's deadline: the next control call must get through at once.
Each test asserts that nothing was installed and that the participant still restores the
genuine checkpoint afterwards (nothing Ready is lost), and leaves no thread blocked behind it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from rollout_protocol import ControlPlane, ControlSettings, ErrorCode, Role
from rollout_protocol import _storage as storage
from shared import TOKEN, WAIT, checkpoint, deadline, post, serve
from testsupport.participants import FakeParticipant

SET = "demo"
CKPT = "ck"
INSTANCE = "environment-0"
BIG = 128 * 1024 * 1024
"""A sparse file this large costs no disk; reading it whole costs this much memory."""


def _settings(root: Path, attempt: int = 0, set_name: str = SET) -> ControlSettings:
    return ControlSettings(
        role=Role.ENVIRONMENT, set_name=set_name, checkpoint_root=root, attempt=attempt, token=TOKEN
    )


async def _committed(root: Path, set_name: str = SET) -> tuple[Path, dict[str, Any]]:
    """A genuine checkpoint `ck` of two rollouts: its instance directory and commit reply."""
    plane = ControlPlane(FakeParticipant(rollouts=["r1", "r2"]), _settings(root, set_name=set_name))
    async with serve(plane) as client:
        reply = await checkpoint(client, CKPT)
    return storage.checkpoint_dir(root, set_name, CKPT, INSTANCE), reply


def _unblock_fifo(path: Path) -> None:
    """Give a reader blocked on opening the FIFO `path` a writer that closes at once (EOF)."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


async def _within_deadline(
    call: Callable[[], Awaitable[httpx.Response]], unblock: Callable[[], None]
) -> httpx.Response:
    """Run `call`; if it has not answered within WAIT, `unblock` the storage it is stuck on (so
    no thread stays blocked after the test) and fail."""
    done = anyio.Event()
    box: list[httpx.Response] = []

    async def run() -> None:
        box.append(await call())
        done.set()

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        with anyio.move_on_after(WAIT):
            await done.wait()
        stuck = not done.is_set()
        if stuck:
            unblock()
    assert not stuck, f"the call did not answer within {WAIT}s: it is blocked on storage"
    return box[0]


async def _refused_then_genuine_restores(
    root: Path, unblock: Callable[[], None], repair: Callable[[], None], why: str
) -> None:
    """The restore of `ck` is refused (records_invalid naming `why`) within its deadline with
    nothing installed; the control plane takes the next call at once; once the directory is
    repaired the same participant restores the genuine records."""
    fresh = FakeParticipant()
    plane = ControlPlane(fresh, _settings(root, attempt=1))
    async with serve(plane) as client:
        refused = await _within_deadline(
            lambda: post(client, "restore", checkpoint_id=CKPT, attempt=1, deadline_ts=deadline(2)),
            unblock,
        )
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["code"] == ErrorCode.RECORDS_INVALID.value
        assert why in error["detail"], error["detail"]
        assert fresh.install_calls == 0
        assert fresh.admission_open, "a refused restore leaves the participant untouched"
        repair()
        restored = await _within_deadline(
            lambda: post(client, "restore", checkpoint_id=CKPT, attempt=1), unblock
        )
        assert restored.status_code == 200, restored.text
        assert sorted(r.rollout_id for r in fresh.installed) == ["r1", "r2"]
        assert (await post(client, "resume", checkpoint_id=CKPT)).status_code == 200


def _moved_aside(path: Path, outside: Path) -> Callable[[], None]:
    """Move `path` outside the root; the returned repair moves it back over whatever is there."""
    outside.mkdir(exist_ok=True)
    aside = outside / path.name
    shutil.move(path, aside)

    def repair() -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        shutil.move(aside, path)

    return repair


def _nothing() -> None:
    return None


async def test_a_records_file_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    directory, reply = await _committed(root)
    records = directory / reply["manifest"]["records_file"]
    repair = _moved_aside(records, tmp_path / "outside")
    records.symlink_to(tmp_path / "outside" / records.name)
    await _refused_then_genuine_restores(root, _nothing, repair, "not a regular file")


async def test_a_manifest_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    directory, _ = await _committed(root)
    manifest = directory / storage.MANIFEST_NAME
    repair = _moved_aside(manifest, tmp_path / "outside")
    manifest.symlink_to(tmp_path / "outside" / manifest.name)
    await _refused_then_genuine_restores(root, _nothing, repair, "not a regular file")


async def test_an_instance_directory_that_is_a_symlink_into_another_set_is_not_followed(
    tmp_path: Path,
) -> None:
    """`demo/ck/environment-0` points at set `other`'s checkpoint `ck` (inside the root): the
    participant must not restore another set's records as its own."""
    root = tmp_path / "root"
    await _committed(root, set_name="other")
    theirs = storage.checkpoint_dir(root, "other", CKPT, INSTANCE)
    mine = storage.checkpoint_dir(root, SET, CKPT, INSTANCE)
    mine.parent.mkdir(parents=True)
    mine.symlink_to(theirs)

    fresh = FakeParticipant()
    async with serve(ControlPlane(fresh, _settings(root, attempt=1))) as client:
        refused = await _within_deadline(
            lambda: post(client, "restore", checkpoint_id=CKPT, attempt=1), _nothing
        )
    assert refused.status_code == 422, refused.text
    assert "not a directory" in refused.json()["error"]["detail"]
    assert fresh.install_calls == 0


async def test_a_records_file_that_is_a_fifo_neither_blocks_nor_holds_the_lock(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    directory, reply = await _committed(root)
    records = directory / reply["manifest"]["records_file"]
    repair = _moved_aside(records, tmp_path / "outside")
    os.mkfifo(records)
    await _refused_then_genuine_restores(
        root, lambda: _unblock_fifo(records), repair, "not a regular file"
    )


async def test_a_manifest_that_is_a_fifo_neither_blocks_nor_holds_the_lock(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    directory, _ = await _committed(root)
    manifest = directory / storage.MANIFEST_NAME
    repair = _moved_aside(manifest, tmp_path / "outside")
    os.mkfifo(manifest)
    await _refused_then_genuine_restores(
        root, lambda: _unblock_fifo(manifest), repair, "not a regular file"
    )


async def test_a_records_file_that_is_a_device_is_not_read(tmp_path: Path) -> None:
    root = tmp_path / "root"
    directory, reply = await _committed(root)
    records = directory / reply["manifest"]["records_file"]
    repair = _moved_aside(records, tmp_path / "outside")
    try:
        os.mknod(records, 0o600 | 0o020000, os.makedev(1, 3))  # a character device: /dev/null
    except PermissionError:
        pytest.skip("creating device files needs CAP_MKNOD")
    await _refused_then_genuine_restores(root, _nothing, repair, "not a regular file")


@contextlib.contextmanager
def _peak_memory() -> Iterator[list[int]]:
    tracemalloc.start()
    peak: list[int] = []
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


async def test_a_records_file_larger_than_its_manifest_says_is_not_read_whole(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    directory, reply = await _committed(root)
    records = directory / reply["manifest"]["records_file"]
    repair = _moved_aside(records, tmp_path / "outside")
    with records.open("wb") as handle:
        handle.truncate(BIG)
    with _peak_memory() as peak:
        await _refused_then_genuine_restores(root, _nothing, repair, "the manifest says")
    assert peak[0] < BIG // 8, f"{peak[0]} bytes allocated: the file was read whole"


async def test_a_huge_manifest_is_not_read_whole(tmp_path: Path) -> None:
    root = tmp_path / "root"
    directory, _ = await _committed(root)
    manifest = directory / storage.MANIFEST_NAME
    repair = _moved_aside(manifest, tmp_path / "outside")
    with manifest.open("wb") as handle:
        handle.truncate(BIG)
    with _peak_memory() as peak:
        await _refused_then_genuine_restores(root, _nothing, repair, "larger than")
    assert peak[0] < BIG // 8, f"{peak[0]} bytes allocated: the manifest was read whole"


async def test_a_commit_whose_storage_hangs_releases_the_lock_at_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Storage that stops answering (a stale network mount) inside a commit: the commit fails
    at its deadline, the participant resumes, and control calls get through meanwhile."""
    root = tmp_path / "root"
    released = threading.Event()
    real_fsync = storage._fsync

    def hanging_fsync(fd: int) -> None:
        if not released.wait(timeout=60):
            raise OSError(errno.EIO, "test storage never released")
        real_fsync(fd)

    fake = FakeParticipant(rollouts=["r1"])
    plane = ControlPlane(fake, _settings(root))
    try:
        async with serve(plane) as client:
            prepared = await post(client, "prepare", checkpoint_id=CKPT)
            assert prepared.status_code == 200, prepared.text
            monkeypatch.setattr(storage, "_fsync", hanging_fsync)
            failed = await _within_deadline(
                lambda: post(client, "commit", checkpoint_id=CKPT, deadline_ts=deadline(1)),
                released.set,
            )
            assert failed.status_code == 507, failed.text
            assert "deadline" in failed.json()["error"]["detail"]
            resumed = await _within_deadline(
                lambda: post(client, "resume", checkpoint_id=CKPT), released.set
            )
            assert resumed.status_code == 200, resumed.text
            assert fake.admission_open, "the participant runs again"
            released.set()  # the storage answers again: the abandoned write ends before exit
    finally:
        released.set()
