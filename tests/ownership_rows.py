"""A row function whose bytes name the host that computed them, for tests/security/test_ownership.py.

It lives in a module of its own (on every child's ``PYTHONPATH``) so that processes on two
simulated hosts run one function with one key: the key covers the function's module,
qualified name and source, none of which depends on the host or on the environment.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

ROW_BYTES = 64
"""Bytes per row: a page-aligned chunk of the build then holds 64 rows."""
HOST_BYTES = {"host-a": 0xA1, "host-b": 0xB2}
"""The byte every row computed on a host holds (0xEE on any other host)."""
SECONDS_ENV = "OWNERSHIP_ROW_SECONDS"
"""How long each row takes on this process, so one host builds slowly and the other fast."""


def host_row(value: int) -> np.ndarray:
    """``ROW_BYTES`` copies of this host's byte, after ``$OWNERSHIP_ROW_SECONDS`` seconds."""
    time.sleep(float(os.environ.get(SECONDS_ENV, "0")))
    return np.full((ROW_BYTES,), HOST_BYTES.get(socket.gethostname(), 0xEE), dtype=np.uint8)
