"""The build engine: fill an entry's data file from a per-row function, chunk by chunk, on
threads, processes or a cluster, so that a crashed build resumes and other processes join.

A subpackage per job: ``filling`` (the plan, the chunk journal, the builder and its
``fill``, the joiners and their ``join``, resuming dead builds from their verified chunks),
``running`` (running rows on threads, cachekit's worker processes or any Executor) and
``decoding`` (the image pipelines). The engine knows nothing of stores: it works in a
directory handle it is given.

Callers import what they use from the module that defines it: this package imports
nothing, so that a worker process, which imports only
``cachekit.engine.running._worker_main``, does not load the engine.
"""
