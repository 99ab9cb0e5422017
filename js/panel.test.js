// The page's own sidebar panel: one per gauge and page, made without the kernel, gone with the gauge.
import assert from "node:assert/strict";
import { test } from "node:test";

import { closePanel, dismissPanel, hasPanel, initialize, watchPanel } from "./panel.js";

/** @param {string} appName */
function page(appName) {
  const config = { textContent: JSON.stringify({ appName }) };
  /** @type {any} */ (globalThis).document = { getElementById: (/** @type {string} */ id) => (id === "jupyter-config-data" ? config : null) };
}

/**
 * A gauge model as anywidget hands it to `initialize`, with a widget manager that makes sidecar models.
 * @param {string} id
 * @param {string} placement
 * @param {{fail?: boolean}} [opts]
 */
function gauge(id, placement, opts = {}) {
  /** @type {Record<string, any>} */
  const state = { gauge_id: id, placement };
  /** @type {Map<string, Set<() => void>>} */
  const on = new Map();
  const made = /** @type {{spec: any, state: any, closed: boolean}[]} */ ([]);
  const sent = /** @type {object[]} */ ([]);
  const model = {
    get: (/** @type {string} */ k) => state[k],
    on: (/** @type {string} */ e, /** @type {() => void} */ cb) => { if (!on.has(e)) on.set(e, new Set()); on.get(e)?.add(cb); },
    off: (/** @type {string} */ e, /** @type {() => void} */ cb) => { on.get(e)?.delete(cb); },
    send: (/** @type {object} */ m) => { sent.push(m); },
    widget_manager: {
      new_model: async (/** @type {any} */ spec, /** @type {any} */ st) => {
        if (opts.fail) throw new Error("no sidecar extension");
        const m = { spec, state: st, closed: false };
        made.push(m);
        return { close: () => { m.closed = true; } };
      },
    },
  };
  /** @param {string} v */
  const place = (v) => {
    state.placement = v;
    for (const cb of on.get("change:placement") || []) cb();
  };
  return { model, made, sent, place, listeners: () => [...on.values()].reduce((n, s) => n + s.size, 0) };
}

const settle = () => new Promise((r) => setTimeout(r, 0));

test("a JupyterLab page makes one panel showing the gauge, then tells the kernel", async () => {
  page("JupyterLab");
  const g = gauge("g1", "auto");
  let changes = 0;
  const unwatch = watchPanel("g1", () => { changes += 1; });
  const cleanup = initialize({ model: g.model });
  assert.ok(hasPanel("g1"), "a view drawn before the panel is made already points to it");
  assert.deepEqual(g.sent, [], "nothing waits on the kernel");
  await settle();
  assert.equal(g.made.length, 1);
  assert.equal(g.made[0].spec.model_name, "SidecarModel");
  assert.equal(g.made[0].state.outputs[0].data["application/vnd.jupyter.widget-view+json"].model_id, "g1");
  assert.deepEqual(g.sent, [{ type: "placed", where: "sidebar" }]);
  initialize({ model: g.model }); // the module evaluated again on the same page: still one panel
  await settle();
  assert.equal(g.made.length, 1);
  // The gauge closes (%cudamem gauge, --inline, %unload_ext, a re-run %load_ext): its panel goes with it.
  assert.ok(cleanup);
  cleanup();
  assert.ok(!hasPanel("g1"));
  assert.equal(g.made[0].closed, true);
  assert.ok(changes >= 3, "views were told each time");
  unwatch();
  closePanel("g1");
});

test("placed by hand, or another front end: no panel", async () => {
  for (const [app, placement] of [["JupyterLab", "inline"], ["JupyterLab", "sidebar"], ["Jupyter Notebook", "auto"],
    ["", "auto"]]) {
    page(app);
    const g = gauge(`h-${app}-${placement}`, placement);
    const cleanup = initialize({ model: g.model });
    await settle();
    assert.equal(g.made.length, 0, `${app} ${placement}`);
    assert.ok(!hasPanel(`h-${app}-${placement}`));
    cleanup?.();
  }
});

test("placement leaving auto closes the panel; the user closing its tab brings the gauge back under the cell", async () => {
  page("JupyterLab");
  const g = gauge("g2", "auto");
  const cleanup = initialize({ model: g.model });
  await settle();
  g.place("inline");
  assert.ok(!hasPanel("g2"));
  assert.equal(g.made[0].closed, true);
  g.place("auto");
  await settle();
  assert.equal(g.made.length, 2);
  assert.ok(hasPanel("g2"));
  dismissPanel("g2"); // its view in the sidebar went away while the gauge lives: the tab was closed
  assert.ok(!hasPanel("g2"));
  assert.equal(g.made[1].closed, true);
  g.place("auto");
  await settle();
  assert.equal(g.made.length, 2, "no panel forced back on a user who closed it");
  cleanup?.();
  assert.equal(g.listeners(), 0);
});

test("where no sidecar model can be made, the gauge stays under the cell and the kernel hears nothing", async () => {
  page("JupyterLab");
  const g = gauge("g3", "auto", { fail: true });
  const warn = console.warn;
  const warned = /** @type {unknown[]} */ ([]);
  console.warn = (...a) => { warned.push(a); };
  try {
    const cleanup = initialize({ model: g.model });
    await settle();
    await settle();
    assert.ok(!hasPanel("g3"));
    assert.deepEqual(g.sent, []);
    assert.equal(warned.length, 1);
    cleanup?.();
  } finally {
    console.warn = warn;
  }
});
