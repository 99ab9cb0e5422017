// The gauge's panel in JupyterLab's right sidebar, made by the page itself.
//
// A message to the kernel waits behind every queued cell (ipykernel handles comm messages between cells), so a
// gauge that asked the kernel for the sidebar reached it only after Run All had finished. The page needs no
// kernel for it: when the gauge's model arrives (anywidget's `initialize`, once per model and page), a JupyterLab
// page makes a sidecar model of its own, with no comm, whose one output is a view of the gauge; the sidecar
// extension adds that panel to the right sidebar. The kernel is told afterwards ("placed", when it gets to it).
// One panel per gauge model and page: closed when the model closes or its placement stops being "auto"; when
// the user closes the tab, the gauge goes back under the cell. A page loaded later makes its own panel again
// when the kernel restores the model to it.

import { pageSidebar, sidebarModel } from "./layout.js";

/** The front end's name, as the page's Jupyter config says ("JupyterLab", "Jupyter Notebook"), or "". */
export function appName() {
  try {
    const node = document.getElementById("jupyter-config-data");
    return node ? String(JSON.parse(node.textContent || "{}").appName || "") : "";
  } catch {
    return "";
  }
}

/**
 * One gauge's panel on this page. "closed": the user closed its tab; no other is made for that gauge.
 * @typedef {object} Panel
 * @property {"making" | "shown" | "closed"} state
 * @property {{close: () => unknown} | null} sidecar the page's sidecar model, once made
 */

// On globalThis, not in this module: anywidget may evaluate the module more than once on a page.
const KEY = Symbol.for("nbmem.sidebar-panels");

/** @returns {{panels: Map<string, Panel>, watchers: Map<string, Set<() => void>>}} */
function registry() {
  const g = /** @type {Record<symbol, any>} */ (/** @type {unknown} */ (globalThis));
  if (!g[KEY]) g[KEY] = { panels: new Map(), watchers: new Map() };
  return g[KEY];
}

/** @param {string} id */
function changed(id) {
  for (const fn of [...(registry().watchers.get(id) || [])]) fn();
}

/**
 * Whether this page shows gauge `id` in a panel of its own (or is making one).
 * @param {string} id
 * @returns {boolean}
 */
export function hasPanel(id) {
  const p = registry().panels.get(id);
  return p !== undefined && p.state !== "closed";
}

/**
 * Call `fn` whenever gauge `id`'s panel comes or goes; returns the call that stops it.
 * @param {string} id
 * @param {() => void} fn
 * @returns {() => void}
 */
export function watchPanel(id, fn) {
  const w = registry().watchers;
  if (!w.has(id)) w.set(id, new Set());
  const set = /** @type {Set<() => void>} */ (w.get(id));
  set.add(fn);
  return () => {
    set.delete(fn);
    if (!set.size) w.delete(id);
  };
}

/**
 * The part of the anywidget model the panel needs.
 * @typedef {object} PanelModel
 * @property {(name: string) => any} get
 * @property {(event: string, cb: () => void) => void} on
 * @property {(event: string, cb: () => void) => void} off
 * @property {(msg: object) => void} send
 * @property {{new_model: (spec: object, state: object) => Promise<{close: () => unknown}>}} widget_manager
 */

/**
 * Make gauge `id`'s panel, once.
 * @param {PanelModel} model
 * @param {string} id
 */
function open(model, id) {
  const { panels } = registry();
  if (panels.has(id)) return;
  /** @type {Panel} */
  const p = { state: "making", sidecar: null };
  panels.set(id, p);
  changed(id);
  const [spec, state] = sidebarModel(id, `nbmem-panel-${id}-${Math.random().toString(36).slice(2, 10)}`);
  Promise.resolve()
    .then(() => model.widget_manager.new_model(spec, state))
    .then((sidecar) => {
      if (panels.get(id) !== p) {
        sidecar.close(); // the gauge closed while its panel was being made
        return;
      }
      p.sidecar = sidecar;
      p.state = "shown";
      changed(id);
      model.send({ type: "placed", where: "sidebar" });
    })
    .catch((e) => {
      if (panels.get(id) === p) {
        panels.delete(id);
        changed(id);
      }
      console.warn("nbmem: the gauge stays under the cell (no sidebar panel could be made)", e);
    });
}

/**
 * Take gauge `id`'s panel away: its model closed, or it is placed elsewhere now.
 * @param {string} id
 */
export function closePanel(id) {
  const { panels } = registry();
  const p = panels.get(id);
  if (!p) return;
  panels.delete(id); // first: closing the sidecar removes the gauge's view there, which calls dismissPanel
  if (p.sidecar) p.sidecar.close();
  changed(id);
}

/**
 * The gauge's view in its panel went away while the gauge lives on: the user closed the tab. The gauge shows
 * under the cell again, and this page makes no other panel for it.
 * @param {string} id
 */
export function dismissPanel(id) {
  const p = registry().panels.get(id);
  if (!p || p.state !== "shown") return;
  p.state = "closed";
  const sidecar = p.sidecar;
  p.sidecar = null;
  if (sidecar) sidecar.close();
  changed(id);
}

/**
 * anywidget's `initialize`: once per gauge model on this page, before any view of it. Returns the cleanup that
 * runs when the model closes.
 * @param {{model: PanelModel}} ctx
 * @returns {(() => void) | undefined}
 */
export function initialize({ model }) {
  const id = String(model.get("gauge_id") || "");
  if (!id) return undefined;
  const sync = () => (pageSidebar(model.get("placement"), appName()) ? open(model, id) : closePanel(id));
  sync();
  model.on("change:placement", sync);
  return () => {
    model.off("change:placement", sync);
    closePanel(id);
  };
}
