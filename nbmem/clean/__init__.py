"""The one door back into the notebook: a checked request, then its steps, each measured.

``%cudamem clean``, ``nbmem.cleanup()`` and the gauge's buttons all come here (the package is not named
``cleanup``: a sub-package of that name would hide the function ``nbmem.cleanup`` once imported).

``request`` checks a whole request first (all or nothing); ``cleaner`` runs it step by step. Nothing else in
nbmem changes the user's variables (the fit binds its NAME and patches modules only for its runs, and puts them
back: ``nbmem.fitting.runs.state``).

May import: ``nbmem.records``, ``nbmem.reports``, ``nbmem.formatting``.
"""
