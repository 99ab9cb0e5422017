"""Measurement: reads the machine and changes nothing.

Owns the drivers' choke points (``sources``: NVML, the torch caching allocator, host RSS; a failure is NA with a
reason, never 0), who started whom (``processes``), the memory limit that applies (``limits``: cgroup v1/v2,
JupyterHub's ``MEM_LIMIT``), which notebook a GPU process belongs to (``notebooks``) and whether code is a
library's or the user's (``libraries``).

May import: ``nbmem.records``, ``nbmem.formatting``. Nothing else of nbmem; never IPython, never anywidget.
Add a server metric or a new driver reading here.
"""
