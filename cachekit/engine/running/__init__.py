"""Running rows: on threads, on cachekit's own worker processes (``_workers``, whose
processes import only ``_worker_main``) or on any ``concurrent.futures.Executor``
(``executors``), in pieces sized for each (``pieces``, ``compute``); the row functions a
build runs (``rows``). Importing this package imports nothing else, so a worker stays
light."""
