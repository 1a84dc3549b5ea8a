"""Filling an entry's data file: the plan of its chunks (``plan``), the chunk journal
(``journal``), the builder (``builder``) and joiners (``joiner``) with what both run
(``claimed``), the cores a joiner brings (``cores``), resuming dead builds (``resume``) and
checked chunk copies (``copying``). Rows that committed entries hold are not filled at all:
a derived entry references them (:mod:`cachekit.obtain.parts`)."""
