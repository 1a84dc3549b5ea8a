"""The loop of one cachekit worker process (see cachekit.engine.running._workers, the pool that
starts it).

Kept apart from the pool, and on the standard library alone, so a worker starts by importing
this and then only what the pickled calls it receives name.

Protocol: length-prefixed pickles over stdin and stdout. The first message is the builder's
``sys.path``; each later one is ``(fn, args, kwargs)``, answered by ``(True, result)`` or
``(False, exception)``.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import traceback
from typing import Any, BinaryIO

HEADER = struct.Struct("<Q")
_serving = False


def serving() -> bool:
    """Whether this interpreter is a cachekit worker process (it runs one call at a time, in
    one thread): what a row function may tune itself by, as the torch decoders do."""
    return _serving


def send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def receive_bytes(stream: BinaryIO) -> bytes:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError("worker channel closed")
    size = HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("worker channel closed mid-message")
    return data


def serve() -> None:
    """The worker's loop: read a call, run it, send back (True, result) or (False, error)."""
    global _serving
    _serving = True
    channel_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints go to stderr, not the channel
    channel_in = sys.stdin.buffer
    try:
        sys.path[:] = pickle.loads(receive_bytes(channel_in))
        while True:
            try:
                message = receive_bytes(channel_in)
            except EOFError:
                break
            try:
                fn, args, kwargs = pickle.loads(message)  # may import the user's modules
                reply = (True, fn(*args, **kwargs))
            except Exception as exc:
                reply = (False, _portable(exc))
            data = _dumps_reply(reply)
            channel_out.write(HEADER.pack(len(data)))
            channel_out.write(data)
            channel_out.flush()
    except (KeyboardInterrupt, BrokenPipeError):  # the builder was interrupted or has gone
        return
    # End of input: the build is over. Nothing here needs the interpreter's teardown, which
    # the builder would wait for (docs/build-engine.md); what a row function printed is flushed.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _portable(exc: Exception) -> Exception:
    """The exception itself when it pickles (so the builder re-raises it unchanged), with the
    worker's traceback as a note; otherwise a RuntimeError that says what it was."""
    remote = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if hasattr(exc, "add_note"):
        exc.add_note(f"raised in a cachekit worker process:\n{remote}")
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc} (raised in a cachekit worker "
                            f"process, and it cannot be pickled)\n{remote}")
    return exc


def _dumps_reply(reply: tuple[bool, Any]) -> bytes:
    try:
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        return pickle.dumps((False, RuntimeError(
            f"a row result could not be pickled back to the builder: {exc!r}")))


