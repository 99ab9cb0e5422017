// The gauge's segment split, written once: the JavaScript gauge (layout.js) and nbmem.plot() (Python,
// nbmem/ui/frontend.py) both read this object, so a new slice of a device's bar is added here and nowhere else.
// Keep the object strict JSON (double quotes, no trailing commas, no comments inside it): Python parses it.
//
// Each segment: `key` (CSS and tests), `label` (shown beside the colour), `bytes` (a column of the device's row,
// or [a, "-", b]: a - b, at least 0, unknown if either is), `color` (hex) and `css` (the JupyterLab theme variable
// the gauge prefers). Rows use the gauge's column names (widget.snapshot_columns: allocated, reserved, process,
// others, used, total, tensors, children). `cpu_unscanned` replaces the `replaces` segments while the CPU tensors
// are unknown; `unsplit` covers what the device counts as used but no known segment explains; `free` ends the bar.

/** @type {import("./layout.js").SegmentSpec} */
export const SEGMENTS = {
  "gpu": [
    {"key": "allocated", "label": "torch allocated", "bytes": "allocated", "color": "#1976d2", "css": "--jp-brand-color1"},
    {"key": "cached", "label": "torch cached", "bytes": ["reserved", "-", "allocated"], "color": "#90caf9", "css": "--jp-brand-color3"},
    {"key": "nontorch", "label": "non-PyTorch (this process)", "bytes": ["process", "-", "reserved"], "color": "#f57c00", "css": "--jp-warn-color1"},
    {"key": "children", "label": "child processes (this notebook)", "bytes": "children", "color": "#388e3c", "css": "--jp-success-color1"},
    {"key": "others", "label": "other processes", "bytes": "others", "color": "#d32f2f", "css": "--jp-error-color1"}
  ],
  "cpu": [
    {"key": "tensors", "label": "CPU tensors (last scan)", "bytes": "tensors", "color": "#1976d2", "css": "--jp-brand-color1"},
    {"key": "rest", "label": "rest of this process", "bytes": ["process", "-", "tensors"], "color": "#90caf9", "css": "--jp-brand-color3"},
    {"key": "others", "label": "other processes", "bytes": ["used", "-", "process"], "color": "#d32f2f", "css": "--jp-error-color1"}
  ],
  "cpu_unscanned": {"key": "rest", "label": "this process (RSS)", "bytes": "process", "color": "#90caf9", "css": "--jp-brand-color3", "replaces": ["tensors", "rest"]},
  "unsplit": {"key": "unsplit", "label": "used, not split", "color": "#bdbdbd", "css": "--jp-border-color1"},
  "free": {"key": "free", "label": "free", "bytes": ["total", "-", "used"], "color": "#e0e0e0", "css": "--jp-layout-color3"}
};
