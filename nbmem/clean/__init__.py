"""The one door back into the notebook (``%cudamem clean``, ``nbmem.cleanup()``, the gauge's buttons): a checked request, then its steps, each measured.

``request`` checks a whole request first (all or nothing); ``cleaner`` runs it step by step. Nothing else in
nbmem changes the user's variables (the fit binds its NAME and patches modules only for its runs, and puts them
back: ``nbmem.fitting.state``).

May import: ``nbmem.records``, ``nbmem.reports``, ``nbmem.formatting``.
"""
