"""Checkpoint records in an S3-API bucket (`BucketStore`): the one declaration of the bucket's
key layout and of every write, read, listing and removal there (docs/design.md, "Records in a
bucket").

Layout: the volume's, below the bucket's key prefix:
`<prefix>/<set_dir>/<checkpoint_id>/<role>-<index>/records-<sha256>.jsonl`, then `manifest.json`
beside it, and a published checkpoint's `<prefix>/<set_dir>/<checkpoint_id>/checkpoint.json`
(`set_dir` is `<namespace>/<set>/<uid>` for a set the operator runs).

Writes: the records object first (named by its digest, so a retry writes the same bytes), then
the manifest with a conditional create (`If-None-Match: *`, obstore's `mode="create"`): a
manifest is never replaced, and a retry whose first try did land finds its own manifest and
succeeds. `checkpoint.json` is created the same way, last.

Reads: a manifest is read by its key, never found by a listing, so a listing that lags never
makes a checkpoint look absent; only the server's 404 on the manifest does (`RecordsMissing`),
never a refusal, a throttle or a timeout (`BucketError`). Every read is bounded: the object's
size (from the response's headers) is checked against the bound before a byte of its body is
read, and the body is read no further than the bound; records are verified against their
manifest (digest, size, count, schema) before anything is returned.

Retries: obstore's own retries are off. Each request is retried here on what can pass (the
endpoint unreachable, a timeout, 5xx, 503 SlowDown, 429) with exponential backoff and full
jitter, within the call's deadline: a retry gets a new client whose timeout is the time left
(a call's first tries share one client, made with the time left then, so a later request can
pass the deadline by what the earlier ones took; the control plane answers by the deadline
whatever the bucket does), and the credentials are read again from the mounted Secret's folder
on every try (so rotated keys are picked up). What cannot pass (credentials refused, the bucket
full, another 4xx) fails at once.

Errors never carry obstore's text, which holds the server's response body (an S3 error body can
name the access key): a `BucketError` says what failed, on which key, with the HTTP status and
the S3 error code only; credentials are named by their folder and file names, never by value.

The functions here block on the network; the control plane runs them in a worker thread.
"""

from __future__ import annotations

import itertools
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeVar
from urllib.parse import urlsplit

from . import _storage as storage
from ._storage import (
    CHECKPOINT_MANIFEST_NAME,
    MANIFEST_NAME,
    MAX_CHECKPOINT_MANIFEST_BYTES,
    MAX_MANIFEST_BYTES,
    EncodedRecord,
    RecordsInvalid,
    RecordsMissing,
    StorageError,
)
from ._wire import (
    CHECKPOINT_ID_PATTERN,
    INSTANCE_PATTERN,
    MAX_KEPT_LISTED,
    CheckpointManifest,
    Manifest,
    Record,
    RemoveReply,
    Role,
)

if TYPE_CHECKING:
    from obstore.store import ObjectStore, S3Config

ADDRESSING_STYLES: Final = ("path", "virtual")
ACCESS_KEY_FILE: Final = "accessKeyId"
SECRET_KEY_FILE: Final = "secretAccessKey"
SESSION_TOKEN_FILE: Final = "sessionToken"
"""The files of the mounted Secret's folder (`ROLLOUT_STORAGE_S3_CREDENTIALS_DIR`); the session
token is optional (temporary credentials)."""
MAX_CREDENTIAL_BYTES: Final = 8192
"""A credential file is a key or a token of a few hundred bytes; a larger file is not one."""
DEFAULT_BUDGET_SECONDS: Final = 30.0
"""A call with no deadline of its own (publish, a removal pod) gives up after this long."""
MAX_LISTED_KEYS: Final = 100_000
"""A listing reads at most this many keys (a set's checkpoints hold a few per participant)."""
_CONNECT_SECONDS: Final = 5.0
_FIRST_BACKOFF: Final = 0.05
_MAX_BACKOFF: Final = 2.0
_READ_CHUNK: Final = 1 << 20
_BUCKET_NAME: Final = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_PREFIX_SEGMENT: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_REGION: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_RECORDS_NAME: Final = re.compile(r"records-[0-9a-f]{64}\.jsonl")
_STATUS: Final = re.compile(r"status code: (\d{3})")
_S3_CODE: Final = re.compile(r"<Code>([A-Za-z0-9.]{1,64})</Code>")
_CREDENTIAL_CODES: Final = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidClientTokenId",
        "XAdminUserNotFound",
    }
)
_FULL_CODES: Final = frozenset(
    {"XMinioStorageFull", "QuotaExceeded", "XMinioAdminBucketQuotaExceeded", "EntityTooLarge"}
)
_T = TypeVar("_T")


class BucketConfigError(ValueError):
    """A bucket setting is not usable: `setting` is its field (`endpoint`, `bucket`, ...), the
    message says why."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


class BucketError(StorageError):
    """The bucket refused or failed a request, or did not answer in time.

    `reason` is one of `unreachable`, `timeout`, `throttled`, `server_error`, `full`,
    `credentials`, `no_bucket`, `refused`; the message says what failed on which key, with the
    HTTP status and the S3 error code, never the server's response body or a credential."""

    def __init__(self, reason: str, message: str, key: str = "") -> None:
        Exception.__init__(self, message)
        self.reason = reason
        self.errno = None
        self.path = Path(key)


@dataclass(frozen=True)
class BucketConfig:
    """An S3-API bucket as a set's storage (the `ROLLOUT_STORAGE_S3_*` variables, read by
    `rollout_protocol._settings.bucket_from_env`); checked when made."""

    endpoint: str
    bucket: str
    credentials_dir: Path
    prefix: str = ""
    region: str = "us-east-1"
    addressing: str = "path"

    def __post_init__(self) -> None:
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BucketConfigError(
                "endpoint",
                f"endpoint {self.endpoint!r} is not an http:// or https:// URL with a host",
            )
        if parts.query or parts.fragment or parts.username or parts.password:
            raise BucketConfigError(
                "endpoint", f"endpoint {self.endpoint!r} must have no user, query or fragment"
            )
        if parts.path not in ("", "/"):
            raise BucketConfigError("endpoint", f"endpoint {self.endpoint!r} must have no path")
        if _BUCKET_NAME.fullmatch(self.bucket) is None:
            raise BucketConfigError(
                "bucket",
                f"bucket {self.bucket!r} is not a bucket name (3 to 63 of a-z, 0-9, '.', '-')",
            )
        if self.prefix and any(
            _PREFIX_SEGMENT.fullmatch(part) is None for part in self.prefix.split("/")
        ):
            raise BucketConfigError(
                "prefix",
                f"prefix {self.prefix!r} must be names of A-Z, a-z, 0-9, '.', '_', '-' joined "
                "by '/', with no empty, '.' or '..' segment and no leading or trailing '/'",
            )
        if _REGION.fullmatch(self.region) is None:
            raise BucketConfigError("region", f"region {self.region!r} is not a region name")
        if self.addressing not in ADDRESSING_STYLES:
            raise BucketConfigError(
                "addressing",
                f"addressing {self.addressing!r} must be one of {list(ADDRESSING_STYLES)}",
            )
        if not Path(self.credentials_dir).is_absolute():
            raise BucketConfigError(
                "credentials_dir",
                f"credentials_dir {str(self.credentials_dir)!r} must be the absolute path of the "
                "folder where the Secret is mounted",
            )

    @property
    def url(self) -> str:
        """The bucket and prefix as an `s3://` URL (no credential in it)."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


# --- the key layout -------------------------------------------------------------------------


def set_key(config: BucketConfig, set_dir: str) -> str:
    """`<prefix>/<set_dir>/`: every key of a set is below it (the trailing '/' keeps a set
    whose name is a prefix of another's name from matching the other's keys)."""
    storage.check_set_dir(set_dir)
    return _below_prefix(config, f"{set_dir}/")


def checkpoint_key(config: BucketConfig, set_dir: str, checkpoint_id: str) -> str:
    """`<prefix>/<set_dir>/<checkpoint_id>/`: one checkpoint of one set."""
    storage.check_name("checkpoint id", checkpoint_id, CHECKPOINT_ID_PATTERN)
    return f"{set_key(config, set_dir)}{checkpoint_id}/"


def instance_key(config: BucketConfig, set_dir: str, checkpoint_id: str, instance: str) -> str:
    """`<prefix>/<set_dir>/<checkpoint_id>/<role>-<index>/`: one participant's records."""
    storage.check_name("instance", instance, INSTANCE_PATTERN)
    return f"{checkpoint_key(config, set_dir, checkpoint_id)}{instance}/"


def _below_prefix(config: BucketConfig, relative: str) -> str:
    return f"{config.prefix}/{relative}" if config.prefix else relative


def _relative(config: BucketConfig, key: str) -> str:
    """A key as it is named outside: below the prefix, like a path below a volume's mount."""
    return key[len(config.prefix) + 1 :] if config.prefix else key


# --- credentials ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Credentials:
    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


def read_credentials(folder: Path) -> _Credentials:
    """The credentials in the mounted Secret's folder, read now (a rotated Secret is picked up
    at the next call); `BucketError` (`credentials`) names the folder and file, never a value."""

    def read(name: str, *, optional: bool = False) -> str | None:
        path = folder / name
        try:
            with open(path, "rb") as file:
                raw = file.read(MAX_CREDENTIAL_BYTES + 1)
        except FileNotFoundError:
            if optional:
                return None
            raise BucketError(
                "credentials",
                f"bucket credentials: {path} is missing; the Secret mounted at {folder} needs "
                f"the keys {ACCESS_KEY_FILE} and {SECRET_KEY_FILE}",
            ) from None
        except OSError as error:
            raise BucketError(
                "credentials",
                f"bucket credentials: cannot read {path}: {error.strerror or 'error'}",
            ) from None
        try:
            value = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            value = ""
        if not value or len(raw) > MAX_CREDENTIAL_BYTES or any(c.isspace() for c in value):
            raise BucketError(
                "credentials",
                f"bucket credentials: {path} is not a key (empty, larger than "
                f"{MAX_CREDENTIAL_BYTES} bytes, or not one line of ASCII)",
            )
        return value

    access = read(ACCESS_KEY_FILE)
    secret = read(SECRET_KEY_FILE)
    assert access is not None
    assert secret is not None
    return _Credentials(access, secret, read(SESSION_TOKEN_FILE, optional=True))


# --- requests -------------------------------------------------------------------------------


def _client(config: BucketConfig, credentials: _Credentials, timeout: float) -> ObjectStore:
    """An obstore client for one try: its timeout is the call's time left, retries off."""
    from obstore.store import S3Store

    endpoint = config.endpoint.rstrip("/")
    if config.addressing == "virtual":
        # obstore takes a virtual-hosted endpoint with the bucket in its host
        parts = urlsplit(endpoint)
        endpoint = f"{parts.scheme}://{config.bucket}.{parts.netloc}"
    seconds = max(timeout, 0.001)
    settings: S3Config = {
        "endpoint": endpoint,
        "region": config.region,
        "access_key_id": credentials.access_key_id,
        "secret_access_key": credentials.secret_access_key,
        "virtual_hosted_style_request": config.addressing == "virtual",
    }
    if credentials.session_token is not None:
        settings["session_token"] = credentials.session_token
    return S3Store(
        config.bucket,
        config=settings,
        client_options={
            "allow_http": endpoint.startswith("http://"),
            "timeout": timedelta(seconds=seconds),
            "connect_timeout": timedelta(seconds=min(seconds, _CONNECT_SECONDS)),
        },
        retry_config={"max_retries": 0},
    )


@dataclass(frozen=True)
class _Failure:
    """What one failed request was, from obstore's exception (its text is never shown)."""

    reason: str
    status: int | None
    code: str | None

    @property
    def retryable(self) -> bool:
        return self.reason in ("unreachable", "timeout", "throttled", "server_error")

    def describe(self) -> str:
        parts = [f"HTTP {self.status}" if self.status is not None else None, self.code]
        shown = ", ".join(part for part in parts if part)
        return f"{_REASONS[self.reason]} ({shown})" if shown else _REASONS[self.reason]


_REASONS: Final = {
    "missing": "no such key",
    "no_bucket": "the bucket does not exist",
    "unreachable": "the endpoint is unreachable",
    "timeout": "the request timed out",
    "throttled": "the server throttles requests",
    "server_error": "the server failed",
    "full": "the bucket is full",
    "credentials": "the server refused the credentials",
    "refused": "the server refused the request",
}


def _classify(error: Exception) -> _Failure:
    """What a failed request was. Only a 404 for the key itself (`NoSuchKey`, or no body, as
    for a HEAD) is `missing`: a 404 for the bucket, or for an unknown access key (some servers
    answer so), is not a missing checkpoint."""
    text = str(error)
    status_match = _STATUS.search(text)
    code_match = _S3_CODE.search(text)
    status = int(status_match.group(1)) if status_match else None
    code = code_match.group(1) if code_match else None
    if status == 404 and code in (None, "NoSuchKey"):
        reason = "missing"
    elif status == 404 and code == "NoSuchBucket":
        reason = "no_bucket"
    elif code in _FULL_CODES or status == 507:
        reason = "full"
    elif code in _CREDENTIAL_CODES or status in (401, 403):
        reason = "credentials"
    elif code == "SlowDown" or status in (429, 503):
        reason = "throttled"
    elif status is not None and 500 <= status < 600 and status != 501:
        reason = "server_error"
    elif status is None:
        reason = "timeout" if "kind: Timeout" in text else "unreachable"
    else:
        reason = "refused"
    return _Failure(reason, status, code)


def _what_the_tries_saw(failures: Sequence[_Failure]) -> tuple[str, str]:
    """The reason and the message's tail for a request whose tries all failed until the
    deadline. A try's timeout is often only the deadline cutting the last try short (its client
    waits no longer than the time left), so a timeout is the reason only when no try failed
    otherwise; the tail names each kind of failure with its count, in the order first seen."""
    if not failures:
        return "timeout", ""
    counts = Counter(failure.describe() for failure in failures)
    other = [failure for failure in failures if failure.reason != "timeout"]
    reason = (other or failures)[-1].reason
    tries = "try" if len(failures) == 1 else "tries"
    seen = ", ".join(f"{what} ({n})" if n > 1 else what for what, n in counts.items())
    return reason, f" after {len(failures)} {tries}: {seen}"


class _NotFound(Exception):
    """The server answered 404 for a key."""


class _Exists(Exception):
    """A conditional create found the key taken."""


@dataclass
class BucketStore:
    """Records in an S3-API bucket (see the module docstring), for one call: each operation
    retries until `deadline_ts` (a wall-clock time), or `budget_seconds` from its start."""

    config: BucketConfig
    deadline_ts: float | None = None
    budget_seconds: float = DEFAULT_BUDGET_SECONDS
    clock: Callable[[], float] = time.time
    _reused: tuple[_Credentials, ObjectStore] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """The client of this call's last try, reused by the next request's first try while the
    credentials are the same (a client costs milliseconds to make and its connection is kept)."""
    _failed_tries: list[_Failure] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    """The failed tries of the request in flight (a caller whose own deadline passed first
    reads them, `seen_so_far`, to say what the bucket did)."""

    @property
    def where(self) -> str:
        return f"{self.config.url} at {self.config.endpoint}"

    def _client_for(self, credentials: _Credentials, left: float, *, retry: bool) -> ObjectStore:
        """A request's first try reuses the call's client (its timeout is the time that was
        left when it was made, so a later request may pass the deadline by what the earlier
        ones took); a retry gets a new client whose timeout is the time left now."""
        reused = self._reused
        if not retry and reused is not None and reused[0] == credentials:
            return reused[1]
        client = _client(self.config, credentials, left)
        self._reused = (credentials, client)
        return client

    # one request, retried within the deadline ----------------------------------------------

    def _request(self, what: str, key: str, call: Callable[[ObjectStore], _T]) -> _T:
        """`call` with a client (`_client_for`), retried while it fails in a way that can pass
        and the deadline allows; `_NotFound` / `_Exists` for a 404 / a taken conditional
        create."""
        from obstore.exceptions import AlreadyExistsError, BaseError, PreconditionError

        deadline = (
            self.deadline_ts if self.deadline_ts is not None else self.clock() + self.budget_seconds
        )
        shown = _relative(self.config, key)
        failures: list[_Failure] = []
        self._failed_tries = failures
        for attempt in itertools.count():
            left = deadline - self.clock()
            if left <= 0:
                break
            credentials = read_credentials(self.config.credentials_dir)
            try:
                return call(self._client_for(credentials, left, retry=attempt > 0))
            except (AlreadyExistsError, PreconditionError):
                raise _Exists(key) from None
            except (BaseError, OSError) as error:
                failure = _classify(error)
                failures.append(failure)
            if failure.reason == "missing":
                raise _NotFound(key) from None
            if not failure.retryable:
                raise self._error(what, shown, failure)
            pause = random.uniform(0, min(_MAX_BACKOFF, _FIRST_BACKOFF * 2 ** min(attempt, 16)))
            if self.clock() + pause >= deadline:
                break
            time.sleep(pause)
        reason, seen = _what_the_tries_saw(failures)
        raise BucketError(
            reason,
            f"{what} {shown} in bucket {self.where}: no success by the call's deadline{seen}",
            shown,
        )

    def seen_so_far(self) -> tuple[str, str]:
        """The reason and message tail (`_what_the_tries_saw`) of the request in flight, for a
        caller that stopped waiting on it (read from another thread: a copy of the list)."""
        return _what_the_tries_saw(list(self._failed_tries))

    def _error(self, what: str, key: str, failure: _Failure) -> BucketError:
        message = f"{what} {key} in bucket {self.where}: {failure.describe()}"
        if failure.reason == "credentials":
            folder = self.config.credentials_dir
            message += (
                f"; check the credentials in {folder} ({ACCESS_KEY_FILE}, {SECRET_KEY_FILE}, "
                f"optional {SESSION_TOKEN_FILE}): the Secret mounted there is wrong, expired, "
                "or lacks the privileges on this bucket and prefix"
            )
        return BucketError(failure.reason, message, key)

    def _put(self, key: str, data: bytes, *, create: bool) -> bool:
        """Store `data` at `key`; with `create`, only if the key is free (False when taken)."""
        import obstore

        def put(client: ObjectStore) -> None:
            obstore.put(
                client, key, data, mode="create" if create else "overwrite", use_multipart=False
            )

        try:
            self._request("cannot write", key, put)
        except _Exists:
            return False
        return True

    def _get(self, key: str, limit: int, *, exact: int | None = None) -> bytes:
        """The object at `key`, at most `limit` bytes (exactly `exact` when given): its size is
        checked before its body is read, and no more than the bound is read; `_NotFound`."""
        import obstore

        def get(client: ObjectStore) -> bytes:
            result = obstore.get(client, key)
            storage.check_size(_relative(self.config, key), result.meta["size"], limit, exact)
            chunks: list[bytes] = []
            read = 0
            for chunk in result.stream(min_chunk_size=_READ_CHUNK):
                read += len(chunk)
                storage.check_size(_relative(self.config, key), read, limit, None)
                chunks.append(bytes(chunk))
            raw = b"".join(chunks)
            storage.check_size(_relative(self.config, key), len(raw), limit, exact)
            return raw

        return self._request("cannot read", key, get)

    def _list(self, prefix: str) -> list[str]:
        """Every key below `prefix` (which ends in '/'), at most `MAX_LISTED_KEYS`."""
        import obstore

        def listing(client: ObjectStore) -> list[str]:
            keys: list[str] = []
            for chunk in obstore.list(client, prefix, chunk_size=1000):
                keys.extend(meta["path"] for meta in chunk if meta["path"].startswith(prefix))
                if len(keys) > MAX_LISTED_KEYS:
                    raise BucketError(
                        "refused",
                        f"cannot list {_relative(self.config, prefix)} in bucket {self.where}: "
                        f"more than {MAX_LISTED_KEYS} keys",
                        prefix,
                    )
            return sorted(keys)

        try:
            return self._request("cannot list", prefix, listing)
        except _NotFound:
            return []

    def _delete(self, keys: Sequence[str]) -> None:
        import obstore

        for start in range(0, len(keys), 1000):
            batch = list(keys[start : start + 1000])

            def delete(client: ObjectStore, batch: list[str] = batch) -> None:
                obstore.delete(client, batch)

            try:
                self._request("cannot remove", batch[0], delete)
            except _NotFound:  # already gone
                continue

    # the store ---------------------------------------------------------------------------------

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
        """The records object, then the manifest created once (`If-None-Match: *`); a retry
        with the same records finds its manifest and returns it, a different one is refused."""
        manifest = storage.records_manifest(
            role=role,
            instance=instance,
            checkpoint_id=checkpoint_id,
            attempt=attempt,
            encoded=encoded,
        )
        base = instance_key(self.config, set_dir, checkpoint_id, instance)
        self._put(
            base + manifest.records_file, b"".join(item.line for item in encoded), create=False
        )
        key = base + MANIFEST_NAME
        if not self._put(key, storage.manifest_bytes(manifest), create=True):
            existing = self._existing(key, storage.parse_manifest, MAX_MANIFEST_BYTES)
            if existing != manifest:
                raise BucketError(
                    "refused",
                    f"refusing to replace a different manifest at {_relative(self.config, key)} "
                    f"in bucket {self.where}",
                    key,
                )
        return manifest

    def _existing(self, key: str, parse: Callable[[bytes, object], _T], limit: int) -> _T | None:
        try:
            return parse(self._get(key, limit), _relative(self.config, key))
        except (_NotFound, RecordsInvalid):
            return None

    def read_records(
        self, set_dir: str, checkpoint_id: str, instance: str
    ) -> tuple[Manifest, list[Record]]:
        """The manifest by its key (a 404 is `RecordsMissing`), then the records object it
        names, read no further than its declared size and verified before it is returned."""
        base = instance_key(self.config, set_dir, checkpoint_id, instance)
        shown = _relative(self.config, base)
        manifest = self._read_manifest_key(base + MANIFEST_NAME)
        storage.check_manifest(manifest, shown, expect_checkpoint_id=checkpoint_id)
        key = base + manifest.records_file
        try:
            raw = self._get(key, manifest.bytes, exact=manifest.bytes)
        except _NotFound:
            raise RecordsInvalid(
                f"records object {_relative(self.config, key)} named by the manifest is missing "
                f"from bucket {self.where}"
            ) from None
        return manifest, storage.verify_records(manifest, raw, _relative(self.config, key))

    def _read_manifest_key(self, key: str) -> Manifest:
        shown = _relative(self.config, key)
        try:
            raw = self._get(key, MAX_MANIFEST_BYTES)
        except _NotFound:
            raise RecordsMissing(
                f"no manifest at {shown} in bucket {self.where}: the commit never finished, or "
                "its storage is not this one"
            ) from None
        return storage.parse_manifest(raw, shown)

    def read_manifest(self, manifest_path: str) -> Manifest:
        return self._read_manifest_key(_below_prefix(self.config, manifest_path))

    # publication ---------------------------------------------------------------------------

    def write_checkpoint_manifest(self, manifest: CheckpointManifest) -> str:
        """`checkpoint.json`, created once and last; identical content again is a no-op."""
        key = checkpoint_key(self.config, manifest.set_name, manifest.checkpoint_id)
        key += CHECKPOINT_MANIFEST_NAME
        if not self._put(key, storage.manifest_bytes(manifest), create=True):
            existing = self._existing(
                key,
                lambda raw, where: storage.parse_checkpoint_manifest(
                    raw, where, manifest.set_name, manifest.checkpoint_id
                ),
                MAX_CHECKPOINT_MANIFEST_BYTES,
            )
            if existing != manifest:
                raise BucketError(
                    "refused",
                    f"refusing to replace a different checkpoint manifest at "
                    f"{_relative(self.config, key)} in bucket {self.where}",
                    key,
                )
        return f"s3://{self.config.bucket}/{key}"

    def read_checkpoint_manifest(self, set_name: str, checkpoint_id: str) -> CheckpointManifest:
        key = checkpoint_key(self.config, set_name, checkpoint_id) + CHECKPOINT_MANIFEST_NAME
        shown = _relative(self.config, key)
        try:
            raw = self._get(key, MAX_CHECKPOINT_MANIFEST_BYTES)
        except _NotFound:
            raise RecordsInvalid(
                f"checkpoint {checkpoint_id!r} of set {set_name!r} was never published (no "
                f"{shown} in bucket {self.where}); it must not be restored"
            ) from None
        return storage.parse_checkpoint_manifest(raw, shown, set_name, checkpoint_id)

    def published_checkpoints(self, set_name: str) -> list[CheckpointManifest]:
        """Every published checkpoint of a set, oldest first (found by a listing; an
        unpublished checkpoint is skipped)."""
        base = set_key(self.config, set_name)
        found: list[CheckpointManifest] = []
        for key in self._list(base):
            parts = key[len(base) :].split("/")
            published = len(parts) == 2 and parts[1] == CHECKPOINT_MANIFEST_NAME
            if published and re.fullmatch(CHECKPOINT_ID_PATTERN, parts[0]) is not None:
                found.append(self.read_checkpoint_manifest(set_name, parts[0]))
        found.sort(key=lambda manifest: (manifest.published_ts, manifest.checkpoint_id))
        return found

    # removal: only the protocol's own keys -------------------------------------------------

    def remove_records(
        self, set_dir: str, checkpoint_ids: Sequence[str], *, whole_set: bool = False
    ) -> RemoveReply:
        """Remove these checkpoints of a set (or, `whole_set`, every one): `checkpoint.json`
        first, then each participant's manifest, then its records, and only keys of those
        names (anything else below is left and named in the reply, as on a volume)."""
        if whole_set:
            base = set_key(self.config, set_dir)
            found, kept = self._remove_below(base, whole_set=True)
            what = [(set_dir, found)]
        else:
            what, kept = [], []
            for cid in dict.fromkeys(checkpoint_ids):
                base = checkpoint_key(self.config, set_dir, cid)
                found, left = self._remove_below(base, whole_set=False)
                what.append((cid, found))
                kept += left
        shown = [_relative(self.config, key) for key in kept]
        return RemoveReply(
            removed=[name for name, found in what if found],
            absent=[name for name, found in what if not found],
            kept=shown[:MAX_KEPT_LISTED],
            kept_count=len(shown),
        )

    def remove_instance(self, set_dir: str, checkpoint_id: str, instance: str) -> bool:
        """One participant's keys of a checkpoint, its manifest first (what a persist that
        failed or was discarded wrote); another participant's keys and `checkpoint.json` stay."""
        checkpoint = checkpoint_key(self.config, set_dir, checkpoint_id)
        keys = self._list(instance_key(self.config, set_dir, checkpoint_id, instance))
        kinds = {key: _own_key(key[len(checkpoint) :], whole_set=False) for key in keys}
        self._delete([key for key, kind in kinds.items() if kind == "manifest"])
        self._delete([key for key, kind in kinds.items() if kind == "records"])
        return bool(keys)

    def _remove_below(self, base: str, *, whole_set: bool) -> tuple[bool, list[str]]:
        """Remove the protocol's keys below `base` (a checkpoint's prefix, or a set's); whether
        any key was there, and the keys left in place."""
        keys = self._list(base)
        own: dict[str | None, list[str]] = {"published": [], "manifest": [], "records": []}
        kept: list[str] = []
        for key in keys:
            own.get(_own_key(key[len(base) :], whole_set=whole_set), kept).append(key)
        published, manifests, records = own["published"], own["manifest"], own["records"]
        if not whole_set:
            # gone first even if a lagging listing missed it: it is what makes it restorable
            published = [base + CHECKPOINT_MANIFEST_NAME]
        for batch in (published, manifests, records):
            self._delete(batch)
        return bool(keys), kept


def _own_key(relative: str, *, whole_set: bool) -> str | None:
    """Which of the protocol's keys `relative` is (below a checkpoint's prefix, or a set's
    with the checkpoint id first): `published`, `manifest`, `records`; None for another key."""
    parts = relative.split("/")
    if whole_set:
        if len(parts) < 2 or re.fullmatch(CHECKPOINT_ID_PATTERN, parts[0]) is None:
            return None
        parts = parts[1:]
    if parts == [CHECKPOINT_MANIFEST_NAME]:
        return "published"
    if len(parts) != 2 or re.fullmatch(INSTANCE_PATTERN, parts[0]) is None:
        return None
    if parts[1] == MANIFEST_NAME:
        return "manifest"
    return "records" if _RECORDS_NAME.fullmatch(parts[1]) is not None else None
