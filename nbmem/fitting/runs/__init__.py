"""The fit's runs half: it runs the body and reads what the runs did, for ``analysis`` to answer from.

``runner`` runs the body under the allocator's trace at a few small values (``nearby``: the runs near the answer,
and two steps in a row at it); ``multigpu`` reads each GPU's room and runs' traces and answers for all of them;
``remedies`` the measured remedies (activation checkpointing, bf16 autocast: the runs again under each, undone
after); ``hostwatch`` each run's host bytes; ``notebook`` makes a cell's source that body and finds the training
state it reaches; ``state`` copies that state and puts it back; ``progress`` is the line under the cell while a fit
runs; ``torchcheck`` what this process's torch allows a fit.

May import: ``nbmem.fitting.analysis``, ``nbmem.clean`` (``release``), ``nbmem.measure``, ``nbmem.trace``,
``nbmem.holders``, ``nbmem.records``, ``nbmem.reports``, ``nbmem.formatting``.
"""
