"""The fit's analysis half: numbers in, an answer and its text out. It imports no torch and runs nothing.

``allocator`` models the CUDA caching allocator; ``model`` reads a body's runs and lines them up, ``sizes`` fits
each allocation's size to the value, ``timeline`` makes the runs a program of the value; ``prediction`` replays
that timeline through the allocator model and ``search`` finds the largest value that fits; ``devices`` is the GPUs
a fit can answer for (``--on``); ``modelled`` the remedies modelled from the runs (gradient accumulation,
expandable segments) and the record every remedy is reported in; ``hostroom`` host memory as a limit (the model of
a run's host bytes and the largest value it allows).

May import: ``nbmem.records``, ``nbmem.reports``, ``nbmem.formatting``, ``nbmem.trace`` (a test holds it to that).
"""
