"""The ``cachekit`` command line: ``main`` parses, runs one command, and turns errors into
exit codes (see :mod:`cachekit.cli.main`)."""

from .main import main

__all__ = ["main"]
