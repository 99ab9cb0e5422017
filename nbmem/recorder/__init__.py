"""The flight recorder: a small capsule on disk that outlives a killed kernel, and the story it tells.

``flight`` writes this kernel's capsule (samples, the running cell, the owner rows) and removes it on a clean
end; ``deaths`` tells why the last kernel died and writes the memory-pressure note of a cell's report.

May import: ``nbmem.measure``, ``nbmem.holders``, ``nbmem.records``, ``nbmem.reports``, ``nbmem.formatting``.
"""
