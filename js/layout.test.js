// Layout logic of the gauge: segments, widths, the peak mark, the sparkline, confirmation and holder rows.
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  CONFIRM_MS, SIDECAR, agoLabel, cellSpans, codeParts, diff, holderList, holderText, peakPercent, press, rows, scaleOf,
  pageSidebar, scannedLabel, segments, sidebarModel, seriesMax, sparkMax, sparkPath, sparkStart, viewKind, widths, limitWarning,
} from "./layout.js";

const GiB = 2 ** 30;
const MiB = 2 ** 20;

/** @param {Partial<import("./layout.js").DeviceRow>} r */
const row = (r) => ({
  device: "cuda:0", model: "", allocated: null, reserved: null, process: null, others: null,
  used: null, total: null, tensors: null, peak: null, children: 0, ...r,
});

/** @param {import("./layout.js").Segment[]} segs */
const byKey = (segs) => Object.fromEntries(segs.map((s) => [s.key, s.bytes]));

test("rows() turns the column snapshot into rows; missing entries are unknown", () => {
  const rs = rows({ device: ["cpu", "cuda:0"], process: [5, 7], total: [100] });
  assert.equal(rs.length, 2);
  assert.equal(rs[0].process, 5);
  assert.equal(rs[1].total, null);
  assert.equal(rs[1].allocated, null);
  assert.deepEqual(rows(null), []);
});

test("a GPU bar has the six segments, in order, that add up to the total", () => {
  const r = row({ allocated: 2 * GiB, reserved: 3 * GiB, process: 3.5 * GiB, children: GiB, others: 3 * GiB,
    used: 7.5 * GiB, total: 10 * GiB });
  const segs = segments(r);
  assert.deepEqual(segs.map((s) => s.key), ["allocated", "cached", "nontorch", "children", "others", "free"]);
  assert.deepEqual(byKey(segs), { allocated: 2 * GiB, cached: GiB, nontorch: 0.5 * GiB, children: GiB, others: 3 * GiB,
    free: 2.5 * GiB });
  const ws = widths(segs, scaleOf(r, segs));
  assert.deepEqual(ws, [20, 10, 5, 10, 30, 25]);
  assert.ok(segs.every((s) => s.label.length > 0), "every colour has a text label");
});

test("paged memory (a bitsandbytes paged optimizer) is its own slice, carved out of non-PyTorch", () => {
  const r = row({ allocated: 500 * MiB, reserved: 600 * MiB, process: 1000 * MiB, paged: 300 * MiB, others: 0,
    used: 1000 * MiB, total: 2000 * MiB });
  const segs = segments(r);
  assert.deepEqual(segs.map((s) => s.key), ["allocated", "cached", "paged", "nontorch", "children", "others", "free"]);
  assert.deepEqual(byKey(segs), { allocated: 500 * MiB, cached: 100 * MiB, paged: 300 * MiB, nontorch: 100 * MiB,
    children: 0, others: 0, free: 1000 * MiB });
  assert.equal(segs[2].label, "paged (bitsandbytes, CUDA managed)");
  assert.deepEqual(widths(segs, scaleOf(r, segs)), [25, 5, 15, 5, 0, 0, 50]);
  // More paged memory than NVML counts beyond torch's (part of it paged out to the host): non-PyTorch is 0, not less.
  assert.equal(byKey(segments({ ...r, paged: 450 * MiB })).nontorch, 0);
});

test("no paged memory found, or no scan yet: the GPU bar is split as it always was", () => {
  const base = { allocated: 500 * MiB, reserved: 600 * MiB, process: 1000 * MiB, others: 0, used: 1000 * MiB,
    total: 2000 * MiB };
  const before = { allocated: 500 * MiB, cached: 100 * MiB, nontorch: 400 * MiB, children: 0, others: 0,
    free: 1000 * MiB };
  for (const paged of [0, null, undefined]) {
    const segs = segments(row({ ...base, paged }));
    assert.deepEqual(byKey(segs), before, `paged ${paged}`);
    assert.ok(!segs.some((s) => s.key === "unsplit"), "an unknown paged figure is not 'not split'");
  }
  assert.equal(rows({ device: ["cuda:0"], process: [5] })[0].paged, null, "an older kernel sends no column");
  // Unknown per-process numbers: paged memory the scan found still shows; the rest of `used` is "not split".
  const s = byKey(segments(row({ ...base, process: null, others: null, paged: 300 * MiB })));
  assert.deepEqual(s, { allocated: 500 * MiB, cached: 100 * MiB, paged: 300 * MiB, nontorch: null, children: 0,
    others: null, unsplit: 100 * MiB, free: 1000 * MiB });
});

test("diff subtracts each of several numbers, unknown if any is, never below 0", () => {
  assert.equal(diff(10, 3, 2), 5);
  assert.equal(diff(10, 3, null), null);
  assert.equal(diff(10, 8, 5), 0);
});

test("child processes that cannot be told from others (a container) are NA, inside 'not split'", () => {
  const r = row({ allocated: GiB, reserved: GiB, process: 2 * GiB, children: null, others: 3 * GiB, used: 5 * GiB,
    total: 8 * GiB });
  const s = byKey(segments(r));
  assert.equal(s.children, null);
  assert.ok(!("unsplit" in s), "others already counts every process but this one: nothing is left to split");
  assert.equal(rows({ device: ["cuda:0"], process: [5] })[0].children, null, "an older kernel sends no column");
});

test("unknown per-process numbers stay NA and the rest of `used` becomes one 'not split' segment", () => {
  const r = row({ allocated: GiB, reserved: 2 * GiB, process: null, others: null, used: 6 * GiB, total: 8 * GiB });
  const s = byKey(segments(r));
  assert.equal(s.nontorch, null);
  assert.equal(s.others, null);
  assert.equal(s.unsplit, 4 * GiB);
  assert.equal(s.free, 2 * GiB);
  assert.deepEqual(widths(segments(r), 8 * GiB), [12.5, 12.5, 0, 0, 0, 50, 25]);
});

test("CUDA not initialised: torch numbers are NA, not 0, and take no room", () => {
  const r = row({ process: 0, others: GiB, used: GiB, total: 4 * GiB });
  const segs = segments(r);
  const s = byKey(segs);
  assert.equal(s.allocated, null);
  assert.equal(s.cached, null);
  assert.equal(s.nontorch, null);
  assert.equal(s.others, GiB);
  assert.equal(widths(segs, 4 * GiB)[0], 0);
});

test("reads that are out of step never give negative segments or more than 100%", () => {
  assert.equal(diff(5, 7), 0);
  assert.equal(diff(null, 7), null);
  const r = row({ allocated: 3 * GiB, reserved: 2.9 * GiB, process: 2 * GiB, others: 9 * GiB, used: 9.5 * GiB, total: 10 * GiB });
  const ws = widths(segments(r), 10 * GiB);
  assert.ok(ws.every((w) => w >= 0));
  assert.ok(Math.abs(ws.reduce((a, b) => a + b, 0) - 100) < 1e-9);
});

test("the CPU bar: CPU tensors, rest of the process, other processes, free", () => {
  const r = row({ device: "cpu", process: 3 * GiB, tensors: GiB, used: 10 * GiB, total: 16 * GiB, peak: 4 * GiB });
  const segs = segments(r);
  assert.deepEqual(byKey(segs), { tensors: GiB, rest: 2 * GiB, others: 7 * GiB, free: 6 * GiB });
  assert.equal(peakPercent(r, scaleOf(r, segs)), 25);
});

test("the CPU bar before any leak scan shows RSS as one block", () => {
  const r = row({ device: "cpu", process: 3 * GiB, used: 10 * GiB, total: 16 * GiB });
  assert.deepEqual(byKey(segments(r)), { rest: 3 * GiB, others: 7 * GiB, free: 6 * GiB });
});

test("without a total the bar is scaled to what is known and the peak", () => {
  const r = row({ device: "cpu", process: 300 * MiB, tensors: 100 * MiB, peak: 400 * MiB });
  const segs = segments(r);
  assert.equal(scaleOf(r, segs), 400 * MiB);
  assert.deepEqual(widths(segs, scaleOf(r, segs)), [25, 50, 0, 0]);
  assert.equal(peakPercent(r, 400 * MiB), 100);
  assert.equal(peakPercent(row({}), 0), null);
  assert.deepEqual(widths(segments(row({})), 0), [0, 0, 0, 0, 0, 0]);
});

test("sparkline: max with headroom; NA breaks the line; y is flipped", () => {
  assert.equal(seriesMax([[1, null, 3], [2]]), 3);
  assert.equal(sparkMax([[null], []]), null);
  assert.equal(sparkMax([[0, 0]]), 1);
  assert.ok(Math.abs(/** @type {number} */ (sparkMax([[100, 50]])) - 110) < 1e-9);
  const box = { t0: 0, t1: 10, width: 100, height: 40, vmax: 100 };
  assert.equal(sparkPath([0, 5, 10], [0, 50, 100], box), "M0.0 40.0 L50.0 20.0 L100.0 0.0");
  assert.equal(sparkPath([0, 5, 10], [0, null, 100], box), "M0.0 40.0 M100.0 0.0");
  assert.equal(sparkPath([-5, 0], [10, 10], box), "M0.0 36.0", "points before the window are dropped");
  assert.equal(sparkPath([0, 1], [1, 2], { ...box, vmax: null }), "");
});

test("cell spans are clipped to the window and at least one unit wide", () => {
  const box = { t0: 100, t1: 200, width: 300 };
  const spans = cellSpans([{ cell: 1, start: 50, end: 90 }, { cell: 2, start: 90, end: 110 },
    { cell: 3, start: 150, end: 150.01 }, { cell: 4, start: 190, end: 250 }], box);
  assert.deepEqual(spans.map((s) => s.cell), [2, 3, 4]);
  assert.deepEqual([spans[0].x, spans[0].w], [0, 30]);
  assert.equal(spans[1].w, 1);
  assert.ok(Math.abs(spans[2].x + spans[2].w - 300) < 1e-9);
});

test("destructive buttons fire on the second press of the same button, within the time limit", () => {
  let s = press(null, "del:a", 0);
  assert.equal(s.fire, false);
  s = press(s.armed, "del:a", 100);
  assert.equal(s.fire, true);
  assert.equal(s.armed, null);
  s = press(press(null, "del:a", 0).armed, "del:b", 10);
  assert.equal(s.fire, false, "another button re-arms instead of firing");
  assert.equal(s.armed?.key, "del:b");
  s = press(press(null, "outputs:", 0).armed, "outputs:", CONFIRM_MS + 1);
  assert.equal(s.fire, false, "a stale arm does not fire");
});

test("a young session's sparkline starts at its first sample, at least 30 s back", () => {
  assert.equal(sparkStart([-10, -5, 0], 0, 300), -30);
  assert.equal(sparkStart([-200, -5, 0], 0, 300), -200);
  assert.equal(sparkStart([-400, 0], 0, 300), -300);
  assert.equal(sparkStart([], 0, 300), -30);
  assert.equal(agoLabel(60), "−60 s");
  assert.equal(agoLabel(300), "−5 min");
});

test("automatic placement: a JupyterLab page makes its own sidebar panel; every other page keeps the gauge in the cell", () => {
  assert.equal(pageSidebar("auto", "JupyterLab"), true);
  assert.equal(pageSidebar("auto", "Jupyter Notebook"), false); // Notebook 7: no sidebar sidecar can use
  assert.equal(pageSidebar("auto", ""), false); // VS Code, Colab: no Jupyter page config at all
  assert.equal(pageSidebar("inline", "JupyterLab"), false); // asked for under the cell
  assert.equal(pageSidebar("sidebar", "JupyterLab"), false); // the kernel's own sidecar shows it: no second panel
  // Under the cell: the gauge, unless it is in the sidebar (this page's panel or the kernel's sidecar).
  assert.equal(viewKind("auto", false, false), "gauge");
  assert.equal(viewKind("inline", false, false), "gauge");
  assert.equal(viewKind("auto", false, true), "pointer");
  assert.equal(viewKind("sidebar", false, false), "pointer");
  // In the sidebar, always the gauge.
  assert.equal(viewKind("auto", true, true), "gauge");
  assert.equal(viewKind("sidebar", true, false), "gauge");
});

test("the page's panel is a sidecar model with no comm, showing a view of the gauge's own model", () => {
  const [spec, state] = sidebarModel("g1", "p1");
  assert.deepEqual(spec, { ...SIDECAR, model_id: "p1" });
  assert.equal(spec.model_name, "SidecarModel");
  assert.equal(spec.model_module, "@jupyter-widgets/jupyterlab-sidecar");
  assert.equal(/** @type {any} */ (state).title, "nbmem");
  assert.deepEqual(/** @type {any} */ (state).outputs, [{ output_type: "display_data", metadata: {},
    data: { "application/vnd.jupyter.widget-view+json": { model_id: "g1", version_major: 2, version_minor: 0 } } }]);
});

test("the holder list says how old it is, on the kernel's clock", () => {
  assert.equal(scannedLabel(null, 100), "");
  assert.equal(scannedLabel(100, Number.NaN), "");
  assert.equal(scannedLabel(100, 101), "scanned just now");
  assert.equal(scannedLabel(110, 100), "scanned just now", "a scan stamped after the sample is not in the future");
  assert.equal(scannedLabel(100, 145), "scanned 45 s ago");
  assert.equal(scannedLabel(100, 100 + 600), "scanned 10 min ago");
  assert.equal(scannedLabel(100, 100 + 3 * 3600), "scanned 3 h ago");
});

/**
 * A holder row as an nbmem without owner rows sends it (no members, more, more_bytes or also).
 * @param {Partial<import("./layout.js").Holder>} x
 * @returns {import("./layout.js").Holder}
 */
const holder = (x) => ({
  id: "cuda:0:a1", name: "kept", kind: "namespace", device: "cuda:0", bytes: 32 * MiB, what: "tensor", graph: false,
  roots: ["kept"], to_cpu: true, del_label: "del kept", hint: "", ...x,
});

test("an owner row lists its biggest members and sums up the rest", () => {
  const t = holderText(holder({
    id: "cuda:0:m", name: "model", bytes: 3 * GiB, graph: true, del_label: "del model", also: ["trainer", "ema"],
    members: [{ name: "model.0.weight", bytes: GiB, what: "tensor" },
      { name: "model.1.cache", bytes: 512 * MiB, what: "3 tensors, 512 MiB" }],
    more: 1234, more_bytes: 1.5 * GiB,
  }));
  assert.equal(t.name, "model");
  assert.equal(t.bytes, "3.00 GiB");
  assert.equal(t.where, "cuda:0", "a plain variable's kind goes unsaid");
  assert.equal(t.also, "also held by trainer, ema");
  assert.deepEqual(t.del, { label: "del model", confirm: "del model?", disabled: "" });
  assert.equal(t.toCpu.confirm, "model.cpu()?");
  assert.equal(t.summary, "1,236 members");
  assert.deepEqual(t.members, [{ name: "model.0.weight", bytes: "1.00 GiB", what: "" },
    { name: "model.1.cache", bytes: "512 MiB", what: "3 tensors, 512 MiB" }]);
  assert.equal(t.more, "and 1,234 more (1.50 GiB)");
  assert.ok(t.graph);
  assert.equal(holderText(holder({ what: "Sequential: 42M parameters" })).what, "Sequential: 42M parameters");
  assert.equal(t.what, "", "a lone tensor's 'tensor' goes unsaid: the bytes say how big");
});

test("a row from an older nbmem (no members, more or also) shows as before", () => {
  const t = holderText(holder({}));
  assert.deepEqual([t.summary, t.members, t.more, t.also], ["", [], "", ""]);
  assert.deepEqual(t.del, { label: "del kept", confirm: "del kept?", disabled: "" });
  assert.deepEqual(t.toCpu, { label: "to CPU", confirm: "kept.cpu()?", disabled: "" });
  const cpu = holderText(holder({ device: "cpu", to_cpu: false, del_label: "" }));
  assert.equal(cpu.toCpu.disabled, "already on the CPU");
  assert.deepEqual(cpu.del, { label: "del", confirm: "del?", disabled: "no top-level name to delete" });
});

test("a row whose one member is itself has nothing to expand; members without more need no sum", () => {
  const self = holderText(holder({ members: [{ name: "kept", bytes: 32 * MiB, what: "tensor" }], more: 0, more_bytes: 0 }));
  assert.deepEqual([self.summary, self.members, self.more], ["", [], ""]);
  const one = holderText(holder({ name: "d", members: [{ name: "d['k']", bytes: MiB, what: "tensor" }], more: 0 }));
  assert.equal(one.summary, "1 member");
  assert.equal(one.more, "");
  const unsized = holderText(holder({ name: "xs", members: [], more: 3 }));
  assert.deepEqual([unsized.summary, unsized.more], ["3 members", "and 3 more"], "more without more_bytes");
});

test("the kinds that del cannot free say what does, in the kernel's words (records.HOLDER_KINDS)", () => {
  const mod = holderText(holder({ name: "pkg.sub.cache", kind: "module", kind_label: "module", del_label: "",
    no_del: "an attribute of module pkg.sub: set it to None", to_cpu: false }));
  assert.equal(mod.where, "cuda:0 · module");
  assert.equal(mod.del.disabled, "an attribute of module pkg.sub: set it to None");
  const out = holderText(holder({ name: "Out[4]", kind: "output", kind_label: "output", del_label: "",
    no_del: "held by the output history: use “clear outputs”", to_cpu: false }));
  assert.equal(out.where, "cuda:0 · output");
  assert.equal(out.del.disabled, "held by the output history: use “clear outputs”");
  const old = holderText(holder({ name: "Out[4]", kind: "output", del_label: "", to_cpu: false }));
  assert.equal(old.where, "cuda:0", "a kernel that sends no label: the device alone");
  assert.equal(old.del.disabled, "no top-level name to delete");
});

test("the notebook's state has no del button: it says the command that deletes it by name", () => {
  const t = holderText(holder({ name: "model", state: "model", del_label: "", roots: ["model", "opt", "sched"],
    no_del: "the notebook's state (model): delete it by name, %cudamem clean model opt sched" }));
  assert.deepEqual(t.del, {
    label: "del", confirm: "del?",
    disabled: "the notebook's state (model): delete it by name, %cudamem clean model opt sched",
  });
  const leak = holderText(holder({ name: "x", del_label: "del x, losses, loss", roots: ["x", "losses", "loss"] }));
  assert.deepEqual(leak.del, { label: "del x, losses, loss", confirm: "del x, losses, loss?", disabled: "" });
});

test("an empty holder list shows the kernel's holders_note, or by default that nothing passed the threshold", () => {
  const note = "no holder scan has run yet: `%cudamem leaks` or `%cudamem on` scans the notebook";
  assert.deepEqual(holderList([], note), { rows: [], empty: note });
  assert.deepEqual(holderList([], ""), { rows: [], empty: "nothing above the threshold" });
  assert.deepEqual(holderList(undefined, undefined), { rows: [], empty: "nothing above the threshold" });
  const shown = holderList([holder({})], note);
  assert.equal(shown.empty, "", "the note stands in for the list, never beside it");
  assert.deepEqual(shown.rows.map((r) => r.name), ["kept"]);
  assert.deepEqual(codeParts(note), [{ text: "no holder scan has run yet: ", code: false },
    { text: "%cudamem leaks", code: true }, { text: " or ", code: false }, { text: "%cudamem on", code: true },
    { text: " scans the notebook", code: false }]);
  assert.deepEqual(codeParts("nothing above the threshold (1.00 MiB)"),
    [{ text: "nothing above the threshold (1.00 MiB)", code: false }]);
  assert.deepEqual(codeParts("a ` b"), [{ text: "a ` b", code: false }], "an unpaired backtick stays");
});

test("the CPU row warns near the memory limit, and only then", () => {
  const base = { device: "cpu", process: 3.7 * 2 ** 30, total: 4 * 2 ** 30, limit: "cgroup v2 memory.max" };
  assert.match(limitWarning({ ...base, near_limit: true }), /^near the memory limit: RSS 3\.70 GiB of 4\.00 GiB \(cgroup v2 memory\.max\)/);
  assert.equal(limitWarning({ ...base, near_limit: false }), "");
  assert.equal(limitWarning({ ...base, near_limit: null }), "", "unknown is not a warning");
  assert.equal(limitWarning({ ...base, device: "cuda:0", near_limit: true }), "");
});
