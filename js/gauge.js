// The nbmem gauge's view (anywidget). Python writes every data trait; this module only draws them
// and sends typed messages back: a cleanup request, which Python checks against the findings it
// currently lists, and "rescan" for the holder list (panel.js sends the third, "placed"). Everything from the kernel that a user named (variables, dict keys, paths) goes
// into the DOM through textContent or attributes, never as HTML.
//
// anywidget loads a single ES module, so relative imports would not resolve: nbmem/widget.py serves
// format.js + layout.js + panel.js + this file concatenated, with the `import … from "./…"` lines dropped.

import { fmtBytes, fmtSeconds, isNA } from "./format.js";
import {
  CONFIRM_MS, agoLabel, cellSpans, codeParts, holderList, peakPercent, press, rows, scaleOf, scannedLabel, segmentColour, segments,
  seriesMax, sparkMax, sparkPath, sparkStart, viewKind, widths, limitWarning
} from "./layout.js";
import { dismissPanel, hasPanel, initialize, watchPanel } from "./panel.js";

/**
 * The part of the anywidget model this view uses.
 * @typedef {object} Model
 * @property {(name: string) => any} get
 * @property {(event: string, cb: () => void) => void} on
 * @property {(event: string, cb: () => void) => void} off
 * @property {(msg: object) => void} send
 */


const CSS = `
.nbmem-gauge { font-family: var(--jp-ui-font-family, sans-serif); font-size: var(--jp-ui-font-size1, 13px);
  color: var(--jp-ui-font-color1, #212121); background: var(--jp-layout-color1, #fff); padding: 8px;
  box-sizing: border-box; min-width: 220px; max-width: 600px; line-height: 1.4; }
.nbmem-gauge * { box-sizing: border-box; }
.nbmem-gauge h3 { font-size: var(--jp-ui-font-size1, 13px); margin: 10px 0 4px; font-weight: 600; }
.nbmem-gauge .nbmem-note { color: var(--jp-ui-font-color2, #616161); font-size: var(--jp-ui-font-size0, 11px);
  margin-bottom: 6px; }
.nbmem-gauge .nbmem-warning { color: var(--jp-warn-color0, #b45309); font-weight: 600; margin: 2px 0; }
.nbmem-gauge .nbmem-sub { font-weight: normal; color: var(--jp-ui-font-color2, #616161); font-size: var(--jp-ui-font-size0, 11px); }
.nbmem-gauge .nbmem-device { margin-bottom: 10px; }
.nbmem-gauge .nbmem-head { display: flex; flex-wrap: wrap; justify-content: space-between; align-items: baseline;
  column-gap: 8px; font-weight: 600; }
.nbmem-gauge .nbmem-holders-head { display: flex; flex-wrap: wrap; align-items: baseline; column-gap: 6px; }
.nbmem-gauge .nbmem-holders-head span { white-space: nowrap; }
.nbmem-gauge .nbmem-holders-head button { margin-left: auto; }
.nbmem-gauge .nbmem-head b { color: var(--jp-ui-font-color1, #212121); }
.nbmem-gauge .nbmem-bar { position: relative; display: flex; height: 14px; margin: 4px 0;
  border: 1px solid var(--jp-border-color1, #bdbdbd); background: var(--jp-layout-color2, #eee); }
.nbmem-gauge .nbmem-seg { height: 100%; }
.nbmem-gauge .nbmem-peak { position: absolute; top: -4px; bottom: -4px; width: 2px; margin-left: -1px;
  background: var(--jp-ui-font-color0, #000); }
.nbmem-gauge .nbmem-legend { list-style: none; margin: 4px 0 0; padding: 0; display: grid; column-gap: 16px;
  grid-template-columns: repeat(auto-fill, minmax(180px, 1fr)); }
.nbmem-gauge .nbmem-legend li { display: flex; align-items: center; gap: 6px; }
.nbmem-gauge .nbmem-swatch { width: 10px; height: 10px; flex: none; border: 1px solid var(--jp-border-color1, #bdbdbd); }
.nbmem-gauge .nbmem-value, .nbmem-gauge .nbmem-bytes { margin-left: auto; font-variant-numeric: tabular-nums;
  white-space: nowrap; }
.nbmem-gauge .nbmem-spark svg { display: block; width: 100%; height: 36px; background: var(--jp-layout-color2, #f5f5f5); }
.nbmem-gauge .nbmem-axis { display: flex; justify-content: space-between; gap: 4px; color: var(--jp-ui-font-color2, #616161);
  font-size: var(--jp-ui-font-size0, 11px); }
.nbmem-gauge .nbmem-procs { margin: 2px 0 0; padding-left: 16px; color: var(--jp-ui-font-color2, #616161); }
.nbmem-gauge .nbmem-cellrow { display: flex; flex-wrap: wrap; column-gap: 12px; }
.nbmem-gauge .nbmem-cellrow span { white-space: normal; }
.nbmem-gauge .nbmem-cellrow span:first-child { min-width: 3em; }
.nbmem-gauge .nbmem-holder { display: grid; grid-template-columns: 1fr auto; align-items: center; column-gap: 4px;
  padding: 3px 0; border-top: 1px solid var(--jp-border-color2, #e0e0e0); }
.nbmem-gauge .nbmem-name { grid-column: 1 / -1; overflow-wrap: anywhere; font-family: var(--jp-code-font-family, monospace);
  font-size: var(--jp-code-font-size, 13px); }
.nbmem-gauge .nbmem-meta { color: var(--jp-ui-font-color2, #616161); font-size: var(--jp-ui-font-size0, 11px); }
.nbmem-gauge .nbmem-meta b { color: var(--jp-ui-font-color1, #212121); font-weight: 600; }
.nbmem-gauge .nbmem-flag { color: var(--jp-warn-color0, #e65100); }
.nbmem-gauge .nbmem-also { grid-column: 1 / -1; color: var(--jp-ui-font-color2, #616161); font-size: var(--jp-ui-font-size0, 11px);
  overflow-wrap: anywhere; }
.nbmem-gauge .nbmem-members { grid-column: 1 / -1; font-size: var(--jp-ui-font-size0, 11px); }
.nbmem-gauge .nbmem-members summary { display: list-item; cursor: pointer; width: fit-content;
  color: var(--jp-ui-font-color2, #616161); }
.nbmem-gauge .nbmem-members summary:focus-visible { outline: 1px solid var(--jp-brand-color1, #1976d2); }
.nbmem-gauge .nbmem-members ul { list-style: none; margin: 2px 0 2px 12px; padding: 0; }
.nbmem-gauge .nbmem-members li { display: grid; grid-template-columns: 1fr auto; align-items: baseline; column-gap: 6px; }
.nbmem-gauge .nbmem-members code { overflow-wrap: anywhere; min-width: 0; }
.nbmem-gauge .nbmem-members .nbmem-what { grid-column: 1 / -1; padding-left: 1em; overflow-wrap: anywhere; }
.nbmem-gauge .nbmem-members .nbmem-what, .nbmem-gauge .nbmem-members .nbmem-more { color: var(--jp-ui-font-color2, #616161); }
.nbmem-gauge code { font-family: var(--jp-code-font-family, monospace); }
.nbmem-gauge .nbmem-buttons { white-space: nowrap; }
.nbmem-gauge button { font: inherit; font-size: var(--jp-ui-font-size0, 11px); padding: 1px 6px; margin: 1px;
  color: var(--jp-ui-font-color1, #212121); background: var(--jp-layout-color2, #eee);
  border: 1px solid var(--jp-border-color1, #bdbdbd); border-radius: 2px; cursor: pointer; }
.nbmem-gauge button:hover:enabled { background: var(--jp-layout-color3, #e0e0e0); }
.nbmem-gauge button:disabled { opacity: 0.45; cursor: default; }
.nbmem-gauge button[data-armed] { background: var(--jp-warn-color3, #ffe0b2); border-color: var(--jp-warn-color1, #f57c00);
  color: var(--jp-ui-font-color0, #000); }
.nbmem-gauge .nbmem-actions { display: flex; flex-wrap: wrap; gap: 4px; margin-top: 8px; }
.nbmem-gauge .nbmem-status { margin-top: 6px; min-height: 1.4em; }
.nbmem-gauge .nbmem-status[data-state=error] { color: var(--jp-error-color1, #d32f2f); }
.nbmem-gauge .nbmem-empty { color: var(--jp-ui-font-color2, #616161); }
`;

const SVG = "http://www.w3.org/2000/svg";
const SPARK_W = 300;
const SPARK_H = 40;

/**
 * An element with a class and text: the only way this module puts kernel strings into the page.
 * @param {string} tag
 * @param {string} [cls]
 * @param {string} [text]
 * @returns {HTMLElement}
 */
function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

/**
 * Text whose `code` parts (in backticks) show as code, as a fragment.
 * @param {string} text
 * @returns {DocumentFragment}
 */
function withCode(text) {
  const f = document.createDocumentFragment();
  for (const p of codeParts(text)) f.append(p.code ? h("code", "", p.text) : p.text);
  return f;
}

/**
 * @param {string} device
 * @returns {string}
 */
function seriesNames(device) {
  return device === "cpu" ? "RSS" : "allocated (line), reserved (faint)";
}

/**
 * A list of processes under a device's bar, a row each: PID, name, bytes; a child's command line as its tooltip.
 * @param {string} title
 * @param {string} role
 * @param {{pid: number, name: string, bytes: number|null, command?: string}[]} list
 * @returns {HTMLElement[]}
 */
function processList(title, role, list) {
  const ul = h("ul", "nbmem-procs");
  for (const p of list) {
    const li = h("li", "", `PID ${p.pid} ${p.name} · ${fmtBytes(p.bytes)}`);
    li.dataset.role = role;
    li.dataset.pid = String(p.pid);
    if (p.command) li.title = p.command;
    ul.append(li);
  }
  return [h("div", "nbmem-meta", title), ul];
}

/**
 * The bar, its legend and the peak for one device.
 * @param {import("./layout.js").DeviceRow} r
 * @param {Record<string, any>} procs other processes by device
 * @param {Record<string, any>} kids this notebook's child processes by device
 * @returns {HTMLElement}
 */
function deviceSection(r, procs, kids) {
  const sec = h("section", "nbmem-device");
  sec.dataset.device = r.device;
  const segs = segments(r);
  const scale = scaleOf(r, segs);
  const ws = widths(segs, scale);

  const head = h("div", "nbmem-head");
  const title = h("span", "", r.device === "cpu" ? "CPU" : r.device);
  if (r.model) title.append(" ", h("span", "nbmem-sub", r.model));
  const total = h("span", "nbmem-sub", `${r.device === "cpu" ? "RSS" : "this process"} `);
  const proc = h("b", "", fmtBytes(r.process));
  proc.dataset.role = "process";
  total.append(proc, ` / ${fmtBytes(r.total)}`);
  head.append(title, total);
  sec.append(head);
  const warning = limitWarning(r);
  if (warning) {
    sec.classList.add("nbmem-warn");
    const w = h("div", "nbmem-warning", `⚠ ${warning}`);
    w.setAttribute("role", "status");
    sec.append(w);
  }

  const bar = h("div", "nbmem-bar");
  bar.setAttribute("role", "img");
  bar.setAttribute("aria-label", segs.map((g) => `${g.label} ${fmtBytes(g.bytes)}`).join(", "));
  segs.forEach((g, i) => {
    if (ws[i] <= 0) return;
    const s = h("span", "nbmem-seg");
    s.dataset.seg = g.key;
    s.style.width = `${ws[i]}%`;
    s.style.background = segmentColour(g.key);
    s.title = `${g.label}: ${fmtBytes(g.bytes)}`;
    bar.append(s);
  });
  const pk = peakPercent(r, scale);
  if (pk !== null) {
    const m = h("span", "nbmem-peak");
    m.style.left = `${pk}%`;
    m.title = `session peak ${fmtBytes(r.peak)}`;
    bar.append(m);
  }
  sec.append(bar);

  const legend = h("ul", "nbmem-legend");
  for (const g of segs) {
    const li = h("li");
    li.dataset.seg = g.key;
    const sw = h("span", "nbmem-swatch");
    sw.style.background = segmentColour(g.key);
    const v = h("span", "nbmem-value", fmtBytes(g.bytes));
    v.dataset.role = "value";
    li.append(sw, h("span", "", g.label), v);
    legend.append(li);
  }
  const peak = h("li");
  peak.dataset.seg = "peak";
  const pv = h("span", "nbmem-value", fmtBytes(r.peak));
  pv.dataset.role = "value";
  const psw = h("span", "nbmem-swatch");
  psw.style.background = "var(--jp-ui-font-color0, #000)";
  peak.append(psw, h("span", "", r.device === "cpu" ? "session peak RSS" : "session peak allocated"), pv);
  legend.append(peak);
  sec.append(legend);

  const children = kids && kids[r.device];
  if (Array.isArray(children) && children.length) {
    sec.append(...processList("this notebook's child processes on this GPU:", "child-row", children));
  }
  const others = procs && procs[r.device];
  if (Array.isArray(others) && others.length) {
    sec.append(...processList("other processes on this GPU:", "process-row", others));
  }
  return sec;
}

/**
 * The sparkline of one device over the window, with monitored cells shaded.
 * @param {string} device
 * @param {Record<string, any>} hist
 * @param {{cell: number, start: number, end: number}[]} cells
 * @param {number} now epoch seconds of the latest sample
 * @returns {HTMLElement}
 */
function sparkline(device, hist, cells, now) {
  const wrap = h("div", "nbmem-spark");
  wrap.dataset.role = "sparkline";
  const window = Number(hist.window) || 300;
  const origin = Number(hist.t0) || now;
  const t = /** @type {number[]} */ (hist.t || []);
  const main = (hist.main && hist.main[device]) || [];
  const aux = (hist.aux && hist.aux[device]) || [];
  const t1 = now - origin;
  const box = { t0: sparkStart(t, t1, window), t1, width: SPARK_W, height: SPARK_H, vmax: sparkMax([main, aux]) };
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${SPARK_W} ${SPARK_H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `${device} memory, ${agoLabel(box.t1 - box.t0)} to now`);
  const rel = (cells || []).map((c) => ({ cell: c.cell, start: c.start - origin, end: c.end - origin }));
  for (const s of cellSpans(rel, box)) {
    const rect = document.createElementNS(SVG, "rect");
    rect.setAttribute("x", s.x.toFixed(1));
    rect.setAttribute("width", s.w.toFixed(1));
    rect.setAttribute("y", "0");
    rect.setAttribute("height", String(SPARK_H));
    rect.setAttribute("fill", "var(--jp-layout-color3, #e0e0e0)");
    rect.setAttribute("stroke", "var(--jp-border-color1, #bdbdbd)");
    rect.setAttribute("vector-effect", "non-scaling-stroke");
    rect.dataset.cell = String(s.cell);
    const title = document.createElementNS(SVG, "title");
    title.textContent = `cell [${s.cell}]`;
    rect.append(title);
    svg.append(rect);
  }
  for (const [series, colour, opacity] of [[aux, segmentColour("cached"), "1"], [main, segmentColour("allocated"), "1"]]) {
    const d = sparkPath(t, /** @type {(number|null)[]} */ (series), box);
    if (!d) continue;
    const path = document.createElementNS(SVG, "path");
    path.setAttribute("d", d);
    path.setAttribute("fill", "none");
    path.setAttribute("stroke", /** @type {string} */ (colour));
    path.setAttribute("stroke-width", "1.5");
    path.setAttribute("opacity", /** @type {string} */ (opacity));
    path.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(path);
  }
  wrap.append(svg);
  const axis = h("div", "nbmem-axis");
  axis.append(h("span", "", agoLabel(box.t1 - box.t0)),
    h("span", "", `${seriesNames(device)} · max ${fmtBytes(seriesMax([main, aux]))}`),
    h("span", "", "now"));
  wrap.append(axis);
  return wrap;
}

/**
 * The one line a view under the cell shows once the gauge is in the sidebar.
 * @param {HTMLElement} el
 * @returns {() => void}
 */
function pointer(el) {
  const line = h("div", "nbmem-pointer");
  line.append(withCode("nbmem: the live memory gauge is in the right sidebar (`%cudamem gauge --inline` puts it here)."));
  line.style.cssText = "font: 12px var(--jp-ui-font-family, sans-serif); opacity: .7; padding: 2px 0";
  el.append(line);
  return () => line.remove();
}

const view = {
  initialize,

  /**
   * Draws the gauge, or a pointer to it; redrawn when it moves (its `placement` changes, or this page's
   * sidebar panel for it comes or goes).
   * @param {{model: Model, el: HTMLElement}} ctx
   * @returns {() => void} cleanup, run when the view goes away
   */
  render({ model, el }) {
    const id = String(model.get("gauge_id") || "");
    const inSidebar = () => el.closest("#jp-right-stack") !== null;
    let wasInSidebar = false;
    let shown = "";
    let undraw = () => {};
    const draw = () => {
      const side = inSidebar();
      wasInSidebar ||= side;
      const kind = viewKind(model.get("placement"), side, hasPanel(id));
      if (kind === shown) return;
      undraw();
      shown = kind;
      undraw = kind === "pointer" ? pointer(el) : view.gauge({ model, el });
    };
    draw();
    model.on("change:placement", draw);
    const unwatch = watchPanel(id, draw);
    // A view is made before the page attaches it (sidecar's panel does so later): where it sits is known
    // once it is in the document, so look again until then.
    /** @type {ReturnType<typeof setTimeout> | undefined} */
    let settle;
    let tries = 0;
    const look = () => {
      draw();
      if (!el.isConnected && ++tries < 200) settle = setTimeout(look, 50);
    };
    if (!el.isConnected) settle = setTimeout(look, 0);
    return () => {
      clearTimeout(settle);
      model.off("change:placement", draw);
      unwatch();
      undraw();
      // The view in this page's panel goes while the gauge lives: its tab was closed (when the gauge itself
      // closed, its panel is gone already and this does nothing).
      if (wasInSidebar) dismissPanel(id);
    };
  },

  /**
   * The gauge itself, drawn into `el` and kept up to date from the model.
   * @param {{model: Model, el: HTMLElement}} ctx
   * @returns {() => void} cleanup
   */
  gauge({ model, el }) {
    const root = h("div", "nbmem-gauge");
    const style = h("style");
    style.textContent = CSS;
    const note = h("div", "nbmem-note");
    note.dataset.role = "note";
    const devices = h("div");
    const lastCell = h("div");
    lastCell.dataset.role = "last-cell";
    const holders = h("div");
    holders.dataset.role = "holders";
    const actions = h("div", "nbmem-actions");
    const status = h("div", "nbmem-status");
    status.dataset.role = "status";
    status.setAttribute("aria-live", "polite");
    // The buttons and their result sit above the holder list, so they stay in view however long it is.
    root.append(style, note, devices, lastCell, actions, status, holders);
    el.append(root);

    /** @type {{key: string, at: number} | null} */
    let armed = null;
    /** @type {ReturnType<typeof setTimeout> | undefined} */
    let disarmTimer;
    /** @type {Map<string, string>} request id -> what it asked for */
    const pending = new Map();
    const viewId = Math.random().toString(36).slice(2, 10);
    let seq = 0;

    /**
     * A button whose click sends a cleanup request; destructive ones need a second click.
     * @param {string} action
     * @param {string} label
     * @param {string} confirmLabel
     * @param {{id?: string, destructive: boolean, disabled?: string}} opts disabled: why, as a tooltip
     * @returns {HTMLButtonElement}
     */
    function button(action, label, confirmLabel, opts) {
      const key = `${action}:${opts.id || ""}`;
      const b = /** @type {HTMLButtonElement} */ (h("button", "", label));
      b.type = "button";
      b.dataset.action = action;
      b.dataset.key = key;
      if (opts.disabled) {
        b.disabled = true;
        b.title = opts.disabled;
        return b;
      }
      const isArmed = armed !== null && armed.key === key;
      if (isArmed) {
        b.dataset.armed = "1";
        b.textContent = confirmLabel;
      }
      b.title = opts.destructive ? `${confirmLabel.replace(/\?$/, "")} (click twice to confirm)` : label;
      b.onclick = () => {
        if (opts.destructive) {
          const next = press(armed, key, Date.now());
          armed = next.armed;
          clearTimeout(disarmTimer);
          if (armed) disarmTimer = setTimeout(() => { armed = null; drawButtons(); }, CONFIRM_MS);
          drawButtons();
          if (!next.fire) return;
        }
        const req = `${viewId}-${++seq}`;
        pending.set(req, confirmLabel.replace(/\?$/, ""));
        /** @type {Record<string, string>} */
        const msg = action === "rescan" ? { type: "rescan", req } : { type: "cleanup", req, action };
        if (opts.id) msg.id = opts.id;
        model.send(msg);
        drawStatus();
      };
      return b;
    }

    // How old the holder list is, on the kernel's clock; it ages with every sample.
    const scanned = h("span", "nbmem-sub");
    scanned.dataset.role = "scanned";
    function drawScanned() {
      scanned.textContent = scannedLabel(model.get("holders_at"), Number((model.get("snapshot") || {}).t));
    }

    function drawNote() {
      const text = model.get("note") || "";
      note.textContent = text;
      note.hidden = !text;
    }

    function drawDevices() {
      const snap = model.get("snapshot") || {};
      const hist = model.get("history") || {};
      const cells = model.get("cells") || [];
      const procs = model.get("processes") || {};
      const kids = model.get("children") || {};
      const now = Number(snap.t) || Date.now() / 1000;
      root.dataset.updated = String(snap.t || "");
      devices.replaceChildren(...rows(snap).map((r) => {
        const sec = deviceSection(r, procs, kids);
        sec.insertBefore(sparkline(r.device, hist, cells, now), sec.querySelector(".nbmem-legend"));
        return sec;
      }));
    }

    function drawLastCell() {
      const c = model.get("last_cell") || {};
      lastCell.replaceChildren();
      if (isNA(c.cell)) return;
      lastCell.append(h("h3", "", `Last monitored cell [${c.cell}] · ${fmtSeconds(c.duration_s)}${c.error ? ` · ${c.error}` : ""}`));
      for (const r of c.rows || []) {
        const line = h("div", "nbmem-cellrow");
        line.dataset.device = r.device;
        const peak = isNA(r.peak) ? (r.peak_note || "NA") : fmtBytes(r.peak);
        line.append(h("span", "", r.device), h("span", "", `Δ ${r.what || ""} ${fmtBytes(r.delta, { signed: true })}`),
          h("span", "", `peak ${peak}`));
        lastCell.append(line);
        if (r.peak_line) {
          const at = h("div", "nbmem-meta", `peak at ${r.peak_line}`);
          at.dataset.role = "peak-line";
          lastCell.append(at);
        }
      }
    }

    function drawButtons() {
      // Redraws replace the buttons and rows, so a keyboard user's focus moves to the new copy of
      // the control it was on (data-key), instead of falling back to the page.
      const active = /** @type {Document | ShadowRoot} */ (root.getRootNode()).activeElement;
      const key = active instanceof HTMLElement && root.contains(active) ? active.dataset.key : undefined;
      drawHolders();
      actions.replaceChildren(
        button("outputs", "clear outputs", "clear outputs?", { destructive: true }),
        button("traceback", "clear traceback", "clear traceback?", { destructive: true }),
        button("gc", "gc + empty cache", "gc + empty cache", { destructive: false }),
      );
      if (key) {
        const again = [...root.querySelectorAll("[data-key]")].find((e) => e instanceof HTMLElement && e.dataset.key === key);
        if (again instanceof HTMLElement) again.focus({ preventScroll: true });
      }
    }

    /** @type {Set<string>} holder ids whose member list is open; it outlives redraws and a row's absence */
    const expanded = new Set();

    function drawHolders() {
      // The page is the truth about what the user opened or closed since the last draw.
      for (const d of holders.querySelectorAll("details[data-id]")) {
        const id = /** @type {HTMLElement} */ (d).dataset.id || "";
        if (/** @type {HTMLDetailsElement} */ (d).open) expanded.add(id);
        else expanded.delete(id);
      }
      const list = holderList(model.get("holders"), model.get("holders_note"));
      const head = h("h3", "nbmem-holders-head");
      head.append(h("span", "", "Top holders"));
      head.append(scanned, button("rescan", "rescan", "rescan", { destructive: false }));
      drawScanned();
      holders.replaceChildren(head);
      if (list.empty) {
        const empty = h("div", "nbmem-empty");
        empty.dataset.role = "holders-note";
        empty.append(withCode(list.empty));
        holders.append(empty);
        return;
      }
      for (const x of list.rows) {
        const row = h("div", "nbmem-holder");
        row.dataset.role = "holder";
        row.dataset.id = x.id;
        if (x.title) row.title = x.title;
        const name = h("div", "nbmem-name", x.name);
        name.dataset.role = "name";
        row.append(name);
        if (x.what) {
          const what = h("div", "nbmem-also");
          what.dataset.role = "what";
          what.append(withCode(x.what));
          row.append(what);
        }
        if (x.also) {
          const also = h("div", "nbmem-also", x.also);
          also.dataset.role = "also";
          row.append(also);
        }
        const meta = h("div", "nbmem-meta");
        const bytes = h("b", "", x.bytes);
        bytes.dataset.role = "bytes";
        meta.append(bytes, ` · ${x.where}`);
        if (x.graph) {
          const f = h("span", "nbmem-flag", "holds graph");
          f.dataset.role = "graph";
          f.title = "keeps its autograd graph (and the tensors saved for backward) alive";
          meta.append(" · ", f);
        }
        const btns = h("div", "nbmem-buttons");
        btns.append(
          button("del", x.del.label, x.del.confirm, { id: x.id, destructive: true, disabled: x.del.disabled }),
          button("to_cpu", x.toCpu.label, x.toCpu.confirm, { id: x.id, destructive: true, disabled: x.toCpu.disabled }),
        );
        row.append(meta, btns);
        if (x.summary) row.append(memberList(x));
        holders.append(row);
      }
    }

    /**
     * A holder's biggest members, behind a native disclosure (focusable, Enter or Space opens it).
     * @param {import("./layout.js").HolderText} x
     * @returns {HTMLElement}
     */
    function memberList(x) {
      const d = /** @type {HTMLDetailsElement} */ (h("details", "nbmem-members"));
      d.dataset.role = "members";
      d.dataset.id = x.id;
      d.open = expanded.has(x.id);
      const summary = h("summary", "", x.summary);
      summary.dataset.key = `members:${x.id}`;
      const ul = h("ul");
      for (const m of x.members) {
        const li = h("li");
        li.dataset.role = "member";
        li.append(h("code", "", m.name), h("span", "nbmem-bytes", m.bytes));
        if (m.what) li.append(h("span", "nbmem-what", m.what));
        ul.append(li);
      }
      if (x.more) {
        const li = h("li", "nbmem-more", x.more);
        li.dataset.role = "more";
        ul.append(li);
      }
      d.append(summary, ul);
      return d;
    }

    function drawStatus() {
      const a = model.get("action") || {};
      if (a.req && pending.has(a.req)) pending.delete(a.req);
      status.dataset.state = "";
      if (pending.size) {
        status.textContent = `pending… ${[...pending.values()].join(", ")} (runs when the kernel is idle)`;
        status.dataset.state = "pending";
      } else if (a.req) {
        if (a.ok && a.text) {
          status.textContent = `${a.label}: ${a.text}`;
          status.dataset.state = "done";
        } else if (a.ok) {
          const back = !isNA(a.freed_reserved) && a.freed_reserved !== 0
            ? `; ${fmtBytes(a.freed_reserved)} of cache returned to the driver` : "";
          const still = a.still ? ` (${a.still})` : "";
          status.textContent = `${a.label}: freed ${fmtBytes(a.freed)}${back}${still}`;
          status.dataset.state = "done";
        } else {
          status.textContent = `${a.label}: ${a.error}`;
          status.dataset.state = "error";
        }
      } else {
        status.textContent = "";
      }
    }

    // One update from Python (a hold_sync batch) fires several change events in a row; draw each
    // part once per batch, after the events.
    /** @type {Set<() => void>} */
    const dirty = new Set();
    /** @param {() => void} fn */
    const later = (fn) => () => {
      if (!dirty.size) queueMicrotask(() => { const fns = [...dirty]; dirty.clear(); fns.forEach((f) => f()); });
      dirty.add(fn);
    };
    /** @type {[string, () => void][]} */
    const handlers = [
      ["change:note", later(drawNote)],
      ["change:snapshot", later(drawDevices)],
      ["change:history", later(drawDevices)],
      ["change:cells", later(drawDevices)],
      ["change:processes", later(drawDevices)],
      ["change:children", later(drawDevices)],
      ["change:last_cell", later(drawLastCell)],
      ["change:holders", later(drawButtons)],
      ["change:holders_note", later(drawButtons)],
      ["change:holders_at", later(drawScanned)],
      ["change:snapshot", later(drawScanned)],
      ["change:action", later(drawStatus)],
    ];
    for (const [ev, fn] of handlers) model.on(ev, fn);
    drawNote();
    drawDevices();
    drawLastCell();
    drawButtons();
    drawStatus();

    return () => {
      for (const [ev, fn] of handlers) model.off(ev, fn);
      clearTimeout(disarmTimer);
      root.remove();
    };
  },
};

export default view;
