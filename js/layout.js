// Layout logic of the gauge, kept apart from the DOM so `node --test` can check it: which segments a
// device's bar has and how wide they are, where the peak mark sits, the sparkline's path and the
// cell spans under it, the two-click confirmation of destructive buttons, and the words of each row
// of the holder list.

import { SEGMENTS } from "./segments.js";
import { fmtBytes, isNA } from "./format.js";

/**
 * One device, as the Python side publishes it (one entry of each column of the `snapshot` trait).
 * @typedef {object} DeviceRow
 * @property {string} device "cpu" or "cuda:N"
 * @property {string} model
 * @property {number|null} allocated torch allocated (GPU)
 * @property {number|null} reserved torch reserved (GPU)
 * @property {number|null} process this process: NVML process usage (GPU) or RSS (CPU)
 * @property {number|null} others other processes (GPU; on the CPU it is derived from `used`)
 * @property {number|null} used used on the device (NVML) or host RAM in use
 * @property {number|null} total device memory (NVML) or host RAM
 * @property {string|null} limit the CPU row: where its total comes from when a container's limit sets it
 * @property {boolean|null} near_limit the CPU row: RSS at 90 % or more of the memory limit (warn)
 * @property {number|null} tensors CPU tensors reachable from the notebook (CPU, as of the last scan)
 * @property {number|null} paged a GPU's paged memory (CUDA managed, a bitsandbytes paged optimizer's state) as of
 *   the last scan: 0 where it found none, null before a scan, on the CPU, and from a kernel too old to send it
 * @property {number|null} peak session peak: torch allocated (GPU) or RSS (CPU)
 * @property {number|null} children this notebook's child processes on the GPU (NVML); null on the CPU, or
 *   where they cannot be told from other processes (a container), or from a kernel too old to send it
 */

/**
 * @typedef {object} Segment
 * @property {string} key stable hook for CSS and tests
 * @property {string} label text shown beside the colour
 * @property {number|null} bytes null: unknown, shown as NA
 */

// A row's columns: nbmem/ui/frontend.py's GAUGE_COLUMNS, as the kernel sends them (tests/test_segments.py
// checks the two lists, and the DeviceRow properties above, are the same).
const COLUMNS = ["device", "model", "allocated", "reserved", "process", "others", "used", "total", "tensors", "paged",
  "peak", "children", "limit", "near_limit"];

/**
 * Rows from the column-oriented snapshot; a missing column or entry reads as unknown.
 * @param {Record<string, unknown[]> | null | undefined} snapshot
 * @returns {DeviceRow[]}
 */
export function rows(snapshot) {
  const devices = /** @type {string[]} */ ((snapshot && snapshot.device) || []);
  return devices.map((_, i) => {
    /** @type {Record<string, unknown>} */
    const row = {};
    for (const c of COLUMNS) {
      const col = snapshot ? snapshot[c] : undefined;
      const v = Array.isArray(col) ? col[i] : undefined;
      row[c] = v === undefined ? null : v;
    }
    return /** @type {DeviceRow} */ (row);
  });
}

/**
 * `a - b - ...`, unknown if any is; clamped at 0 because the numbers come from different reads (allocator vs
 * NVML, or the last holder scan) that can be out of step.
 * @param {number|null} a
 * @param {...(number|null)} rest
 * @returns {number|null}
 */
export function diff(a, ...rest) {
  if (isNA(a) || rest.some(isNA)) return null;
  return Math.max(0, rest.reduce((left, b) => left - /** @type {number} */ (b), a));
}

/**
 * @typedef {object} SegmentDef
 * @property {string} key
 * @property {string} label
 * @property {string | [string, "-", string] | [string, "-", string, "-", string]} [bytes] a row column, or the
 *   first minus the others (at least 0)
 * @property {boolean} [optional] left out where it has no bytes (0 or unknown)
 * @property {string} color
 * @property {string} css
 * @property {string} [scan] an unscanned block's column: the block stands in for `replaces` while it is unknown
 * @property {string[]} [replaces]
 */
/**
 * @typedef {object} SegmentSpec
 * @property {SegmentDef[]} gpu
 * @property {SegmentDef[]} cpu
 * @property {SegmentDef} cpu_unscanned
 * @property {SegmentDef} gpu_unscanned
 * @property {SegmentDef} unsplit
 * @property {SegmentDef} free
 */

/**
 * A segment's bytes from the row, as segments.js says: a column, or `a - b - ...` (unknown if any is).
 * @param {DeviceRow} r
 * @param {SegmentDef["bytes"]} how
 * @returns {number|null}
 */
function bytesOf(r, how) {
  const col = (/** @type {string} */ c) => /** @type {number|null} */ (/** @type {Record<string, unknown>} */ (r)[c] ?? null);
  if (how === undefined) return null;
  if (typeof how === "string") return col(how);
  const [first, ...rest] = how.filter((_, i) => i % 2 === 0).map(col);  // the odd places hold the "-"
  return diff(first, ...rest);
}

/**
 * The bar's segments in drawing order, as segments.js defines them. When some in-use part is unknown (no
 * per-process numbers in a container, say), what the device counts as used but nothing explains becomes one
 * "not split" segment, so the bar still adds up instead of showing a made-up zero.
 * @param {DeviceRow} r
 * @returns {Segment[]}
 */
export function segments(r) {
  const seg = (/** @type {SegmentDef} */ d) => ({ key: d.key, label: d.label, bytes: bytesOf(r, d.bytes) });
  const cpu = r.device === "cpu";
  const defs = cpu ? SEGMENTS.cpu : SEGMENTS.gpu;
  /** @type {Segment[]} */
  let inUse = defs.map(seg);
  const u = cpu ? SEGMENTS.cpu_unscanned : SEGMENTS.gpu_unscanned;
  if (isNA(bytesOf(r, u.scan)) && !isNA(r.process)) {
    // Without a scan the process is not split by it: RSS as one block (CPU), non-PyTorch as it was (GPU).
    const at = inUse.findIndex((g) => (u.replaces || []).includes(g.key));
    inUse = inUse.filter((g) => !(u.replaces || []).includes(g.key));
    inUse.splice(Math.max(0, at), 0, seg(u));
  }
  const optional = new Set(defs.filter((d) => d.optional).map((d) => d.key));
  inUse = inUse.filter((g) => !optional.has(g.key) || (!isNA(g.bytes) && g.bytes > 0));
  const known = inUse.reduce((s, g) => s + (isNA(g.bytes) ? 0 : g.bytes), 0);
  if (inUse.some((g) => isNA(g.bytes)) && !isNA(r.used) && r.used > known) {
    inUse.push({ key: SEGMENTS.unsplit.key, label: SEGMENTS.unsplit.label, bytes: r.used - known });
  }
  inUse.push(seg(SEGMENTS.free));
  return inUse;
}

/**
 * A segment's colour: the JupyterLab theme's variable, the hex of segments.js where there is none.
 * @param {string} key
 * @returns {string}
 */
export function segmentColour(key) {
  const u = SEGMENTS.unsplit;
  if (key === u.key) return `repeating-linear-gradient(45deg, var(${u.css}, ${u.color}) 0 3px, transparent 3px 6px)`;
  const all = [...SEGMENTS.gpu, ...SEGMENTS.cpu, SEGMENTS.cpu_unscanned, SEGMENTS.gpu_unscanned, SEGMENTS.free];
  const d = all.find((g) => g.key === key) || SEGMENTS.free;
  return `var(${d.css}, ${d.color})`;
}

/**
 * What 100% of the bar stands for: the device's total, or when that is unknown the larger of what
 * is known in use and the peak (the bar then shows proportions only).
 * @param {DeviceRow} r
 * @param {Segment[]} segs
 * @returns {number}
 */
export function scaleOf(r, segs) {
  if (!isNA(r.total) && r.total > 0) return r.total;
  const used = segs.filter((g) => g.key !== "free").reduce((s, g) => s + (isNA(g.bytes) ? 0 : g.bytes), 0);
  return Math.max(used, isNA(r.peak) ? 0 : r.peak);
}

/**
 * Segment widths in percent of `scale`; unknown segments take no room, and the total never exceeds
 * 100 even when the reads disagree.
 * @param {Segment[]} segs
 * @param {number} scale
 * @returns {number[]}
 */
export function widths(segs, scale) {
  let left = 100;
  return segs.map((g) => {
    if (isNA(g.bytes) || !(scale > 0)) return 0;
    const w = Math.min(left, Math.max(0, (100 * g.bytes) / scale));
    left -= w;
    return w;
  });
}

/**
 * Where the session-peak mark sits, in percent of the bar, or null when there is no peak to mark.
 * The peak counts from the left edge: torch allocated on a GPU, RSS on the CPU.
 * @param {DeviceRow} r
 * @param {number} scale
 * @returns {number|null}
 */
export function peakPercent(r, scale) {
  if (isNA(r.peak) || !(scale > 0)) return null;
  return Math.min(100, Math.max(0, (100 * r.peak) / scale));
}

/**
 * The largest known value over several series, or null when none is known.
 * @param {(number|null)[][]} series
 * @returns {number|null}
 */
export function seriesMax(series) {
  let m = null;
  for (const s of series) for (const v of s) if (!isNA(v) && (m === null || v > m)) m = v;
  return m;
}

/**
 * The top of the sparkline's y axis: the window's largest value plus 10% headroom (so the line
 * does not run along the top edge), or null when nothing in the window is known.
 * @param {(number|null)[][]} series
 * @returns {number|null}
 */
export function sparkMax(series) {
  const m = seriesMax(series);
  if (m === null) return null;
  return m > 0 ? m * 1.1 : 1;
}

/**
 * An SVG path through the points of one series; an unknown value breaks the line (no fake zero).
 * x spans [t0, t1] over `width`; y maps 0..vmax to height..0.
 * @param {number[]} t seconds, relative to the same origin as t0 and t1
 * @param {(number|null)[]} v
 * @param {{t0: number, t1: number, width: number, height: number, vmax: number|null}} box
 * @returns {string}
 */
export function sparkPath(t, v, box) {
  const { t0, t1, width, height, vmax } = box;
  if (vmax === null || !(vmax > 0) || !(t1 > t0)) return "";
  const parts = [];
  let pen = false;
  for (let i = 0; i < t.length; i++) {
    const y = v[i];
    if (isNA(y) || t[i] < t0 || t[i] > t1) {
      pen = false;
      continue;
    }
    const px = ((t[i] - t0) / (t1 - t0)) * width;
    const py = height - (Math.min(y, vmax) / vmax) * height;
    parts.push(`${pen ? "L" : "M"}${px.toFixed(1)} ${py.toFixed(1)}`);
    pen = true;
  }
  return parts.join(" ");
}

/**
 * Where the sparkline starts: `window` seconds before `t1`, or for a young session at its first
 * sample (but at least `minSpan` back), so the line fills the width instead of hugging the right edge.
 * @param {number[]} t sample times, oldest first
 * @param {number} t1 now, on the same clock
 * @param {number} window
 * @param {number} [minSpan]
 * @returns {number}
 */
export function sparkStart(t, t1, window, minSpan = 30) {
  const first = t.length ? t[0] : t1;
  return Math.max(t1 - window, Math.min(first, t1 - minSpan));
}

/**
 * The left end of the time axis as text: "−45 s", "−5 min".
 * @param {number} seconds
 * @returns {string}
 */
export function agoLabel(seconds) {
  return seconds < 120 ? `−${Math.round(seconds)} s` : `−${Math.round(seconds / 60)} min`;
}

/**
 * Monitored cells inside the sparkline's window, as x ranges (a cell shorter than a pixel still
 * gets one, so every boundary shows).
 * @param {{cell: number, start: number, end: number}[]} cells epoch seconds
 * @param {{t0: number, t1: number, width: number}} box same clock as the cells
 * @returns {{cell: number, x: number, w: number}[]}
 */
export function cellSpans(cells, box) {
  const { t0, t1, width } = box;
  if (!(t1 > t0)) return [];
  const k = width / (t1 - t0);
  return (cells || [])
    .filter((c) => c.end >= t0 && c.start <= t1)
    .map((c) => {
      const x = (Math.max(c.start, t0) - t0) * k;
      const x1 = (Math.min(c.end, t1) - t0) * k;
      return { cell: c.cell, x, w: Math.max(1, x1 - x) };
    });
}

/** How long a destructive button stays armed after its first click. */
export const CONFIRM_MS = 4000;

/**
 * The two-click confirmation: the first press of a button arms it, a second press of the same
 * button within CONFIRM_MS fires. Pressing another button re-arms that one instead.
 * @param {{key: string, at: number} | null} armed
 * @param {string} key
 * @param {number} now ms
 * @returns {{armed: {key: string, at: number} | null, fire: boolean}}
 */
export function press(armed, key, now) {
  if (armed && armed.key === key && now - armed.at <= CONFIRM_MS) return { armed: null, fire: true };
  return { armed: { key, at: now }, fire: false };
}

/**
 * What one view of the gauge shows: the gauge, or one line saying it is in the sidebar (a view under the
 * cell while the gauge is shown in JupyterLab's right sidebar, by the kernel's sidecar or by this page).
 * @param {string} placement the model's placement: "auto", "sidebar" or "inline"
 * @param {boolean} inSidebar whether this view sits in JupyterLab's right sidebar
 * @param {boolean} pagePanel whether this page shows the gauge in a sidebar panel of its own
 * @returns {"gauge" | "pointer"}
 */
export function viewKind(placement, inSidebar, pagePanel) {
  return !inSidebar && (placement === "sidebar" || pagePanel) ? "pointer" : "gauge";
}

/**
 * Whether this page shows the gauge in a right-sidebar panel of its own. With automatic placement the kernel
 * shows it under the cell, because only the page knows its front end: a JupyterLab page has the sidebar (the
 * sidecar extension draws into it) and makes the panel itself, at once, without a round trip to a kernel that
 * may be busy with queued cells; Notebook 7, VS Code and Colab have none it can use, and there the gauge stays
 * under the cell with nothing to make and nothing to fail in the console.
 * @param {string} placement the model's placement
 * @param {string} appName the page's `appName` from #jupyter-config-data ("" when there is none: VS Code, Colab)
 * @returns {boolean}
 */
export function pageSidebar(placement, appName) {
  return placement === "auto" && appName === "JupyterLab";
}

/** The sidecar extension's front-end model, as sidecar 0.8 registers it. */
export const SIDECAR = {
  model_name: "SidecarModel", model_module: "@jupyter-widgets/jupyterlab-sidecar", model_module_version: "1.1.0",
  view_name: "SidecarView", view_module: "@jupyter-widgets/jupyterlab-sidecar", view_module_version: "1.1.0",
};

/**
 * The arguments of `widget_manager.new_model` for a sidebar panel that shows the gauge: a sidecar model made by
 * the page alone (no comm, so nothing waits on the kernel), titled "nbmem", whose one output is a view of the
 * gauge's own model.
 * @param {string} gaugeId the gauge model's id
 * @param {string} panelId a fresh id for the panel's model
 * @returns {[Record<string, string>, Record<string, unknown>]}
 */
export function sidebarModel(gaugeId, panelId) {
  const view = { model_id: gaugeId, version_major: 2, version_minor: 0 };
  return [
    { ...SIDECAR, model_id: panelId },
    { title: "nbmem", outputs: [{ output_type: "display_data", data: { "application/vnd.jupyter.widget-view+json": view },
      metadata: {} }] },
  ];
}

/**
 * How long ago the holder scan ran, in words; both times on the kernel's clock (the browser's may differ).
 * @param {number | null | undefined} at epoch seconds of the scan, null before one
 * @param {number} now epoch seconds of the latest sample
 * @returns {string}
 */
export function scannedLabel(at, now) {
  if (isNA(at) || !Number.isFinite(now)) return "";
  const s = Math.max(0, now - at);
  if (s < 2) return "scanned just now";
  if (s < 90) return `scanned ${Math.round(s)} s ago`;
  if (s < 90 * 60) return `scanned ${Math.round(s / 60)} min ago`;
  return `scanned ${Math.round(s / 3600)} h ago`;
}

/**
 * One of the biggest things a holder row's owner keeps alive.
 * @typedef {object} Member
 * @property {string} name the path a user would type, e.g. "model.0.weight"
 * @property {number} bytes
 * @property {string} what the size in words ("tensor": one tensor's storage, nothing to add)
 */

/**
 * A holder from the last leak scan, as Python lists it: one row per owner, the name a user typed.
 * The keys after `hint` are newer; a row from an older nbmem lacks them and shows as before.
 * @typedef {object} Holder
 * @property {string} id
 * @property {string} name `model`, `losses`, `Out[4]`, `<traceback train_step>`, `mymod.cache`
 * @property {string} kind "namespace" | "module" | "output" | "traceback"
 * @property {string} [kind_label] the kind's word beside the device ("output"; "" for a variable), from the kernel
 * @property {string} [no_del] why there is no del button and what frees it instead, from the kernel
 * @property {string} device
 * @property {number} bytes
 * @property {string} what the size in words (views, groups of small tensors, graphs)
 * @property {boolean} graph
 * @property {string[]} roots top-level names `del` removes
 * @property {boolean} to_cpu whether "to CPU" applies
 * @property {string} del_label what the del button does, e.g. "del losses, loss" ("" when it cannot)
 * @property {string} [state] what the notebook meant to keep ("model", "optimizer"...): no del button
 * @property {string} hint
 * @property {Member[]} [members] the biggest first, at most a handful
 * @property {number} [more] members not listed
 * @property {number} [more_bytes] their bytes
 * @property {string[]} [also] other names that also hold some of its memory
 */

/**
 * What a holder's button says and does: its label, the label while it asks to confirm, and why it
 * is disabled ("" when it is not).
 * @typedef {object} ButtonText
 * @property {string} label
 * @property {string} confirm
 * @property {string} disabled
 */

/**
 * Everything one holder row shows, as text (the DOM is gauge.js's business).
 * @typedef {object} HolderText
 * @property {string} id
 * @property {string} name
 * @property {string} title the hint, as the row's tooltip
 * @property {string} bytes
 * @property {string} where device, and the kind when it is not a plain variable
 * @property {boolean} graph
 * @property {string} what what the owner holds, in words ("Sequential: 42M parameters"), or ""
 * @property {string} also "also held by trainer", or ""
 * @property {ButtonText} del
 * @property {ButtonText} toCpu
 * @property {string} summary what the expander says ("3 members"); "" when there is nothing to expand
 * @property {{name: string, bytes: string, what: string}[]} members
 * @property {string} more "and 12 more (1.20 GiB)", or ""
 */

/**
 * A list the kernel sent, or [] when it sent something else (an older nbmem sends nothing).
 * @template T
 * @param {T[] | undefined} v
 * @returns {T[]}
 */
const listOf = (v) => (Array.isArray(v) ? v : []);

/**
 * A count as Python's `f"{n:,}"` prints it.
 * @param {number} n
 * @returns {string}
 */
const count = (n) => n.toLocaleString("en-US");

/**
 * The words of one holder row. A row whose only member is the owner itself has nothing to expand.
 * @param {Holder} x
 * @returns {HolderText}
 */
export function holderText(x) {
  const members = listOf(x.members);
  const more = Number(x.more) > 0 ? Number(x.more) : 0;
  const also = listOf(x.also);
  const total = members.length + more;
  const onlyItself = more === 0 && members.length === 1 && members[0].name === x.name;
  // The button says exactly which variables it deletes, before and while it asks for confirmation.
  const delLabel = x.del_label || "del";
  return {
    id: x.id,
    name: x.name,
    title: x.hint || "",
    bytes: fmtBytes(x.bytes),
    // Each kind's word and why it has no *del* come from the kernel (records.HOLDER_KINDS), written once there.
    where: [x.device, x.kind_label || ""].filter(Boolean).join(" · "),
    graph: Boolean(x.graph),
    what: x.what && x.what !== "tensor" ? x.what : "",
    also: also.length ? `also held by ${also.join(", ")}` : "",
    del: { label: delLabel, confirm: `${delLabel}?`, disabled: x.del_label ? "" : x.no_del || "no top-level name to delete" },
    toCpu: {
      label: "to CPU",
      confirm: `${x.name}.cpu()?`,
      disabled: x.to_cpu ? "" : x.device === "cpu" ? "already on the CPU" : "only a top-level tensor or module moves",
    },
    summary: total && !onlyItself ? `${count(total)} member${total === 1 ? "" : "s"}` : "",
    members: onlyItself ? [] : members.map((m) => ({
      name: m.name, bytes: fmtBytes(m.bytes), what: m.what && m.what !== "tensor" ? m.what : "",
    })),
    more: more ? `and ${count(more)} more${isNA(x.more_bytes) ? "" : ` (${fmtBytes(x.more_bytes)})`}` : "",
  };
}

/**
 * The holder list as shown: its rows, or when there are none the line shown instead (the kernel's
 * `holders_note`, which says whether a scan ran at all, or by default that nothing passed the threshold).
 * @param {Holder[] | null | undefined} holders
 * @param {string | null | undefined} note
 * @returns {{rows: HolderText[], empty: string}}
 */
export function holderList(holders, note) {
  const rows = (Array.isArray(holders) ? holders : []).map(holderText);
  return { rows, empty: rows.length ? "" : note || "nothing above the threshold" };
}

/**
 * Text with `code` in backticks, cut into plain and code parts (the backticks dropped); text with an
 * unpaired backtick stays one plain part.
 * @param {string} text
 * @returns {{text: string, code: boolean}[]}
 */
export function codeParts(text) {
  const parts = text.split("`");
  if (parts.length % 2 === 0) return [{ text, code: false }];
  return parts.map((t, i) => ({ text: t, code: i % 2 === 1 })).filter((p) => p.text);
}

/**
 * The CPU row's warning when the kernel nears its memory limit: past it, the kernel is killed, not told.
 * @param {DeviceRow} r
 * @returns {string}
 */
export function limitWarning(r) {
  if (r.device !== "cpu" || r.near_limit !== true) return "";
  const of = isNA(r.total) ? "" : ` of ${fmtBytes(r.total)}`;
  return `near the memory limit: RSS ${fmtBytes(r.process)}${of}${r.limit ? ` (${r.limit})` : ""}; past it the kernel is killed`;
}
