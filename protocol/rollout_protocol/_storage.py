"""Checkpoint records on shared storage, written so that a crash at any instant leaves either a
complete, verifiable checkpoint directory or one that is visibly incomplete.

Layout: `<root>/<set_dir>/<checkpoint_id>/<role>-<index>/records-<sha256>.jsonl`, then
`manifest.json` next to it, then (when no operator publishes) `<root>/<set_dir>/<checkpoint_id>/
checkpoint.json`. `set_dir` is the set's directory under the root: the set name where a
participant runs on its own, `<namespace>/<set>/<uid>` (`set_storage_dir`) for sets the
operator runs, so sets of the same name in two namespaces, or a set deleted and created again,
never share a directory on a shared volume.

Every file is written under a temporary name, fsynced and only then given its final name; the
directory is fsynced after each rename. The manifests are created with
create-if-absent semantics (a hard link of a complete temporary file), so a reader never sees a
half-written manifest and a retry can never replace one with different content.

Reads verify everything (names, digest, byte and record counts, schema) before returning
anything, because restore is all or nothing: a participant must be able to refuse a damaged
checkpoint before it has installed a single record.

The checkpoint directory is untrusted (anyone who can write the volume can put anything there),
so reads never follow a symlink (the instance directory and the file are opened with
`O_NOFOLLOW`), refuse anything but a regular file before reading a byte (a FIFO would block the
reader, a device would never end), open without blocking (`O_NONBLOCK`), and read at most what
the manifest declares (a manifest itself at most `MAX_MANIFEST_BYTES`).

Removal (`remove_checkpoint_files`, `remove_set_files`, and `remove_records` which answers for
both) deletes only what this module writes
(manifests, records files, their temporary files, and the directories that then are empty) and
never follows a symlink: a file someone else put on the volume is left in place and reported,
so a cleanup can never take more than the set's own records, whatever the volume holds. That
holds while the volume changes under it too: each directory is opened once, without following
a symlink (`O_NOFOLLOW`), relative to its parent's descriptor, and everything inside it is
listed, unlinked and removed relative to that descriptor (`dir_fd`), never by a path that could
be looked up again through a symlink swapped in meanwhile.

Records are encoded ahead (`encode_record`: a record's line and its digest, made when an episode
reaches a boundary, outside any checkpoint), so a commit only writes bytes that already exist.
Records format 2 (the manifest's `schema_version`) names the records file by the digest of its
lines' digests (`records_digest`), so a commit never hashes the whole file either; restore reads
format 1 (the digest of the whole file, written before encode-ahead) as well.

A set's records live on a volume or in an S3-API bucket: `RecordsStore` is the seam the control
plane, the coordinator and `rollout-records` write, read, publish and remove through;
`VolumeStore` is this module behind it, `rollout_protocol._objectstore.BucketStore` the bucket
(the same layout below a key prefix, and the same verification: `records_manifest`,
`check_manifest`, `verify_records` and the parsers here serve both).

The functions here block on disk I/O; the control plane runs them in a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from pydantic import ValidationError

from . import tracing
from ._wire import (
    CHECKPOINT_ID_PATTERN,
    INSTANCE_PATTERN,
    MAX_KEPT_LISTED,
    RECORD,
    CheckpointManifest,
    Manifest,
    Record,
    RemoveReply,
    Role,
)

MANIFEST_NAME = "manifest.json"
CHECKPOINT_MANIFEST_NAME = "checkpoint.json"
_RECORDS_NAME = re.compile(r"records-([0-9a-f]{64})\.jsonl")
_TEMP_PREFIX = ".tmp-"
MAX_SET_DIR_DEPTH = 3
_IOV_MAX = 1024
"""Buffers per vectored write: IOV_MAX on Linux and macOS."""
MAX_MANIFEST_BYTES = 64 * 1024
"""A participant's manifest is a few hundred bytes; a larger file is not one."""
MAX_CHECKPOINT_MANIFEST_BYTES = 16 * 1024 * 1024
"""`checkpoint.json` lists every participant and the commit scope's rollout ids."""
"""`<namespace>/<set>/<uid>`: the deepest set directory (`set_storage_dir`)."""


class StorageError(Exception):
    """The operating system refused a storage operation; the message carries its reason."""

    def __init__(self, what: str, path: Path, error: OSError) -> None:
        code = errno.errorcode.get(error.errno or 0, "E?")
        reason = error.strerror or str(error)
        super().__init__(f"{what} {path}: {reason} ({code})")
        self.errno = error.errno
        self.path = path


class RecordsInvalid(Exception):
    """Stored records cannot be trusted (missing, damaged, or not what the manifest promises)."""


class RecordsMissing(RecordsInvalid):
    """No manifest of the checkpoint where it was looked for: its instance folder or its
    manifest is absent from this storage. A participant restores only checkpoints whose
    commits finished, so at restore this says the records are not on the storage the restore
    sees (a node-local volume of a lost node, another volume), not that they are damaged
    (docs/protocol.md, "Restore")."""


class UnsafePath(ValueError):
    """A name would leave the checkpoint root or is not a plain directory name."""


# --- paths ----------------------------------------------------------------------------------


def check_name(kind: str, value: str, pattern: str) -> None:
    if re.fullmatch(pattern, value) is None:
        raise UnsafePath(f"{kind} {value!r} is not a plain name matching {pattern}")


def check_set_dir(set_dir: str) -> tuple[str, ...]:
    """The segments of a set directory: 1 to `MAX_SET_DIR_DEPTH` plain names joined by '/'."""
    parts = tuple(set_dir.split("/"))
    if len(parts) > MAX_SET_DIR_DEPTH:
        raise UnsafePath(
            f"set directory {set_dir!r} has {len(parts)} segments, at most {MAX_SET_DIR_DEPTH}"
        )
    for part in parts:
        check_name(f"set directory {set_dir!r}: segment", part, CHECKPOINT_ID_PATTERN)
    return parts


def set_storage_dir(namespace: str, set_name: str, uid: str) -> str:
    """The directory of an operator-run set under the checkpoint root: `<namespace>/<set>/<uid>`.

    The uid (assigned by the API server, never chosen by a user) makes it unique across
    namespaces and across a set deleted and created again under the same name."""
    set_dir = f"{namespace}/{set_name}/{uid}"
    check_set_dir(set_dir)
    return set_dir


def checkpoint_base(root: Path, set_dir: str, checkpoint_id: str) -> Path:
    """`<root>/<set_dir>/<checkpoint_id>`: one checkpoint of one set, every instance below it.

    `set_dir` is the set name, or the set's directory (`set_storage_dir`)."""
    parts = check_set_dir(set_dir)
    check_name("checkpoint id", checkpoint_id, CHECKPOINT_ID_PATTERN)
    base = Path(root).joinpath(*parts, checkpoint_id)
    _check_inside(Path(root), base)
    return base


def checkpoint_dir(root: Path, set_dir: str, checkpoint_id: str, instance: str) -> Path:
    """`<root>/<set_dir>/<checkpoint_id>/<instance>/`, refusing anything that would escape root."""
    check_name("instance", instance, INSTANCE_PATTERN)
    directory = checkpoint_base(root, set_dir, checkpoint_id) / instance
    _check_inside(Path(root), directory)
    return directory


def _check_inside(root: Path, path: Path) -> None:
    # The name checks already exclude separators and dot names; resolving catches a symlinked
    # set or checkpoint directory that points somewhere else.
    resolved_root = root.resolve()
    resolved = path.resolve()
    if resolved != resolved_root and resolved_root not in resolved.parents:
        raise UnsafePath(f"{path} resolves to {resolved}, outside the checkpoint root {root}")


# --- low-level durable writes (module-level so tests can inject OS failures) ----------------


def _open_new(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync(fd: int) -> None:
    with tracing.span("fsync", only_in_trace=True):
        os.fsync(fd)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _fsync(fd)
    finally:
        os.close(fd)


def make_dirs(directory: Path) -> None:
    """Create missing directories, fsyncing each new entry's parent so the path survives a crash.

    A no-op (one stat) when `directory` exists, so a participant can create its checkpoint
    directory ahead of the commit, while later stages still park, and the commit skips these
    fsyncs.
    """
    missing: list[Path] = []
    probe = directory
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for created in reversed(missing):
            _fsync_dir(created.parent)
    except OSError as error:
        raise StorageError("cannot create checkpoint directory", directory, error) from error


def remove_empty_dirs(directory: Path, *, below: Path) -> None:
    """Remove `directory`, then each parent strictly below `below`, while they are empty.

    Used when a checkpoint whose directory was created ahead of its commit is resumed without
    one, so an aborted checkpoint leaves nothing behind. Errors (not empty, already gone) stop
    the walk silently: another participant's files are never touched.
    """
    probe = directory
    while probe != below and below in probe.parents:
        try:
            probe.rmdir()
        except OSError:
            return
        probe = probe.parent


def _write_temp(directory: Path, content: bytes) -> Path:
    """Write `content` to a fresh temporary file in `directory` and fsync it."""
    return _write_temp_with(directory, lambda fd: _write_all(fd, content))


def _write_temp_with(directory: Path, write: Callable[[int], None]) -> Path:
    """A fresh temporary file in `directory`, filled by `write(fd)` and fsynced; removed again
    when the write fails."""
    temp = directory / f"{_TEMP_PREFIX}{uuid.uuid4().hex}"
    try:
        fd = _open_new(temp)
    except OSError as error:
        raise StorageError("cannot create", temp, error) from error
    try:
        try:
            write(fd)
            _fsync(fd)
        finally:
            os.close(fd)
    except OSError as error:
        _discard(temp)
        raise StorageError("cannot write", temp, error) from error
    return temp


def _write_lines(fd: int, lines: Sequence[bytes]) -> None:
    """Write `lines` back to back with vectored writes (no joined copy of the file)."""
    index, offset = 0, 0
    while index < len(lines):
        batch: list[bytes | memoryview] = [memoryview(lines[index])[offset:]]
        batch.extend(lines[index + 1 : index + _IOV_MAX])
        written = os.writev(fd, batch)
        # advance past what was written (a short write stops inside some line)
        for part in batch:
            if written < len(part):
                offset += written
                break
            written -= len(part)
            index += 1
            offset = 0


def _write_temp_lines(directory: Path, lines: Sequence[bytes]) -> Path:
    """`_write_temp` for a records file given as its lines."""
    return _write_temp_with(directory, lambda fd: _write_lines(fd, lines))


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _create_once(temp: Path, final: Path) -> bool:
    """Give `temp` the name `final` only if `final` does not exist; True when it was created.

    A hard link is atomic create-if-absent and never exposes a partial file. Filesystems
    without hard links fall back to an exclusive create plus copy, which can only leave a
    partial file behind after a crash, never replace a complete one.
    """
    try:
        os.link(temp, final)
        return True
    except FileExistsError:
        return False
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
    try:
        fd = _open_new(final)
    except FileExistsError:
        return False
    try:
        _write_all(fd, temp.read_bytes())
        _fsync(fd)
    finally:
        os.close(fd)
    return True


def _publish_once(directory: Path, name: str, content: bytes) -> bool:
    """Durably create `directory/name` with `content` unless it exists; True when created."""
    temp = _write_temp(directory, content)
    final = directory / name
    try:
        created = _create_once(temp, final)
        _discard(temp)
        _fsync_dir(directory)
    except OSError as error:
        _discard(temp)
        raise StorageError("cannot create", final, error) from error
    return created


# --- records --------------------------------------------------------------------------------

RECORDS_FORMAT: Final = 2
"""The records format `write_records` writes (the manifest's `schema_version`): the records
file is named by, and verified against, `records_digest` of its lines. Format 1 (the sha256 of
the whole file) is still read."""


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    """A record with its records-file line, encoded ahead of any commit.

    `line` is the record's JSON plus the newline that ends it; `digest` the sha256 of the JSON
    (the line without its newline). A participant makes one when an episode reaches a boundary
    (the record's content does not change until the next one), so a commit only writes."""

    record: Record
    line: bytes
    digest: bytes


def encode_record(record: Record) -> EncodedRecord:
    """Encode one record: its line and the digest `records_digest` combines."""
    body = RECORD.dump_json(record)
    return EncodedRecord(record, body + b"\n", hashlib.sha256(body).digest())


def records_digest(digests: Iterable[bytes]) -> str:
    """Format 2's records digest: the sha256 of the records' line digests, in file order.

    It binds the file's content as the whole-file sha256 does (the file is exactly the lines,
    each ended by a newline, and the manifest fixes its size and line count), but a commit
    hashes a few bytes per record instead of every byte of the file."""
    return hashlib.sha256(b"".join(digests)).hexdigest()


def records_manifest(
    *,
    role: Role,
    instance: str,
    checkpoint_id: str,
    attempt: int,
    encoded: Sequence[EncodedRecord],
) -> Manifest:
    """The manifest `write_records` writes for these records, made without I/O: one digest over
    the records' digests. A cut answers with it before a byte is written (docs/protocol.md,
    "Persist after resume")."""
    sha256 = records_digest([item.digest for item in encoded])
    return Manifest(
        schema_version=RECORDS_FORMAT,
        role=role,
        instance=instance,
        checkpoint_id=checkpoint_id,
        attempt=attempt,
        records_file=f"records-{sha256}.jsonl",
        records_sha256=sha256,
        record_count=len(encoded),
        bytes=sum(len(item.line) for item in encoded),
    )


def write_records(
    directory: Path,
    *,
    role: Role,
    instance: str,
    checkpoint_id: str,
    attempt: int,
    records: Sequence[Record] = (),
    encoded: Sequence[EncodedRecord] | None = None,
) -> Manifest:
    """Durably write one participant's records, then its manifest; returns the manifest.

    `encoded` are records encoded ahead (`encode_record`), written as they are; without it,
    `records` are encoded here. Either way the file is records format 2 (`RECORDS_FORMAT`).

    Both files are written under temporary names and fsynced; then the records file gets its
    digest name, the manifest is created (create-if-absent) and one directory fsync makes both
    names durable before this returns. A crash before that fsync can leave a manifest whose
    records file is missing on a filesystem that reorders directory updates; readers refuse
    that as incomplete, and no caller has been told the commit succeeded.

    Retrying with the same records is a no-op that returns the same manifest; a manifest that
    already exists with different content is never replaced (`StorageError` with EEXIST). A
    cut's persist writes through here too, after its manifest was answered
    (`records_manifest`): the same records give the same manifest. A crash before the manifest
    exists leaves no manifest: not a checkpoint, which no restore reads.
    """
    make_dirs(directory)
    if encoded is None:
        encoded = [encode_record(record) for record in records]
    lines = [item.line for item in encoded]
    manifest = records_manifest(
        role=role, instance=instance, checkpoint_id=checkpoint_id, attempt=attempt, encoded=encoded
    )
    records_file = manifest.records_file
    records_temp = _write_temp_lines(directory, lines)
    try:
        manifest_temp = _write_temp(directory, manifest_bytes(manifest))
    except StorageError:
        _discard(records_temp)
        raise
    try:
        try:
            os.replace(records_temp, directory / records_file)
        except OSError as error:
            raise StorageError("cannot rename records into", directory, error) from error
        try:
            created = _create_once(manifest_temp, directory / MANIFEST_NAME)
            _fsync_dir(directory)
        except OSError as error:
            raise StorageError("cannot create", directory / MANIFEST_NAME, error) from error
    finally:
        _discard(records_temp)
        _discard(manifest_temp)
    if not created:
        existing = _existing_manifest(directory / MANIFEST_NAME)
        if existing != manifest:
            raise StorageError(
                "refusing to replace a different manifest",
                directory / MANIFEST_NAME,
                OSError(errno.EEXIST, "a manifest with other content already exists"),
            )
    return manifest


def manifest_bytes(manifest: Manifest | CheckpointManifest) -> bytes:
    """A manifest as it is stored: indented JSON and a newline."""
    return manifest.model_dump_json(indent=2).encode() + b"\n"


# --- bounded reads of untrusted files --------------------------------------------------------

_KINDS = {
    stat.S_IFLNK: "a symlink",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a plain file")


def _open_directory(directory: Path) -> int:
    """Open `directory` itself without following a symlink (`FileNotFoundError` when absent)."""
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            mode = _lstat_mode(directory)
            raise RecordsInvalid(
                f"{directory} is not a directory but {_kind(mode)}; refusing to follow it"
            ) from error
        raise StorageError("cannot open", directory, error) from error


def _read_bounded(directory: Path, name: str, limit: int, *, exact: int | None = None) -> bytes:
    """The content of the regular file `directory/name`, at most `limit` bytes.

    Nothing is followed (neither `directory` nor the file may be a symlink), nothing but a
    regular file is opened for reading, and no more than `limit + 1` bytes are ever read:
    `RecordsInvalid` says what was found instead. With `exact`, the file must have exactly that
    many bytes (the manifest's declared size). `FileNotFoundError` when either is absent."""
    path = directory / name
    dir_fd = _open_directory(directory)
    try:
        try:
            mode = os.lstat(name, dir_fd=dir_fd).st_mode
        except FileNotFoundError:
            raise
        except OSError as error:
            raise StorageError("cannot inspect", path, error) from error
        if not stat.S_ISREG(mode):
            raise RecordsInvalid(f"{path} is not a regular file but {_kind(mode)}; not read")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            raise
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise RecordsInvalid(f"{path} is not a regular file but a symlink") from error
            raise StorageError("cannot open", path, error) from error
    finally:
        os.close(dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # replaced between the lstat and the open
            raise RecordsInvalid(f"{path} is not a regular file but {_kind(info.st_mode)}")
        check_size(path, info.st_size, limit, exact)
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as error:
        raise StorageError("cannot read", path, error) from error
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    check_size(path, len(raw), limit, exact)
    return raw


def check_size(path: object, size: int, limit: int, exact: int | None) -> None:
    if exact is not None and size != exact:
        raise RecordsInvalid(f"records file {path} has {size} bytes, the manifest says {exact}")
    if size > limit:
        raise RecordsInvalid(f"{path} is larger than {limit} bytes; not read")


def _existing_manifest(path: Path) -> Manifest | None:
    try:
        return Manifest.model_validate_json(
            _read_bounded(path.parent, path.name, MAX_MANIFEST_BYTES)
        )
    except (OSError, ValidationError, RecordsInvalid, StorageError):
        return None


def read_manifest(directory: Path) -> Manifest:
    """The manifest in `directory`; `RecordsInvalid` when absent, malformed, or not a regular
    file of at most `MAX_MANIFEST_BYTES` (nothing is followed, see the module docstring)."""
    path = directory / MANIFEST_NAME
    try:
        raw = _read_bounded(directory, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except FileNotFoundError as error:
        raise RecordsMissing(
            f"no manifest at {path}: the commit never finished, or its storage is not this one"
        ) from error
    return parse_manifest(raw, path)


def parse_manifest(raw: bytes, where: object) -> Manifest:
    """A participant's manifest from its stored bytes; `RecordsInvalid` names `where` (its path
    or key) when they are not one."""
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as error:
        raise RecordsInvalid(f"manifest {where} is malformed: {_first_error(error)}") from error


def check_manifest(manifest: Manifest, where: object, *, expect_checkpoint_id: str) -> None:
    """Refuse a manifest of another checkpoint, or one whose records file is not named by its
    digest (`where` names its folder or prefix in the message)."""
    if manifest.checkpoint_id != expect_checkpoint_id:
        raise RecordsInvalid(
            f"manifest in {where} is for checkpoint {manifest.checkpoint_id!r}, "
            f"expected {expect_checkpoint_id!r}"
        )
    match = _RECORDS_NAME.fullmatch(manifest.records_file)
    if match is None or match.group(1) != manifest.records_sha256:
        raise RecordsInvalid(
            f"manifest in {where} names records file {manifest.records_file!r}, "
            f"expected records-{manifest.records_sha256}.jsonl"
        )


def read_records(directory: Path, *, expect_checkpoint_id: str) -> tuple[Manifest, list[Record]]:
    """Read and fully verify one participant's records; nothing is returned unless all check."""
    manifest = read_manifest(directory)
    check_manifest(manifest, directory, expect_checkpoint_id=expect_checkpoint_id)
    path = directory / manifest.records_file
    try:
        raw = _read_bounded(directory, manifest.records_file, manifest.bytes, exact=manifest.bytes)
    except FileNotFoundError as error:
        raise RecordsInvalid(f"records file {path} named by the manifest is missing") from error
    return manifest, verify_records(manifest, raw, path)


def verify_records(manifest: Manifest, raw: bytes, path: object) -> list[Record]:
    """The records of a records file's bytes, verified against its manifest (digest, size,
    count, schema) before any is returned; `path` names the file or object in messages."""
    if manifest.schema_version == 1:
        # written before encode-ahead: the digest is the whole file's, lines split universally
        actual = hashlib.sha256(raw).hexdigest()
        lines = raw.splitlines()
    else:
        lines = raw.split(b"\n")
        if lines.pop() != b"":
            raise RecordsInvalid(f"records file {path} does not end with a newline")
        actual = records_digest(hashlib.sha256(line).digest() for line in lines)
    if actual != manifest.records_sha256:
        raise RecordsInvalid(
            f"records file {path} has sha256 {actual}, the manifest says {manifest.records_sha256}"
        )
    if len(lines) != manifest.record_count:
        raise RecordsInvalid(
            f"records file {path} holds {len(lines)} records, "
            f"the manifest says {manifest.record_count}"
        )
    records: list[Record] = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(RECORD.validate_json(line))
        except ValidationError as error:
            raise RecordsInvalid(
                f"records file {path} line {number} is not a record: {_first_error(error)}"
            ) from error
    return records


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"]) or "document"
    return f"{location}: {first['msg']}"


# --- publication without an operator --------------------------------------------------------


def write_checkpoint_manifest(root: Path, manifest: CheckpointManifest) -> Path:
    """Publish a checkpoint: `<root>/<set>/<id>/checkpoint.json`, created once and last.

    Its presence is what makes a checkpoint restorable when no operator keeps that fact in a
    custom resource. Re-publishing identical content is a no-op; different content is refused.
    """
    base = checkpoint_base(root, manifest.set_name, manifest.checkpoint_id)
    make_dirs(base)
    if not _publish_once(base, CHECKPOINT_MANIFEST_NAME, manifest_bytes(manifest)):
        existing = _existing_checkpoint_manifest(base / CHECKPOINT_MANIFEST_NAME)
        if existing != manifest:
            raise StorageError(
                "refusing to replace a different checkpoint manifest",
                base / CHECKPOINT_MANIFEST_NAME,
                OSError(errno.EEXIST, "a checkpoint manifest with other content already exists"),
            )
    return base / CHECKPOINT_MANIFEST_NAME


def _existing_checkpoint_manifest(path: Path) -> CheckpointManifest | None:
    try:
        raw = _read_bounded(path.parent, path.name, MAX_CHECKPOINT_MANIFEST_BYTES)
        return CheckpointManifest.model_validate_json(raw)
    except (OSError, ValidationError, RecordsInvalid, StorageError):
        return None


def read_checkpoint_manifest(root: Path, set_name: str, checkpoint_id: str) -> CheckpointManifest:
    """A published checkpoint; `RecordsInvalid` when it was never published or is malformed."""
    path = checkpoint_base(root, set_name, checkpoint_id) / CHECKPOINT_MANIFEST_NAME
    try:
        raw = _read_bounded(path.parent, path.name, MAX_CHECKPOINT_MANIFEST_BYTES)
    except FileNotFoundError as error:
        raise RecordsInvalid(
            f"checkpoint {checkpoint_id!r} of set {set_name!r} was never published "
            f"(no {path}); it must not be restored"
        ) from error
    return parse_checkpoint_manifest(raw, path, set_name, checkpoint_id)


def parse_checkpoint_manifest(
    raw: bytes, where: object, set_name: str, checkpoint_id: str
) -> CheckpointManifest:
    """A published checkpoint from its stored bytes, checked to be the one looked for."""
    try:
        manifest = CheckpointManifest.model_validate_json(raw)
    except ValidationError as error:
        raise RecordsInvalid(f"{where} is malformed: {_first_error(error)}") from error
    if manifest.set_name != set_name or manifest.checkpoint_id != checkpoint_id:
        raise RecordsInvalid(
            f"{where} describes {manifest.set_name}/{manifest.checkpoint_id}, "
            f"expected {set_name}/{checkpoint_id}"
        )
    return manifest


def published_checkpoints(root: Path, set_name: str) -> list[CheckpointManifest]:
    """Every published checkpoint of a set, oldest first; unpublished directories are skipped."""
    set_dir = Path(root).joinpath(*check_set_dir(set_name))
    try:
        entries = sorted(set_dir.iterdir()) if set_dir.exists() else []
    except OSError as error:
        raise StorageError("cannot list", set_dir, error) from error
    found: list[CheckpointManifest] = []
    for entry in entries:
        if re.fullmatch(CHECKPOINT_ID_PATTERN, entry.name) is None:
            continue
        if not (entry / CHECKPOINT_MANIFEST_NAME).exists():
            continue
        found.append(read_checkpoint_manifest(root, set_name, entry.name))
    found.sort(key=lambda manifest: (manifest.published_ts, manifest.checkpoint_id))
    return found


# --- removal: only what this module wrote ---------------------------------------------------


@dataclass(frozen=True)
class Removal:
    """What a removal found and what it left in place."""

    found: bool
    """The directory existed (something of it was there to remove)."""
    kept: tuple[Path, ...] = ()
    """Entries left in place because this module did not write them (a file someone added, a
    symlink, a device): their directories stay too. Empty when everything went."""


def remove_checkpoint(root: Path, set_dir: str, checkpoint_id: str) -> bool:
    """Delete a checkpoint with its records (retention); False when it did not exist.

    See `remove_checkpoint_files`, which also says what it left in place."""
    return remove_checkpoint_files(root, set_dir, checkpoint_id).found


def remove_checkpoint_files(root: Path, set_dir: str, checkpoint_id: str) -> Removal:
    """Delete a checkpoint's records: only the files this module writes, in real directories.

    The published manifest goes first and durably, then each instance's manifest, so a crash
    half way leaves an unpublished directory (garbage) rather than a published checkpoint with
    missing records. No symlink is followed, on the way to the checkpoint or inside it, even
    when the volume changes while this runs (see `_walk_real_dirs`); what is not ours is kept
    and named in the result."""
    parts = check_set_dir(set_dir)
    check_name("checkpoint id", checkpoint_id, CHECKPOINT_ID_PATTERN)
    with contextlib.ExitStack() as opened:
        fds, base, state = _walk_real_dirs(opened, Path(root), (*parts, checkpoint_id))
        if state is None:
            return Removal(found=False)
        if state is False:
            return Removal(found=True, kept=(base,))
        try:
            kept = _empty_checkpoint_dir(fds[-1], base)
            if not kept and not _remove_dir(fds[-2], checkpoint_id):
                kept = [base]
        except OSError as error:
            raise StorageError("cannot remove checkpoint", base, error) from error
    return Removal(found=True, kept=tuple(kept))


def remove_instance_files(root: Path, set_dir: str, checkpoint_id: str, instance: str) -> Removal:
    """Delete one participant's files of a checkpoint (its manifest first, durably), then its
    folder and the checkpoint's folder when they are left empty: what a persist that failed or
    was discarded wrote. Like `remove_checkpoint_files`, only what this module writes, never
    through a symlink; another participant's files and `checkpoint.json` are never touched."""
    parts = check_set_dir(set_dir)
    check_name("checkpoint id", checkpoint_id, CHECKPOINT_ID_PATTERN)
    check_name("instance", instance, INSTANCE_PATTERN)
    with contextlib.ExitStack() as opened:
        fds, base, state = _walk_real_dirs(opened, Path(root), (*parts, checkpoint_id))
        if state is None:
            return Removal(found=False)
        if state is False:
            return Removal(found=True, kept=(base,))
        try:
            if _lstat_mode_at(fds[-1], instance) == 0:
                return Removal(found=False)
            kept = _remove_instance_dir(fds[-1], instance, base / instance)
            if not kept:
                _remove_dir(fds[-2], checkpoint_id)  # only when no one else's files are there
        except OSError as error:
            raise StorageError("cannot remove", base / instance, error) from error
    return Removal(found=True, kept=tuple(kept))


def remove_set_files(root: Path, set_dir: str) -> Removal:
    """Delete the records of every checkpoint of a set (it was deleted), then its directory and
    the parents below `root` that are left empty; like `remove_checkpoint_files`, only what this
    module writes, never through a symlink."""
    parts = check_set_dir(set_dir)
    with contextlib.ExitStack() as opened:
        fds, directory, state = _walk_real_dirs(opened, Path(root), parts)
        if state is None:
            return Removal(found=False)
        if state is False:
            return Removal(found=True, kept=(directory,))
        kept: list[Path] = []
        try:
            for entry in _entries(fds[-1]):
                path = directory / entry.name
                if entry.is_dir(follow_symlinks=False) and _matches(
                    CHECKPOINT_ID_PATTERN, entry.name
                ):
                    kept += _remove_checkpoint_dir(fds[-1], entry.name, path)
                else:
                    kept.append(path)
            if not kept:
                # the set's directory, then each parent below the root while it is empty; every
                # one relative to its parent's descriptor, opened on the way down
                if not _remove_dir(fds[-2], parts[-1]):
                    kept.append(directory)
                else:
                    for depth in range(len(parts) - 1, 0, -1):
                        if not _remove_dir(fds[depth - 1], parts[depth - 1]):
                            break
        except OSError as error:
            raise StorageError("cannot remove set directory", directory, error) from error
    return Removal(found=True, kept=tuple(kept))


def remove_records(
    root: Path, set_dir: str, checkpoint_ids: Sequence[str], *, whole_set: bool = False
) -> RemoveReply:
    """Remove these checkpoints of a set (or, `whole_set`, all of them and the set's directory)
    and say what was removed, absent and left in place: the `remove` control operation and the
    `rollout-records remove` command (a cleanup pod) both answer with this."""
    if whole_set:
        removal = remove_set_files(root, set_dir)
        outcomes = [(set_dir, removal)]
    else:
        outcomes = [
            (cid, remove_checkpoint_files(root, set_dir, cid))
            for cid in dict.fromkeys(checkpoint_ids)
        ]
    kept = [str(path.relative_to(root)) for _, r in outcomes for path in r.kept]
    return RemoveReply(
        removed=[what for what, removal in outcomes if removal.found],
        absent=[what for what, removal in outcomes if not removal.found],
        kept=kept[:MAX_KEPT_LISTED],
        kept_count=len(kept),
    )


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(pattern, name) is not None


_DIRECTORY_FLAGS: Final = (
    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
)
"""A directory opened for removal: never through a symlink at its last component (ELOOP), and
never anything but a directory (ENOTDIR, before a FIFO could block the open)."""


def _walk_real_dirs(
    opened: contextlib.ExitStack, root: Path, parts: Sequence[str]
) -> tuple[list[int], Path, bool | None]:
    """Open `root`, then each of `parts` below it relative to its parent's descriptor, never
    following a symlink: the descriptors (root first; `opened` closes them), the path reached,
    and True when all are real directories, None when one is absent, False when one is
    something else.

    Everything a removal does afterwards is relative to these descriptors (`unlink`, `rmdir`,
    `scandir` and `open` with `dir_fd`), never by path: a directory swapped for a symlink after
    it was opened (`renameat2(RENAME_EXCHANGE)` by another process) changes nothing, since the
    descriptor still names the directory that was checked, and the name is never looked up
    again. The root itself is the participant's configured mount and is followed."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return [], root, None
    except OSError as error:
        raise StorageError("cannot open", root, error) from error
    opened.callback(os.close, fd)
    fds = [fd]
    path = root
    for part in parts:
        path = path / part
        try:
            fd = _open_dir(fds[-1], part)
        except FileNotFoundError:
            return fds, path, None
        except _NotADirectory:
            return fds, path, False
        except OSError as error:
            raise StorageError("cannot open", path, error) from error
        opened.callback(os.close, fd)
        fds.append(fd)
    return fds, path, True


class _NotADirectory(Exception):
    """A name where a directory belongs is a symlink or something else; it is not entered."""


def _open_dir(parent: int, name: str) -> int:
    """`name` in the directory `parent`, opened as a directory without following a symlink;
    `_NotADirectory` when it is anything else."""
    try:
        return os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _NotADirectory(name) from None
        raise


def _entries(directory: int) -> list[os.DirEntry[str]]:
    """The entries of an open directory, by name (`os.scandir` of a descriptor never looks the
    directory up by path; its entries' `is_dir(follow_symlinks=False)` stat relative to it)."""
    with os.scandir(directory) as found:
        return sorted(found, key=lambda e: e.name)


def _is_regular(entry: os.DirEntry[str]) -> bool:
    return entry.is_file(follow_symlinks=False) and not entry.is_symlink()


def _is_regular_at(directory: int, name: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _unlink_at(directory: int, name: str) -> None:
    """Remove the entry `name` of an open directory (a symlink there would go itself, never
    what it points to); already gone is fine (another removal of the same checkpoint)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=directory)


def _remove_dir(parent: int, name: str) -> bool:
    """Remove the empty directory `name` of an open directory and make that durable; False when
    it is no longer empty or no longer a directory (something was put there meanwhile)."""
    try:
        os.rmdir(name, dir_fd=parent)
    except FileNotFoundError:
        return True
    except OSError as error:
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            return False
        raise
    _fsync(parent)
    return True


def _remove_own_dir(
    parent: int, name: str, path: Path, empty: Callable[[int, Path], list[Path]]
) -> list[Path]:
    """Open the directory `name` of the open directory `parent` without following a symlink,
    remove what `empty` finds ours in it, then the directory itself when nothing is left; what
    is left in place (`path` names `name` in it)."""
    try:
        directory = _open_dir(parent, name)
    except FileNotFoundError:
        return []
    except _NotADirectory:
        return [path]
    try:
        kept = empty(directory, path)
    finally:
        os.close(directory)
    if not kept and not _remove_dir(parent, name):
        kept = [path]
    return kept


def _remove_checkpoint_dir(parent: int, name: str, base: Path) -> list[Path]:
    """Remove the checkpoint directory `name` of an open set directory: its own files, then
    itself when nothing is left; what is left in place."""
    return _remove_own_dir(parent, name, base, _empty_checkpoint_dir)


def _empty_checkpoint_dir(directory: int, base: Path) -> list[Path]:
    """Remove one open checkpoint directory's own files; what is left in place."""
    kept: list[Path] = []
    if _is_regular_at(directory, CHECKPOINT_MANIFEST_NAME):
        _unlink_at(directory, CHECKPOINT_MANIFEST_NAME)
        _fsync(directory)
    for entry in _entries(directory):
        path = base / entry.name
        if entry.is_dir(follow_symlinks=False) and _matches(INSTANCE_PATTERN, entry.name):
            kept += _remove_instance_dir(directory, entry.name, path)
        elif _is_regular(entry) and entry.name.startswith(_TEMP_PREFIX):
            _unlink_at(directory, entry.name)
        else:
            kept.append(path)
    return kept


def _remove_instance_dir(parent: int, name: str, path: Path) -> list[Path]:
    """Remove one participant's manifest (first), records and temporary files, then its
    directory when nothing is left; what is left in place."""
    return _remove_own_dir(parent, name, path, _empty_instance_dir)


def _empty_instance_dir(directory: int, path: Path) -> list[Path]:
    """Remove one open instance directory's manifest (first, durably), records and temporary
    files; what is left in place."""
    kept: list[Path] = []
    if _is_regular_at(directory, MANIFEST_NAME):
        _unlink_at(directory, MANIFEST_NAME)
        _fsync(directory)
    for entry in _entries(directory):
        ours = _RECORDS_NAME.fullmatch(entry.name) is not None or entry.name.startswith(
            _TEMP_PREFIX
        )
        if ours and _is_regular(entry):
            _unlink_at(directory, entry.name)
        else:
            kept.append(path / entry.name)
    return kept


def _lstat_mode_at(directory: int, name: str) -> int:
    """The mode of `name` in an open directory, not following a symlink; 0 when absent."""
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return 0


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


# --- the store: a volume here, or a bucket (`rollout_protocol._objectstore`) ----------------


def manifest_path(set_dir: str, checkpoint_id: str, instance: str) -> str:
    """`<set_dir>/<checkpoint_id>/<instance>/manifest.json`: where a participant's manifest is
    below its store's root (a volume's mount, a bucket's prefix); a commit reply names it."""
    check_set_dir(set_dir)
    check_name("checkpoint id", checkpoint_id, CHECKPOINT_ID_PATTERN)
    check_name("instance", instance, INSTANCE_PATTERN)
    return f"{set_dir}/{checkpoint_id}/{instance}/{MANIFEST_NAME}"


class RecordsStore(Protocol):
    """Where a set's checkpoint records live: a volume (`VolumeStore`) or an S3-API bucket
    (`rollout_protocol._objectstore.BucketStore`), with the same layout below its root and the
    same guarantees (docs/design.md, "Records and retention"): records first, the manifest
    created once and last, reads bounded and verified before anything is returned, removal of
    the protocol's own files or objects only. Its calls block; run them in a worker thread."""

    @property
    def where(self) -> str:
        """The store in words, for messages (a mount point; a bucket, prefix and endpoint)."""
        ...

    def write_records(
        self,
        set_dir: str,
        checkpoint_id: str,
        instance: str,
        *,
        role: Role,
        attempt: int,
        encoded: Sequence[EncodedRecord],
    ) -> Manifest:
        """Durably store one participant's records, then its manifest (never replaced)."""
        ...

    def read_records(
        self, set_dir: str, checkpoint_id: str, instance: str
    ) -> tuple[Manifest, list[Record]]:
        """One participant's verified records; `RecordsMissing` when its manifest is absent."""
        ...

    def read_manifest(self, manifest_path: str) -> Manifest:
        """The manifest at `manifest_path` (as a commit reply names it)."""
        ...

    def remove_records(
        self, set_dir: str, checkpoint_ids: Sequence[str], *, whole_set: bool = False
    ) -> RemoveReply:
        """See `remove_records`."""
        ...

    def remove_instance(self, set_dir: str, checkpoint_id: str, instance: str) -> bool:
        """Remove one participant's records of a checkpoint (a persist that failed or was
        discarded), manifest first; whether any were there."""
        ...

    def write_checkpoint_manifest(self, manifest: CheckpointManifest) -> str:
        """Publish `checkpoint.json`, created once and last; where it is."""
        ...

    def read_checkpoint_manifest(self, set_name: str, checkpoint_id: str) -> CheckpointManifest:
        """A published checkpoint; `RecordsInvalid` when never published or malformed."""
        ...

    def published_checkpoints(self, set_name: str) -> list[CheckpointManifest]:
        """Every published checkpoint of a set, oldest first."""
        ...


@dataclass(frozen=True)
class VolumeStore:
    """Records on a mounted volume at `root`: the functions of this module."""

    root: Path

    @property
    def where(self) -> str:
        return str(self.root)

    def write_records(
        self,
        set_dir: str,
        checkpoint_id: str,
        instance: str,
        *,
        role: Role,
        attempt: int,
        encoded: Sequence[EncodedRecord],
    ) -> Manifest:
        directory = checkpoint_dir(self.root, set_dir, checkpoint_id, instance)
        return write_records(
            directory,
            role=role,
            instance=instance,
            checkpoint_id=checkpoint_id,
            attempt=attempt,
            encoded=encoded,
        )

    def read_records(
        self, set_dir: str, checkpoint_id: str, instance: str
    ) -> tuple[Manifest, list[Record]]:
        directory = checkpoint_dir(self.root, set_dir, checkpoint_id, instance)
        return read_records(directory, expect_checkpoint_id=checkpoint_id)

    def read_manifest(self, manifest_path: str) -> Manifest:
        return read_manifest((self.root / manifest_path).parent)

    def remove_records(
        self, set_dir: str, checkpoint_ids: Sequence[str], *, whole_set: bool = False
    ) -> RemoveReply:
        return remove_records(self.root, set_dir, checkpoint_ids, whole_set=whole_set)

    def remove_instance(self, set_dir: str, checkpoint_id: str, instance: str) -> bool:
        return remove_instance_files(self.root, set_dir, checkpoint_id, instance).found

    def write_checkpoint_manifest(self, manifest: CheckpointManifest) -> str:
        return str(write_checkpoint_manifest(self.root, manifest))

    def read_checkpoint_manifest(self, set_name: str, checkpoint_id: str) -> CheckpointManifest:
        return read_checkpoint_manifest(self.root, set_name, checkpoint_id)

    def published_checkpoints(self, set_name: str) -> list[CheckpointManifest]:
        return published_checkpoints(self.root, set_name)
