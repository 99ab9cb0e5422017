"""The front end: whether there is one (``in_kernel``), where ``js/`` is, the gauge's one ES module, the columns
of its rows, and the segment split both sides read.

``js/segments.js`` holds the split of a device's bar as a JSON object: the gauge (``layout.js``) imports it, and
``segment_spec()`` parses the same text for ``nbmem.plot()``, so a new segment is written once.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nbmem.records import PAGED

# -- the front end: one ES module ------------------------------------------------------------------
# anywidget evaluates a single module from a string, so `import … from "./format.js"` cannot resolve
# there. The sources stay separate modules (node tests import format.js and layout.js directly), and
# the widget gets them concatenated in dependency order with those relative imports dropped: the
# names they import are then simply in scope. No bundler, no build step.
_MODULES = ("format.js", "segments.js", "layout.js", "panel.js", "gauge.js")
_LOCAL_IMPORT = re.compile(r"^import\s[^;]*?\sfrom\s+[\"']\./[^\"']+[\"'];[ \t]*\n", re.M)


def js_dir() -> Path:
    """Where the front-end sources are: nbmem/static in a wheel, the repo's js/ in an editable install."""
    here = Path(__file__).resolve().parents[1]  # the nbmem package folder
    for d in (here / "static", here.parent / "js"):
        if (d / "gauge.js").is_file():
            return d
    raise FileNotFoundError(f"nbmem's gauge.js is missing from {here / 'static'} (and {here.parent / 'js'}): "
                            f"reinstall nbmem")


def bundle(directory: Path | None = None) -> str:
    """The gauge's ES module: format.js, layout.js, panel.js and gauge.js as one module."""
    d = directory or js_dir()
    parts = [f"// ---- nbmem/{name}\n" + _LOCAL_IMPORT.sub("", (d / name).read_text(encoding="utf-8"))
             for name in _MODULES]
    return "\n".join(parts)


#: A gauge row's columns, the one list of them: ``widget.snapshot_columns`` sends one list per name, one entry
#: per device, and ``js/layout.js``'s ``COLUMNS`` reads them back into rows (tests/test_segments.py holds the
#: two lists together).
GAUGE_COLUMNS = ("device", "model", "allocated", "reserved", "process", "others", "used", "total", "tensors", "paged",
                 "peak", "children", "limit", "near_limit")

#: The sample column behind each column of a gauge row that a sample gives, by device kind; ``tensors`` on the
#: CPU and ``paged`` on a GPU are the last scan's, not sample columns.
ROW_COLUMNS: dict[str, dict[str, str]] = {
    "gpu": {"allocated": "allocated_bytes", "reserved": "reserved_bytes", "process": "process_used_bytes",
            "children": "children_used_bytes", "others": "other_processes_bytes", "used": "nvml_used_bytes",
            "total": "nvml_total_bytes"},
    "cpu": {"allocated": "allocated_bytes", "reserved": "reserved_bytes", "process": "rss_bytes",
            "used": "host_used_bytes", "total": "host_total_bytes"},
}
#: The gauge's columns a sample gives, on any device (a CPU row has None in those it lacks).
SAMPLED_COLUMNS = tuple(dict.fromkeys(c for kind in ROW_COLUMNS.values() for c in kind))


def scan_bytes(totals: Mapping[str, int] | None) -> tuple[int | None, dict[str, int] | None]:
    """The gauge's columns a holder scan gives, from its bytes per device (``Session.tensor_totals``): the CPU
    tensors, and the paged memory (``records.PAGED``) by GPU, ``cuda:0`` as samples name it; unknown before a scan.
    Every paged storage counts, not only the owners the holder list shows: NVML counts all of it in this process
    (``%cudamem status`` counts it so too)."""
    if totals is None:
        return None, None
    return int(totals.get("cpu", 0)), {d.removeprefix(PAGED): n for d, n in totals.items() if d.startswith(PAGED)}


@functools.cache
def segment_spec() -> dict[str, Any]:
    """``js/segments.js``'s ``SEGMENTS`` object (strict JSON between its first ``{`` and last ``}``)."""
    text = (js_dir() / "segments.js").read_text(encoding="utf-8")
    body = text[text.index("= {") + 2: text.rindex("}") + 1]
    return dict(json.loads(body))


#: Why there is no gauge outside a Jupyter kernel, and what gives the numbers there.
NO_FRONT_END = ("the gauge needs a Jupyter front end (JupyterLab, Notebook, VS Code, Colab); in a terminal, "
                "`%cudamem status` and `%cudamem report` give the numbers")


def in_kernel(shell: Any) -> bool:
    """True in a Jupyter kernel (JupyterLab, Notebook, VS Code, Colab); False in terminal IPython."""
    zmqshell = sys.modules.get("ipykernel.zmqshell")
    return zmqshell is not None and isinstance(shell, zmqshell.ZMQInteractiveShell)
