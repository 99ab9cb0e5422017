"""Will it fit? ``%%cudamem --fit`` and ``nbmem.fit()``.

Pure analysis: ``allocator`` models the CUDA caching allocator, ``sizes`` and ``model`` line up a body's runs
and fit each allocation's size to the value, ``prediction`` replays that timeline through the allocator model
and ``search`` finds the largest value that fits; ``multigpu`` does so on each GPU the runs allocated on and
answers for all of them; ``devices`` is the GPUs a fit can answer for (``--on``). ``remedies`` is every remedy,
measured (activation checkpointing, bf16 autocast: run again under it) and modelled (gradient accumulation,
expandable segments: replayed). The engine part: ``runner`` runs the body under the allocator's trace
(``nearby``: the runs near the answer, and two steps in a row at it), ``notebook`` makes a cell's source that
body and finds the training state it reaches, ``state`` copies that state and puts it back, ``progress`` is the
line under the cell while a fit runs, ``torchcheck`` what this process's torch allows a fit.

May import: ``nbmem.measure``, ``nbmem.trace``, ``nbmem.holders``, ``nbmem.records``, ``nbmem.reports``,
``nbmem.formatting``. Add a fit remedy in ``remedies``.
"""
