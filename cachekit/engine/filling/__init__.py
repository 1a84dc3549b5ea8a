"""Filling an entry's data file: the plan of its chunks (``plan``), the chunk journal
(``journal``), the builder (``builder``) and joiners (``joiner``) with what both run
(``claimed``), the cores a joiner brings (``cores``), resuming dead builds (``resume``) and
checked chunk copies (``copying``), and copying in the rows of committed entries before
computing only the rest (``copy_in``)."""
