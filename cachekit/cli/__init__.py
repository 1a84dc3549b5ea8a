"""The ``cachekit`` command line. ``main`` parses, runs one command, and turns errors into
exit codes (:mod:`cachekit.cli.main`); the commands are in :mod:`cachekit.cli.local` and
:mod:`cachekit.cli.remote`, which share what the command line prints
(:mod:`cachekit.cli.output`), how it reads arguments (:mod:`cachekit.cli.parser`) and the
stores they name (:mod:`cachekit.cli.stores`), and how it carries out a removal
(:mod:`cachekit.cli.confirm`)."""

from .main import main

__all__ = ["main"]
