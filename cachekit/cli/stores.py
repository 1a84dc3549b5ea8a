"""The stores the global options name: the local root (``--root``, else the default root)
and the remote tier (``--remote URL``, else ``$CACHEKIT_REMOTE``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..store import LocalStore, default_root
from ..store.remote_fs import REMOTE_ENV

if TYPE_CHECKING:
    from ..store.remote import RemoteStore


def local_store(args: argparse.Namespace) -> LocalStore:
    """The local root the command acts on, as an absolute path."""
    root = Path(args.root).expanduser() if args.root else default_root()
    return LocalStore(root.absolute())


def remote_store(args: argparse.Namespace) -> RemoteStore:
    """The remote tier; a usage error when there is none, or its URL is not one that
    fsspec can open here (an unknown protocol, a store whose package is missing)."""
    url = getattr(args, "remote_url", None) or os.environ.get(REMOTE_ENV)
    if not url:
        raise UsageError(f"no remote: pass --remote URL before the command, or set "
                         f"{REMOTE_ENV}")
    from ..store.remote import RemoteStore  # (here: a local command never loads it)

    try:
        store = RemoteStore(url)
        store.fs  # noqa: B018 (opened now: every command that asks for it calls it)
    except (ValueError, ImportError) as e:
        raise UsageError(str(e)) from None
    return store
