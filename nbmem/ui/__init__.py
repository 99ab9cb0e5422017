"""What a person sees: the live gauge (``widget`` + the ES modules in ``js/``) and matplotlib plots.

Reads records the session publishes; the only message back is a cleanup request through the session.

May import: ``nbmem.records``, ``nbmem.reports``, ``nbmem.formatting``, ``nbmem.options``, ``nbmem.clean``
(the request type), ``nbmem.session`` and ``nbmem.fitting`` (types only).

Add a gauge segment in ``js/segments.js``: the gauge and ``plotting`` both read it (``frontend.segment_spec``).
"""
