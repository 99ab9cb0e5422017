"""IPython's only contact: a thin adapter over the engine.

``root`` is the composition root (one ``Session`` and its parts per shell; ``session_of`` for ``nbmem.fit()`` and
the other functions); ``magics`` parses ``%cudamem``/``%%cudamem`` and delegates; ``shell`` knows IPython's hiding
places (``Out``, ``_n``, the last traceback); ``reconnect`` answers a reloaded page mid-cell.

May import anything in nbmem. Nothing outside this package imports IPython (tests/test_structure.py).
"""
