"""The allocator's event trace: recorded around a cell, timed by the user's lines, replayed.

``recording`` starts and stops torch's memory-history trace for a measured cell, ``lineclock`` timestamps the
user's own lines (``sys.monitoring``), ``linetrace`` replays the trace into per-line peaks.

May import: ``nbmem.measure``, ``nbmem.records``, ``nbmem.formatting``.
"""
