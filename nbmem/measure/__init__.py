"""Measurement: reads the machine and changes nothing.

Owns the drivers' choke points (``sources``: NVML and the torch caching allocator; ``host``: RSS, the high-water
mark, the C heap; a failure is NA with a reason, never 0), who started whom (``processes``), the memory limit that
applies (``limits``: cgroup v1/v2, JupyterHub's ``MEM_LIMIT``), which notebook a GPU process belongs to
(``notebooks``) and whether code is a library's or the user's (``libraries``).

May import: ``nbmem.records``, ``nbmem.formatting``. Nothing else of nbmem; never IPython, never anywidget.
A new driver reading goes here. A server metric reads its number here (``sources.NvmlSource``, ``processes``,
``limits``), but is made in ``nbmem.server``: carried in its ``Reading`` (``ServerMonitor._read``, which
``GET /api/nbmem/gpu`` shows) and turned into a family in ``metric_families``, which ``GpuCollector`` hands
to ``/metrics``.
"""
