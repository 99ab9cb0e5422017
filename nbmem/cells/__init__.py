"""One measured cell, from its first boundary to its report.

``watch`` carries a cell to its report through one list of report steps (``steps.REPORT_STEPS``); ``peaks``
computes deltas and peaks from the allocator's counters; ``advice`` explains an out-of-memory error.

May import: ``nbmem.measure``, ``nbmem.trace``, ``nbmem.holders``, ``nbmem.recorder``, ``nbmem.records``,
``nbmem.reports``, ``nbmem.formatting``, ``nbmem.options``, ``nbmem.store`` (a cell's records go there).
Add a report step here.
"""
