"""A removal of records that races a commit, and one that races a hostile volume.

docs/operations.md, "Failure modes": the `remove` control operation (the operator's retention
reaching a volume it cannot mount) must never take records a commit of the same id wrote while
the removal ran, and never delete a file outside the set's folder, whatever a second process
does to the folders meanwhile. Each test runs a real control plane on real files and races the
removal for real (no sleeps: every wait is a condition with a deadline):

- many old checkpoints removed together with one more id while that id is prepared and
  committed: every committed manifest survives and restores;
- a removal whose volume is slow: a prepare of any other id answers at once, a prepare or
  restore of an id it is removing is refused (`conflicting_checkpoint`) until the removal's
  files are gone, even when the removal's deadline passed first;
- a folder named in a removal swapped with a symlink to a folder outside the root by another
  thread (`renameat2(RENAME_EXCHANGE)` in a loop, through ctypes) while removals run: no file
  outside the root is ever deleted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from rollout_protocol import ControlPlane, ControlSettings, ErrorCode, Role
from rollout_protocol import _storage as storage
from shared import TOKEN, WAIT, checkpoint, deadline, post, serve
from testsupport.participants import FakeParticipant

from devcluster.waiting import wait_for

SET = "demo"
INSTANCE = "environment-0"
OLD = 63
"""Old checkpoints named in the racing removal, with the one being committed: the 64 a
request may name."""
PADDING = 120
"""Temporary files (ours, so removed) in each old checkpoint: they make the removal last long
enough that a prepare and a commit fit inside it."""


def _settings(root: Path, attempt: int = 0) -> ControlSettings:
    return ControlSettings(
        role=Role.ENVIRONMENT, set_name=SET, checkpoint_root=root, attempt=attempt, token=TOKEN
    )


def _manifest(root: Path, checkpoint_id: str) -> Path:
    return storage.checkpoint_dir(root, SET, checkpoint_id, INSTANCE) / storage.MANIFEST_NAME


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait until `condition()` holds (the state of files and threads: no event to await),
    failing after WAIT seconds; polled every millisecond, as the races it waits in are short."""

    async def holds() -> bool:
        return condition()

    await wait_for(holds, timeout=WAIT, what=what, interval=0.001)


async def _restores(root: Path, checkpoint_id: str, rollouts: list[str], attempt: int = 1) -> None:
    """`checkpoint_id` restores into a fresh participant with exactly `rollouts`."""
    fresh = FakeParticipant()
    async with serve(ControlPlane(fresh, _settings(root, attempt=attempt))) as client:
        reply = await post(client, "restore", checkpoint_id=checkpoint_id, attempt=attempt)
        assert reply.status_code == 200, f"the committed checkpoint is lost: {reply.text}"
        assert (await post(client, "resume", checkpoint_id=checkpoint_id)).status_code == 200
    assert sorted(record.rollout_id for record in fresh.installed) == rollouts


def _old_checkpoints(root: Path, template: Path, count: int) -> list[str]:
    """`count` old checkpoints, each a copy of the genuine instance directory `template` padded
    with `PADDING` temporary files of the protocol's own."""
    ids = [f"old-{number}" for number in range(count)]
    for cid in ids:
        instance = storage.checkpoint_dir(root, SET, cid, INSTANCE)
        shutil.copytree(template, instance)
        for number in range(PADDING):
            (instance / f".tmp-{number:04d}").write_bytes(b"x")
    return ids


async def _prepared_again(client: httpx.AsyncClient, checkpoint_id: str) -> bool:
    """Prepare `checkpoint_id`: True once let in, False while its removal still refuses it."""
    reply = await post(client, "prepare", checkpoint_id=checkpoint_id)
    if _conflict(reply) and "being removed" in reply.json()["error"]["detail"]:
        return False
    assert reply.status_code == 200, reply.text
    return True


def _conflict(reply: httpx.Response) -> bool:
    return (
        reply.status_code == 409
        and reply.json()["error"]["code"] == ErrorCode.CONFLICTING_CHECKPOINT.value
    )


async def _race(
    client: httpx.AsyncClient, root: Path, old: list[str], fresh: str, rollouts: list[str]
) -> bool:
    """Remove `old` and `fresh` while `fresh` is prepared and committed, once the removal is
    under way; check that nothing committed was lost. True when the prepare met the removal
    (refused because the removal held `fresh`)."""
    first = _manifest(root, old[0])
    order: list[str] = []
    box: dict[str, httpx.Response] = {}

    async def remove() -> None:
        box["remove"] = await post(client, "remove", checkpoint_ids=[*old, fresh])
        order.append("remove")

    committed: httpx.Response | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(remove)
        # the removal is under way once the first old manifest is gone
        await _until(lambda: not first.exists() or "remove" in order, "removal started")
        prepared = await post(client, "prepare", checkpoint_id=fresh)
        if prepared.status_code == 200:
            committed = await post(client, "commit", checkpoint_id=fresh)
            order.append("commit")
            assert (await post(client, "resume", checkpoint_id=fresh)).status_code == 200
        else:
            assert _conflict(prepared), prepared.text
            assert "remove" not in order, "refused although no removal ran"
    removal = box["remove"]
    assert removal.status_code in (200, 409), removal.text
    if committed is None:
        # refused while the removal ran: once it has ended, the id commits as usual
        await checkpoint(client, fresh)
    else:
        assert committed.status_code == 200, committed.text
        assert _manifest(root, fresh).is_file(), (
            f"the removal ({removal.text[:200]}) deleted the manifest that the commit of "
            f"{fresh} wrote while it ran"
        )
        if removal.status_code == 200 and order.index("commit") < order.index("remove"):
            assert fresh not in removal.json()["removed"], removal.text
    await _restores(root, fresh, rollouts)
    return committed is None


async def test_a_commit_racing_a_removal_that_names_it_keeps_its_records(tmp_path: Path) -> None:
    """`remove` of 63 old checkpoints and `fresh`, while `fresh` is prepared and committed:
    whatever the interleaving, a commit that answered 200 keeps its manifest and restores, and
    a removal that answered 200 after that commit never lists `fresh` as removed. The prepare
    of an id being removed is refused (conflicting_checkpoint) rather than let in; once the
    removal has ended, the same id commits and restores."""
    root = tmp_path / "root"
    rollouts = ["r1", "r2"]
    plane = ControlPlane(FakeParticipant(rollouts=rollouts), _settings(root))
    met = 0
    async with serve(plane) as client:
        await checkpoint(client, "genuine")
        template = _manifest(root, "genuine").parent
        for round_ in range(2):
            old = _old_checkpoints(root, template, OLD)
            met += await _race(client, root, old, f"fresh-{round_}", rollouts)
    assert met > 0, "the prepare never met the removal: the race was not exercised"


@contextmanager
def _hanging_fsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[int]]]:
    """Storage whose fsync blocks until the event is set (a volume that stopped answering);
    the list counts the calls that blocked. Released on exit, so no thread stays behind."""
    released = threading.Event()
    blocked: list[int] = []
    real_fsync = storage._fsync

    def hanging_fsync(fd: int) -> None:
        blocked.append(fd)
        if not released.wait(timeout=60):
            raise OSError(errno.EIO, "test storage never released")
        real_fsync(fd)

    monkeypatch.setattr(storage, "_fsync", hanging_fsync)
    try:
        yield released, blocked
    finally:
        released.set()


@pytest.mark.parametrize("past_deadline", [False, True], ids=["running", "past-its-deadline"])
async def test_a_removal_on_a_slow_volume_refuses_its_ids_and_holds_up_no_prepare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, past_deadline: bool
) -> None:
    """The removal of `gone` blocks on storage: meanwhile a prepare of `other` answers at once
    (the removal holds no lock while it waits on the volume), a prepare or restore of `gone`
    answers 409 conflicting_checkpoint at once, and keeps doing so after the removal's call has
    failed at its deadline while its thread still deletes. Once the storage answers and the
    thread has ended, `gone` is absent and can be committed again."""
    root = tmp_path / "root"
    async with serve(ControlPlane(FakeParticipant(rollouts=["r1"]), _settings(root))) as client:
        await checkpoint(client, "gone")
    # a fresh process of the same instance (for which `gone` is not stale) removes it
    plane = ControlPlane(FakeParticipant(rollouts=["r1"]), _settings(root, attempt=1))
    async with serve(plane) as client:
        with _hanging_fsync(monkeypatch) as (released, blocked):
            box: list[httpx.Response] = []

            async def remove() -> None:
                ends = deadline(0.5 if past_deadline else WAIT * 2)
                box.append(await post(client, "remove", checkpoint_ids=["gone"], deadline_ts=ends))

            async with anyio.create_task_group() as group:
                group.start_soon(remove)
                await _until(lambda: bool(blocked), "the removal reached the storage")
                if past_deadline:
                    await _until(lambda: bool(box), "the removal answered at its deadline")
                    assert box[0].status_code == 507, box[0].text
                    assert "deadline" in box[0].json()["error"]["detail"]
                with anyio.fail_after(WAIT):
                    refused = await post(client, "prepare", checkpoint_id="gone")
                    restore = await post(client, "restore", checkpoint_id="gone", attempt=2)
                assert _conflict(refused), refused.text
                assert "being removed" in refused.json()["error"]["detail"]
                assert _conflict(restore), restore.text
                monkeypatch.setattr(storage, "_fsync", lambda fd: None)  # prepare: no volume
                with anyio.fail_after(WAIT):
                    other = await post(client, "prepare", checkpoint_id="other")
                    assert other.status_code == 200, other.text
                    resumed = await post(client, "resume", checkpoint_id="other")
                    assert resumed.status_code == 200, resumed.text
                released.set()
            if not past_deadline:
                assert box[0].status_code == 200, box[0].text
                assert box[0].json()["removed"] == ["gone"]
            # the thread ends on its own once the storage answers; then the id is free again
            await _until(lambda: not _manifest(root, "gone").parent.exists(), "removal ended")
            # once the claim is given back, a prepare of the id is let in again
            await wait_for(
                lambda: _prepared_again(client, "gone"),
                timeout=WAIT,
                what="the claim was given back",
                interval=0.001,
            )
            for route in ("commit", "resume"):
                reply = await post(client, route, checkpoint_id="gone")
                assert reply.status_code == 200, f"{route}: {reply.text}"
    await _restores(root, "gone", ["r1"], attempt=2)


# --- a folder swapped with a symlink to outside the root while removals run ------------------

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}


def _renameat2() -> Callable[[bytes, bytes], int]:
    """`renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)` through ctypes: 0 or an errno."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    function = getattr(libc, "renameat2", None)
    if function is not None:

        def exchange(a: bytes, b: bytes) -> int:
            result = function(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)
            return 0 if result == 0 else ctypes.get_errno()

        return exchange
    number = _SYS_RENAMEAT2.get(os.uname().machine)
    if number is None:
        raise RuntimeError(
            f"renameat2 is not available on {os.uname().machine}: the swap this test races "
            "removals with cannot be made here"
        )

    def syscall(a: bytes, b: bytes) -> int:
        result = libc.syscall(number, _AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)
        return 0 if result == 0 else ctypes.get_errno()

    return syscall


class _Swapper(threading.Thread):
    """Exchanges two names (a folder and a symlink) as fast as it can while told to race."""

    def __init__(self, a: Path, b: Path) -> None:
        super().__init__(name="swapper", daemon=True)
        self._a, self._b = bytes(a), bytes(b)
        self._exchange = _renameat2()
        self._cond = threading.Condition()
        self._wanted = False
        self._racing = False
        self._stopped = False
        self.swaps = 0

    def run(self) -> None:
        while True:
            with self._cond:
                self._racing = self._wanted
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._wanted or self._stopped)
                if self._stopped:
                    return
                self._racing = True
            for _ in range(16):
                if self._exchange(self._a, self._b) == 0:
                    self.swaps += 1

    def race(self, wanted: bool) -> None:
        """Start or stop swapping; returns once the thread does as told."""
        with self._cond:
            self._wanted = wanted
            self._cond.notify_all()
            assert self._cond.wait_for(lambda: self._racing == wanted, timeout=WAIT)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._wanted = False
            self._cond.notify_all()
        self.join(WAIT)
        assert not self.is_alive()


def _populate(folder: Path, level: str) -> None:
    """The protocol's own files of a set, a checkpoint or an instance folder."""
    folder.mkdir(parents=True, exist_ok=True)
    if level == "set":
        for number in range(3):
            _populate(folder / f"ck-{number}", "checkpoint")
    elif level == "checkpoint":
        (folder / storage.CHECKPOINT_MANIFEST_NAME).write_text("{}")
        (folder / ".tmp-checkpoint").write_text("x")
        for number in range(4):
            _populate(folder / f"environment-{number}", "instance")
    else:
        (folder / storage.MANIFEST_NAME).write_text("{}")
        (folder / f"records-{'ab' * 32}.jsonl").write_text("{}\n")
        (folder / ".tmp-records").write_text("x")


def _files(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*") if not path.is_dir()}


def _clear(path: Path) -> None:
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


SWAPPED: dict[str, tuple[str | None, dict[str, Any]]] = {
    # level: (the folder swapped, relative to the set's folder; the removal's request)
    "checkpoint": ("ck", {"checkpoint_ids": ["ck"]}),
    "instance": (f"ck/{INSTANCE}", {"checkpoint_ids": ["ck"]}),
    "set": (None, {"whole_set": True}),
}


@pytest.mark.parametrize("level", list(SWAPPED))
async def test_a_folder_swapped_with_a_symlink_during_removals_never_leads_outside_the_root(
    tmp_path: Path, level: str
) -> None:
    """A folder the removal walks and a symlink to a folder outside the root, exchanged by
    another thread with renameat2(RENAME_EXCHANGE) in a loop while removals run: over many
    removals, no file outside the root is ever deleted; the removals still remove the real
    folder's files when they meet it."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    relative, request = SWAPPED[level]
    real = root / SET if relative is None else root / SET / relative
    link = real.with_name(real.name + "-link")
    victim = outside / "victim"
    _populate(victim, level)
    theirs = _files(victim)
    assert len(theirs) >= 3
    plane = ControlPlane(FakeParticipant(), _settings(root))
    swapper = _Swapper(real, link)
    swapper.start()
    lost: set[Path] = set()
    removed_some = 0
    rounds = 0
    try:
        async with serve(plane) as client:
            started = time.monotonic()
            while rounds < 150 and time.monotonic() - started < 10:
                rounds += 1
                swapper.race(False)
                _clear(real)
                _clear(link)
                _populate(real, level)
                link.symlink_to(victim, target_is_directory=True)
                ours = len(_files(root))
                swapper.race(True)
                reply = await post(client, "remove", **request)
                swapper.race(False)
                lost = theirs - _files(victim)
                if lost:
                    break
                assert reply.status_code == 200, reply.text
                removed_some += len(_files(root)) < ours
    finally:
        swapper.stop()
    assert not lost, (
        f"round {rounds}: removals through a swapped {level} folder deleted "
        f"{len(lost)} files outside the root: {sorted(str(p) for p in lost)[:5]}"
    )
    assert swapper.swaps > rounds, "the folder and the symlink were hardly ever exchanged"
    assert removed_some > 0, "no removal ever met the real folder: the race was not exercised"
