"""Hostile input to the GPU device plugin (`rollout-device-plugin`, docs/kind.md "GPUs").

- Malformed frames on each of its gRPC methods (a varint over 10 bytes, a length past the frame,
  a wire type proto3 does not use, an id that is not UTF-8), sent over a real gRPC channel to the
  plugin's server on a unix socket: `INVALID_ARGUMENT` with a one-line reason, no traceback
  logged (grpc logs one for any exception its handler raises).
- `GetPreferredAllocation` with 60,000 available and 60,000 required ids answered well inside a
  generous deadline (comparing each id with every chosen one took minutes).
- The CLI's refusals before it serves anything: the plugin folder missing, a file, or so long
  its socket path does not fit a unix socket; a folder where the socket belongs; `--count` or
  `$ROLLOUT_GPUS` not a number or over the maximum. One line, exit status 1, no traceback.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from rollout_servers.deviceplugin import wire
from rollout_servers.deviceplugin.plugin import GpuDevicePlugin, device_ids_for, serve

PLUGIN = [str(Path(sys.executable).with_name("rollout-device-plugin"))]
LONG_NAME = "x" * 100
"""A folder name that makes any socket path in it longer than `sun_path`'s 108 bytes."""
EXIT_TIMEOUT_S = 60.0
"""How long a refused start may take at most (it takes well under a second)."""
PREFERRED_DEADLINE_S = 20.0
"""The gRPC deadline of the 60,000-id preferred allocation: about a second here, over a minute
when every id was compared with each chosen one."""


def _identity(data: bytes) -> bytes:
    return data


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[grpc.Channel]:
    """A channel to the plugin's gRPC server, serving 4 devices on a unix socket in `tmp_path`."""
    server = serve(GpuDevicePlugin(device_ids_for("node", 4)), tmp_path / "p.sock")
    try:
        with grpc.insecure_channel(f"unix://{tmp_path / 'p.sock'}") as opened:
            yield opened
    finally:
        server.stop(grace=None).wait()


def _call(channel: grpc.Channel, method: str, frame: bytes, timeout: float = 10.0) -> bytes:
    path = f"/{wire.API_VERSION}.DevicePlugin/{method}"
    if method == "ListAndWatch":
        stream = channel.unary_stream(
            path, request_serializer=_identity, response_deserializer=_identity
        )
        return next(iter(stream(frame, timeout=timeout)))
    unary = channel.unary_unary(path, request_serializer=_identity, response_deserializer=_identity)
    reply: bytes = unary(frame, timeout=timeout)
    return reply


_MEGABYTE_VARINT = bytes([1 << 3]) + b"\xff" * 1_000_000 + b"\x01"
_ELEVEN_BYTE_VARINT = bytes([3 << 3]) + b"\xff" * 10 + b"\x01"
_NOT_UTF8_ID = bytes([1 << 3 | 2, 4, 1 << 3 | 2, 2, 0xC3, 0x28])


@pytest.mark.parametrize(
    ("method", "frame", "reason"),
    [
        ("Allocate", _NOT_UTF8_ID, r"container_requests\[0\]\.devices_ids: not valid UTF-8"),
        ("Allocate", _MEGABYTE_VARINT, "AllocateRequest: the varint at byte 1 is longer than 10"),
        (
            "GetPreferredAllocation",
            bytes([1 << 3 | 2, len(_ELEVEN_BYTE_VARINT)]) + _ELEVEN_BYTE_VARINT,
            r"container_requests\[0\]: the varint at byte 1 is longer than 10 bytes",
        ),
        (
            "GetPreferredAllocation",
            bytes([1 << 3 | 2, 4, 2 << 3 | 2, 2, 0xFF, 0xFE]),
            r"must_include_deviceIDs: not valid UTF-8",
        ),
        ("PreStartContainer", bytes([1 << 3 | 2, 100]) + b"abc", "says 100 bytes, 3 are left"),
        ("PreStartContainer", bytes([1 << 3 | 2, 1, 0x80]), "devices_ids: not valid UTF-8"),
        ("GetDevicePluginOptions", bytes([1 << 3 | 7]), "Empty: field 1 has wire type 7"),
        ("ListAndWatch", b"\x80", "Empty: the varint at byte 0 is cut off"),
    ],
    ids=[
        "allocate-id-not-utf8",
        "allocate-1MB-varint",
        "preferred-11-byte-varint",
        "preferred-id-not-utf8",
        "pre-start-length-past-frame",
        "pre-start-id-not-utf8",
        "options-wire-type-7",
        "list-and-watch-cut-off",
    ],
)
def test_a_malformed_frame_is_refused_with_invalid_argument_and_no_traceback(
    channel: grpc.Channel,
    caplog: pytest.LogCaptureFixture,
    method: str,
    frame: bytes,
    reason: str,
) -> None:
    caplog.set_level(logging.WARNING)
    with pytest.raises(grpc.RpcError) as refused:
        _call(channel, method, frame)
    error: grpc.Call = refused.value  # type: ignore[assignment]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    details = error.details() or ""
    assert "\n" not in details
    assert re.search(reason, details), details
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    assert f"refused a malformed request: {details}" in caplog.messages
    # the plugin still answers a well-formed call
    assert wire.DevicePluginOptions.decode(_call(channel, "GetDevicePluginOptions", b"")) == (
        wire.DevicePluginOptions(get_preferred_allocation_available=True)
    )


def test_a_preferred_allocation_of_60000_ids_is_answered_within_a_generous_deadline(
    channel: grpc.Channel,
) -> None:
    ids = 60_000
    available = [f"a{i}" for i in range(ids)]
    required = [f"r{i}" for i in range(ids)]
    request = wire._bytes_field(
        1,
        b"".join(wire._string_field(1, i) for i in available)
        + b"".join(wire._string_field(2, i) for i in required)
        + wire._key(3, 0)
        + wire._varint(ids + 10),
    )
    reply = _call(channel, "GetPreferredAllocation", request, timeout=PREFERRED_DEADLINE_S)
    # ContainerPreferredAllocationResponse has AllocateRequest's shape: repeated string = 1
    assert wire.decode_allocate_request(reply) == [required + available[:10]]


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("missing", "--plugin-dir {dir}/missing does not exist"),
        ("file", "--plugin-dir {dir}/file is not a folder"),
        ("long", "--plugin-dir {dir}/{long} is too long: the socket path {dir}/{long}/rollout-"),
        ("socket-folder", "{dir}/rollout-gpu.sock is a folder where the plugin's socket belongs"),
        ("count", "--count 1000000000 is over the maximum of 1024 devices"),
        ("count-env", "--count must be a whole number (ASCII digits), not '10^9'"),
    ],
    ids=["missing", "file", "long", "socket-folder", "count", "count-env"],
)
def test_the_cli_refuses_a_bad_start_with_one_line(tmp_path: Path, case: str, reason: str) -> None:
    plugin_dir = tmp_path
    args: list[str] = []
    env = {**os.environ, "ROLLOUT_GPUS": "4"}
    if case == "missing":
        plugin_dir = tmp_path / "missing"
    elif case == "file":
        plugin_dir = tmp_path / "file"
        plugin_dir.write_text("")
    elif case == "long":
        plugin_dir = tmp_path / LONG_NAME
        plugin_dir.mkdir()
    elif case == "socket-folder":
        (tmp_path / "rollout-gpu.sock").mkdir()
    elif case == "count":
        args = ["--count", "1000000000"]
    else:
        env["ROLLOUT_GPUS"] = "10^9"
    done = subprocess.run(
        [*PLUGIN, "--plugin-dir", str(plugin_dir), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=EXIT_TIMEOUT_S,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(
        f"rollout-device-plugin: {reason.format(dir=tmp_path, long=LONG_NAME)}"
    ), line
