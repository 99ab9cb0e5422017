// The gauge's segment split, written once: the JavaScript gauge (layout.js) and nbmem.plot() (Python,
// nbmem/ui/frontend.py) both read this object, so a new slice of a device's bar is added here and nowhere else.
// Keep the object strict JSON (double quotes, no trailing commas, no comments inside it): Python parses it.
//
// Each segment: `key` (CSS and tests), `label` (shown beside the colour), `bytes` (a column of the device's row,
// or [a, "-", b] or [a, "-", b, "-", c]: a minus the others, at least 0, unknown if any is), `color` (hex) and
// `css` (the JupyterLab theme variable the gauge prefers). Rows use the gauge's column names
// (widget.snapshot_columns: allocated, reserved, process, others, used, total, tensors, paged, children). An
// `optional` segment is left out where it has no bytes: most notebooks have no paged memory, and a "0 B" line on
// every GPU would only be noise. `cpu_unscanned` and `gpu_unscanned` replace their `replaces` segments while their
// `scan` column, known only from the last holder scan, is unknown: the CPU tensors, or a GPU's paged memory (a
// bitsandbytes paged optimizer's state, in CUDA managed memory: NVML counts it in this process, torch does not);
// a GPU's block is then the non-PyTorch slice as it was before paged memory was named. `unsplit` covers what the
// device counts as used but no known segment explains; `free` ends the bar.

/** @type {import("./layout.js").SegmentSpec} */
export const SEGMENTS = {
  "gpu": [
    {"key": "allocated", "label": "torch allocated", "bytes": "allocated", "color": "#1976d2", "css": "--jp-brand-color1"},
    {"key": "cached", "label": "torch cached", "bytes": ["reserved", "-", "allocated"], "color": "#90caf9", "css": "--jp-brand-color3"},
    {"key": "paged", "label": "paged (bitsandbytes, CUDA managed)", "bytes": "paged", "optional": true, "color": "#ffb74d", "css": "--jp-warn-color2"},
    {"key": "nontorch", "label": "non-PyTorch (this process)", "bytes": ["process", "-", "reserved", "-", "paged"], "color": "#f57c00", "css": "--jp-warn-color1"},
    {"key": "children", "label": "child processes (this notebook)", "bytes": "children", "color": "#388e3c", "css": "--jp-success-color1"},
    {"key": "others", "label": "other processes", "bytes": "others", "color": "#d32f2f", "css": "--jp-error-color1"}
  ],
  "cpu": [
    {"key": "tensors", "label": "CPU tensors (last scan)", "bytes": "tensors", "color": "#1976d2", "css": "--jp-brand-color1"},
    {"key": "rest", "label": "rest of this process", "bytes": ["process", "-", "tensors"], "color": "#90caf9", "css": "--jp-brand-color3"},
    {"key": "others", "label": "other processes", "bytes": ["used", "-", "process"], "color": "#d32f2f", "css": "--jp-error-color1"}
  ],
  "cpu_unscanned": {"key": "rest", "label": "this process (RSS)", "bytes": "process", "color": "#90caf9", "css": "--jp-brand-color3", "scan": "tensors", "replaces": ["tensors", "rest"]},
  "gpu_unscanned": {"key": "nontorch", "label": "non-PyTorch (this process)", "bytes": ["process", "-", "reserved"], "color": "#f57c00", "css": "--jp-warn-color1", "scan": "paged", "replaces": ["paged", "nontorch"]},
  "unsplit": {"key": "unsplit", "label": "used, not split", "color": "#bdbdbd", "css": "--jp-border-color1"},
  "free": {"key": "free", "label": "free", "bytes": ["total", "-", "used"], "color": "#e0e0e0", "css": "--jp-layout-color3"}
};
