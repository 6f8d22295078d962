"""A fake of the network between a client and a real S3 server: a loopback HTTP proxy with faults.

`FakeNetwork(upstream)` listens on a free loopback port and forwards every request, byte for byte
(request target, headers and body as the client signed them), to the real server at `upstream`,
and its answer back. A test switches faults on and off while it runs:

- `slow(delay_s)`: the answer comes `delay_s` later (the request is forwarded after the delay);
- `fail(error)`: the request is not forwarded and the client gets an S3 error as servers and
  their load balancers say it (`SERVER_ERROR` 500 InternalError, `SLOW_DOWN` 503 SlowDown,
  `INSUFFICIENT_STORAGE` 507 for a full disk, `QUOTA_EXCEEDED` 403 and `ENTITY_TOO_LARGE` 400);
- `drop()`: the connection is closed without an answer (the bucket unreachable);
- `heal()`: every fault off.

Each fault can be limited to some methods (`methods={"PUT"}`), to request targets containing a
string (`path_contains="manifest"`) and to a number of requests (`times=1`: the first matching
request only, then the network is healthy again). `seen` lists every request with the fault it
met, so a test can show that a fault was hit (and a retry went through).

The `s3_network` fixture (testsupport/s3_server.py) is one per test in front of the session's S3
server; `s3_bucket.through(s3_network)` is the test's bucket reached through it. Nothing here
knows S3 beyond the shape of an error reply: what is stored, listed and refused is the real
server's.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final
from xml.sax.saxutils import escape

MAX_BODY_BYTES: Final = 64 * 1024 * 1024
"""The largest request or reply body relayed (test objects are far smaller); larger is a 502."""
UPSTREAM_TIMEOUT_S: Final = 30.0
"""How long a relayed request may wait on the real server."""
_HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)


@dataclass(frozen=True)
class S3Error:
    """An error reply: HTTP status and the S3 error code and message of its XML body."""

    status: int
    code: str
    message: str


SERVER_ERROR: Final = S3Error(500, "InternalError", "We encountered an internal error.")
SLOW_DOWN: Final = S3Error(503, "SlowDown", "Please reduce your request rate.")
INSUFFICIENT_STORAGE: Final = S3Error(507, "InsufficientStorage", "No space left on device.")
QUOTA_EXCEEDED: Final = S3Error(403, "QuotaExceeded", "Your request was denied: quota exceeded.")
ENTITY_TOO_LARGE: Final = S3Error(
    400, "EntityTooLarge", "Your proposed upload exceeds the maximum allowed object size."
)


@dataclass
class Fault:
    """What happens to matching requests: a delay, then an error reply, a dropped connection or
    the request forwarded."""

    name: str
    delay_s: float = 0.0
    error: S3Error | None = None
    drop: bool = False
    methods: frozenset[str] | None = None
    path_contains: str | None = None
    times: int | None = None
    """Matching requests left (None: until `heal`)."""

    def matches(self, method: str, target: str) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.methods is not None and method not in self.methods:
            return False
        return self.path_contains is None or self.path_contains in target


@dataclass(frozen=True)
class Seen:
    """One request that reached the network, and the fault it met (None: forwarded as it was)."""

    method: str
    target: str
    fault: str | None


@dataclass
class FakeNetwork:
    """A loopback proxy in front of `upstream` (see the module docstring)."""

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closing: threading.Event = field(default_factory=threading.Event)
    _server: _ProxyServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake network is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeNetwork:
        parsed = urllib.parse.urlsplit(self.upstream)
        if parsed.hostname is None or parsed.port is None:
            raise ValueError(f"upstream {self.upstream!r} needs a host and a port")
        self._server = _ProxyServer(self, parsed.hostname, parsed.port)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-network",
            daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops listening, cuts open connections and waits for every handler thread."""
        self._closing.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.cut_connections()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=UPSTREAM_TIMEOUT_S)

    # --- faults -------------------------------------------------------------------------------

    def inject(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def slow(self, delay_s: float, **match: Any) -> Fault:
        return self.inject(Fault(f"slow {delay_s} s", delay_s=delay_s, **_match(**match)))

    def fail(self, error: S3Error, **match: Any) -> Fault:
        return self.inject(Fault(f"{error.status} {error.code}", error=error, **_match(**match)))

    def drop(self, **match: Any) -> Fault:
        return self.inject(Fault("dropped", drop=True, **_match(**match)))

    def heal(self) -> None:
        with self._lock:
            self.faults.clear()

    def faulted(self, name: str) -> list[Seen]:
        """The requests that met the fault called `name`."""
        with self._lock:
            return [seen for seen in self.seen if seen.fault == name]

    def _take(self, method: str, target: str) -> Fault | None:
        with self._lock:
            fault = next((f for f in self.faults if f.matches(method, target)), None)
            if fault is not None and fault.times is not None:
                fault.times -= 1
            self.seen.append(Seen(method, target, fault.name if fault else None))
            return fault

    def _wait(self, delay_s: float) -> None:
        # The injected delay; a closing network ends it at once (and drops the request).
        self._closing.wait(delay_s)


def _match(
    methods: Iterable[str] | None = None, path_contains: str | None = None, times: int | None = None
) -> dict[str, Any]:
    return {
        "methods": frozenset(m.upper() for m in methods) if methods is not None else None,
        "path_contains": path_contains,
        "times": times,
    }


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True

    def __init__(self, network: FakeNetwork, host: str, port: int) -> None:
        self.network = network
        self.upstream_host = host
        self.upstream_port = port
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Relay)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def cut_connections(self) -> None:
        with self._connections_lock:
            for connection in self._connections:
                _cut(connection)


def _cut(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by the peer
        connection.shutdown(socket.SHUT_RDWR)


class _Relay(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: `FakeNetwork.seen` is the record."""

    def _relay(self) -> None:
        network = self.server.network
        fault = network._take(self.command, self.path)
        body = self._read_body()
        if body is None:
            return
        if fault is not None and fault.delay_s:
            network._wait(fault.delay_s)
        if network._closing.is_set() or (fault is not None and fault.drop):
            self.close_connection = True
            _cut(self.connection)
        elif fault is not None and fault.error is not None:
            self._answer_error(fault.error)
        else:
            self._forward(body)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

    def _read_body(self) -> bytes | None:
        """The request body (Content-Length or chunked), None after answering 413/400."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts: list[bytes] = []
            total = 0
            while True:
                size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
                total += size
                if total > MAX_BODY_BYTES:
                    self._answer_error(ENTITY_TOO_LARGE)
                    return None
                if size == 0:
                    while self.rfile.readline(1024).strip():
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline(1024)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._answer_error(ENTITY_TOO_LARGE)
            return None
        return self.rfile.read(length) if length else b""

    def _answer_error(self, error: S3Error) -> None:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{escape(error.code)}</Code><Message>{escape(error.message)}</Message>"
            f"<Resource>{escape(urllib.parse.urlsplit(self.path).path)}</Resource></Error>"
        ).encode()
        self.send_response(error.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, body: bytes) -> None:
        upstream = http.client.HTTPConnection(
            self.server.upstream_host, self.server.upstream_port, timeout=UPSTREAM_TIMEOUT_S
        )
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    upstream.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                upstream.putheader("Content-Length", str(len(body)))
            upstream.endheaders(body or None)
            reply = upstream.getresponse()
            data = b"" if self.command == "HEAD" else reply.read(MAX_BODY_BYTES + 1)
            headers = reply.getheaders()
        except OSError as error:
            self.send_error(502, f"the fake network could not reach the server: {error}")
            return
        finally:
            upstream.close()
        if len(data) > MAX_BODY_BYTES:
            self.send_error(502, "reply too large for the fake network")
            return
        self.send_response_only(reply.status, reply.reason)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP or (
                self.command == "HEAD" and name.lower() == "content-length"
            ):
                self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
