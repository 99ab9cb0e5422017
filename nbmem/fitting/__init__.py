"""Will it fit? ``%%cudamem --fit`` and ``nbmem.fit()``.

``allocator`` models the CUDA caching allocator, ``model`` lines up a body's runs and fits each allocation's
size to the value, ``prediction`` replays that timeline through the allocator model to find the largest value
that fits (all three pure analysis); ``state`` copies the training state a body can change and puts it back;
``runner`` runs the body under the allocator's trace (the engine part), and again under each remedy
``remedies`` can apply (activation checkpointing, bf16 autocast) when a wanted value does not fit;
``multigpu`` runs the analysis on each GPU the runs allocated on and answers for all of them, and ``devices``
is the GPUs a fit answers for (``--on``: a size, or a GPU from a table of common ones).

May import: ``nbmem.measure``, ``nbmem.trace``, ``nbmem.holders``, ``nbmem.records``, ``nbmem.reports``,
``nbmem.formatting``. Add a fit remedy in ``remedies`` (measured ones are run again under it; modelled ones,
like gradient accumulation, are replayed through the allocator model).
"""
