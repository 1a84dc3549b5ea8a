"""A hostile HTTP server on loopback, for tests: it answers as a source that wants to
exhaust a build would, over plain HTTP and as an S3 endpoint alike (it routes on the last
segment of the path and ignores the query, so a presigned GET or s3fs's ``get_object`` of
``s3://bucket/dir/huge.png`` reaches the same answer as ``http://host/dir/huge.png``).

The last path segment picks the answer:

- ``ok-N.png``: a small PNG (HEAD answers with its length and an ETag);
- ``huge.png``: ``Content-Length`` of 100 GB, Range ignored, zeros for as long as read;
- ``endless.png``: a chunked body that never ends;
- ``gzip.png``: ``Content-Encoding: gzip`` whatever was asked, 256 MiB of zeros inflating
  from about 256 KB;
- ``trickle.png``: one byte a second, for ever;
- ``silent-head.png``: a HEAD never answered (a GET is the PNG);
- ``missing.png`` (anything else): 404.

Every handler stops when the server does. Standard library only; listens on 127.0.0.1.
"""

from __future__ import annotations

import gzip
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HUGE = 100 * 10**9


def png(seed: int) -> bytes:
    """A small PNG of seed-dependent pixels (Pillow is imported only by whoever asks)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (10, 12, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class HostileServer:
    """The server on a free port of 127.0.0.1; :meth:`stop` ends it and every handler."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.bomb = gzip.compress(bytes(256 << 20), compresslevel=1)
        self.requests: list[tuple[str, str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.server.handle_error = lambda *args: None  # clients that gave up: expected
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


def _handler(owner: HostileServer) -> Any:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _name(self) -> str:
            return self.path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's names)
            owner.requests.append(("HEAD", self.path))
            name = self._name()
            if name == "silent-head.png":
                owner.stopping.wait()
                return
            if name.startswith("ok-"):
                body = png(int(name[3:-4]))
                self._headers(200, {"Content-Length": len(body), "ETag": f'"{len(body)}"'})
                return
            self._headers(404, {"Content-Length": 0})

        def do_GET(self) -> None:  # noqa: N802
            owner.requests.append(("GET", self.path))
            name = self._name()
            try:
                if name.startswith("ok-") or name == "silent-head.png":
                    body = png(int(name[3:-4]) if name.startswith("ok-") else 99)
                    self._headers(200, {"Content-Length": len(body)})
                    self.wfile.write(body)
                elif name == "huge.png":
                    self._headers(200, {"Content-Length": HUGE})
                    self._forever(bytes(1 << 16))
                elif name == "endless.png":
                    self._headers(200, {"Transfer-Encoding": "chunked"})
                    chunk = bytes(1 << 16)
                    self._forever(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                elif name == "gzip.png":
                    self._headers(200, {"Content-Encoding": "gzip",
                                        "Content-Length": len(owner.bomb)})
                    self.wfile.write(owner.bomb)
                elif name == "trickle.png":
                    self._headers(200, {"Content-Length": 10**6})
                    while not owner.stopping.wait(1.0):
                        self.wfile.write(b"\0")
                        self.wfile.flush()
                else:
                    body = b"<Error><Code>NoSuchKey</Code></Error>"
                    self._headers(404, {"Content-Length": len(body)})
                    self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up: what it should do

        def _headers(self, status: int, headers: dict[str, Any]) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, str(value))
            self.end_headers()

        def _forever(self, piece: bytes) -> None:
            deadline = time.monotonic() + 600  # bounded, whatever the client does
            while not owner.stopping.is_set() and time.monotonic() < deadline:
                self.wfile.write(piece)

    return Handler
