"""IPython's only contact: a thin adapter over the engine.

``root`` is the composition root (one ``Session`` and its parts per shell, and nbmem's one pair of cell hooks,
which tell each part of every run; ``session_of`` for ``nbmem.fit()`` and the other functions); ``magics`` parses
``%cudamem``/``%%cudamem`` and delegates; ``config`` is ``%config Nbmem``; ``usage`` tells a mistyped command the
closest one; ``shell`` knows IPython's hiding places (``Out``, ``_n``, the last traceback); ``reconnect`` answers
a reloaded page mid-cell.

May import anything in nbmem. Nothing outside this package imports IPython (tests/test_structure.py).
"""
