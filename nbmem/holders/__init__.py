"""Who keeps memory alive: the holder scan, pure analysis over objects reached safely.

``reach`` holds the hostile-object rules (no ``__getattr__``, ``__len__``, ``__iter__``, ``__eq__``,
``__hash__``, ``__repr__`` or property of a user object ever runs) and ``inside`` reads what libraries keep where
no plain container shows it (closures, sparse parts, TorchScript's C++ tensors, numpy object arrays, pandas
blocks); ``walk`` goes from the notebook's roots to every live tensor, and ``reached`` reads what a walk reached
(the training state each root reaches, what a fit copies); ``naming`` turns steps into paths a user can type;
``scanner`` and ``graphs`` remember storages (``held``: their records) and the autograd graphs that save them;
``findings`` judges a row per storage and ``owners`` groups them by the name the user typed (``grouping`` keeps a
scan's groups from cell to cell); ``intent`` tells the state a cell meant to keep from a leak, ``freeing`` what
must go for a row to be freed; ``pools`` names CUDA-graph pools; ``holdings`` decides when to scan and keeps each
cell's rows; ``hostheld`` finds the biggest holders of host memory for the flight recorder.

May import: ``nbmem.measure``, ``nbmem.trace``, ``nbmem.records``, ``nbmem.reports``, ``nbmem.formatting``,
``nbmem.options``. A new holder kind is one entry in ``nbmem.records.HOLDER_KINDS`` (its rank, cleanup and words)
and its roots in ``nbmem/ipython/shell.py``; a new kind of object to walk into is a ``walk.Strategy``
(``walk.classify``, and its branch in ``Walk._visit``).
"""
