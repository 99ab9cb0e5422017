"""The one door back into the notebook: a checked request, then its steps, each measured.

``%cudamem clean``, ``nbmem.cleanup()`` and the gauge's buttons all come here (the package is not named
``cleanup``: a sub-package of that name would hide the function ``nbmem.cleanup`` once imported).

``request`` checks a whole request first (all or nothing); ``cleaner`` runs it step by step; ``release`` is the
one place torch's memory is given back (``empty_cache``, ``torch._dynamo.reset``, cuBLAS's workspaces: a
cleanup's steps, and a fit's between its runs). Nothing else in nbmem changes the user's variables (the fit binds
its NAME and patches modules only for its runs, and puts them back: ``nbmem.fitting.runs.state``).

May import: ``nbmem.measure`` (``release`` reads the allocator as ``TorchSource`` does), ``nbmem.records``,
``nbmem.reports``, ``nbmem.formatting``.
"""
