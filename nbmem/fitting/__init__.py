"""Will it fit? ``%%cudamem --fit`` and ``nbmem.fit()``.

Two halves, one way: ``runs`` runs the body at a few small values and reads what each run allocated (the allocator's
trace, each GPU's room, the host's bytes); ``analysis`` turns those numbers into the answer (the allocator model,
the size of each allocation as a function of the value, the search, the GPUs ``--on`` names, the modelled remedies)
and imports no torch. ``runs`` imports ``analysis``, never the other way round.

May import: ``nbmem.clean`` (``release``: the cache and cuBLAS's workspaces given back between runs),
``nbmem.measure``, ``nbmem.trace``, ``nbmem.holders``, ``nbmem.records``, ``nbmem.reports``,
``nbmem.formatting``. Add a measured fit remedy in ``runs.remedies``, a modelled one in ``analysis.modelled``.
"""
