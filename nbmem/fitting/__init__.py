"""Will it fit? ``%%cudamem --fit`` and ``nbmem.fit()``, in six modules.

``allocator`` models the CUDA caching allocator, ``model`` lines up a body's runs and fits each allocation's
size to the value, ``prediction`` replays that timeline through the allocator model to find the largest value
that fits (all three pure analysis); ``state`` copies the training state a body can change and puts it back;
``runner`` runs the body under the allocator's trace (the engine part), and again under each remedy
``remedies`` can apply (activation checkpointing, bf16 autocast) when a wanted value does not fit.

May import: ``nbmem.measure``, ``nbmem.trace``, ``nbmem.holders``, ``nbmem.records``, ``nbmem.reports``,
``nbmem.formatting``. Add a fit remedy in ``remedies`` (measured ones are run again under it; modelled ones,
like gradient accumulation, are replayed through the allocator model).
"""
