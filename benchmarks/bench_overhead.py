"""What nbmem costs, measured side by side in one process: training throughput, per-cell overhead,
peak exactness, footprint, widget traffic and load time. Prints one summary line per figure, last.

    python benchmarks/bench_overhead.py --device cuda          # the figures in RESULTS.md
    python benchmarks/bench_overhead.py --device cpu --quick   # a smoke run anywhere

Every ratio comes from interleaved A/B pairs (A = without, B = with) in the same process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import types

from harness import Quiet, cell, line, new_shell, print_summary  # benchmarks/ is on sys.path when run as a script
from IPython.core.interactiveshell import InteractiveShell

SIZES: list[int] = []  # --sizes: namespace sizes for the per-cell figures


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


# -- what is compared -------------------------------------------------------------------------------
def nbmem_on(sh: InteractiveShell, gauge: bool, lines: bool = False, trace: bool = False) -> None:
    cell(sh, "%load_ext nbmem")
    if trace:
        cell(sh, "%config Nbmem.trace = True")
    cell(sh, "%cudamem on" + (" --lines" if lines else ""))
    if gauge:  # no front end here: make the gauge directly; it publishes to a comm all the same
        cell(sh, "from nbmem.ipython.root import _ACTIVE as _A\nfrom nbmem.ui.widget import Gauge as _G\n"
                 "_gauge = _G(_A[get_ipython()].session, shell=get_ipython())")


def nbmem_off(sh: InteractiveShell) -> None:
    if "_gauge" in sh.user_ns:
        cell(sh, "_gauge.close()\ndel _gauge")
    cell(sh, "%unload_ext nbmem")


def ipyx_on(sh: InteractiveShell) -> None:
    cell(sh, "from ipyexperiments import IPyExperimentsPytorch as _X\n_ipyx = _X(exp_enable=False)")


def ipyx_off(sh: InteractiveShell) -> None:
    cell(sh, "_ipyx.cl.stop()\ndel _ipyx")


TRAIN_SETUP = """
import torch
_dev = {dev!r}
model = torch.nn.Sequential(*[torch.nn.Linear({width}, {width}) for _ in range({depth})]).to(_dev)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
xb = torch.randn({batch}, {width}, device=_dev)
def sync():
    if _dev == "cuda": torch.cuda.synchronize()
"""
#: The two cells of the issue: many tiny kernels (Python and launch bound), and a few big matmuls.
MODELS = {"launch-bound": dict(width=256, depth=8, batch=64), "compute-bound": dict(width=4096, depth=4, batch=4096)}
TRAIN_STEP = """
for _ in range({steps}):
    opt.zero_grad(set_to_none=True)
    loss = model(xb).square().mean()
    loss.backward()
    opt.step()
sync()
"""


def bench_training(dev: str, pairs: int, quick: bool, have_ipyx: bool, have_gauge: bool) -> None:
    print("training throughput (with / without, same process, interleaved)")
    for kind, steps in (("launch-bound", 100 if quick else 400), ("compute-bound", 5 if quick else 30)):
        if kind == "compute-bound" and dev == "cpu":
            steps = 2
        sh = new_shell()
        cell(sh, TRAIN_SETUP.format(dev=dev, **MODELS[kind]))
        step = TRAIN_STEP.format(steps=steps)
        cell(sh, step)  # warm-up: kernels, allocator, autograd
        off = lambda sh=sh: nbmem_off(sh)  # noqa: E731
        contenders = [("nbmem", lambda sh=sh: nbmem_on(sh, have_gauge), off),
                      ("nbmem with Nbmem.trace", lambda sh=sh: nbmem_on(sh, have_gauge, trace=True), off),
                      ("nbmem --lines", lambda sh=sh: nbmem_on(sh, have_gauge, lines=True), off)]
        if have_ipyx and dev == "cuda":
            contenders.append(("ipyexperiments", lambda sh=sh: ipyx_on(sh), lambda sh=sh: ipyx_off(sh)))
        for name, on, off in contenders:
            ratios = []
            with Quiet():
                for _ in range(pairs):
                    base = cell(sh, step)
                    on()
                    # Steady state, as a user trains: loading's one-time work (the first holder list the
                    # gauge publishes) is done before the measured cell; its cost is the load figure.
                    cell(sh, "pass")
                    time.sleep(0.3)
                    with_ = cell(sh, step)
                    off()
                    ratios.append(base / with_)
            line(f"training {kind} throughput ratio {name}" + (" (+gauge)" if name.startswith("nbmem") and have_gauge
                                                               else ""), spread(ratios))


def fill_namespace(sh: InteractiveShell, n: int, dev: str) -> None:
    cell(sh, textwrap.dedent(f"""
        import torch
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).to({dev!r})
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 256, device={dev!r})).sum().backward(); opt.step()
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(512, 256)), batch_size=32)
        objs = [{{"i": i, "v": [i, float(i)]}} for i in range({n} // 3)]
        tensors = [torch.empty(256, device={dev!r}) for _ in range(1000)]
        bag = []
    """))


def bench_per_cell(dev: str, quick: bool) -> None:
    print("per-cell overhead of %cudamem on (hooks + scan + report), empty cell and a cell that binds a name")
    sizes = SIZES or ([10_000, 100_000] if quick else [10_000, 100_000, 1_000_000, 10_000_000])
    for n in sizes:
        sh = new_shell()
        fill_namespace(sh, n, dev)
        reps = 3 if n >= 10_000_000 else 9 if n >= 1_000_000 else 31
        kinds = {"empty cell": "pass", "cell that rebinds a name": "k = object()",
                 "cell that keeps 4 MiB more (scan, 0.5 s budget)": f"bag.append(torch.empty(2**20, device={dev!r}))"}
        times: dict[tuple[str, bool], list[float]] = {(k, on): [] for k in kinds for on in (False, True)}
        with Quiet():
            for on in (False, True):
                if on:
                    nbmem_on(sh, gauge=False)
                for _ in range(reps):
                    for k, src in kinds.items():
                        times[k, on].append(cell(sh, src))
            nbmem_off(sh)
        for k in kinds:
            d = (statistics.median(times[k, True]) - statistics.median(times[k, False])) * 1e3
            line(f"per-cell overhead, {k}, {n:,} objects", f"{d:.2f} ms")
        del sh
        InteractiveShell.clear_instance()
        gc.collect()


def bench_peaks(dev: str) -> None:
    """Sub-millisecond spikes, some below an earlier peak: exact from the allocator's trace, counter untouched."""
    if dev != "cuda":
        line("peak exactness", "skipped (needs CUDA)")
        return
    import nbmem

    sh = new_shell()
    with Quiet():
        nbmem_on(sh, gauge=False)
        cell(sh, "import torch\ntorch.cuda.init()")
        exact = total = below = 0
        for mib in (64, 256, 1024, 128, 512, 32):
            before = sh.user_ns["torch"].cuda.max_memory_allocated()
            cell(sh, f"%%cudamem\nt = torch.empty({mib} * 2**20, dtype=torch.uint8, device='cuda')\n"
                     f"u = t[:1].clone()\ndel t, u")  # a spike of well under a millisecond
            rep = nbmem.report()
            row = rep[rep["device"] == "cuda:0"].iloc[-1]
            truth = row["allocated_before_bytes"] + mib * 2**20 + 512
            total += 1
            below += int(truth <= before)
            exact += int(row["peak_allocated_bytes"] == truth)
            print(f"    spike {mib} MiB: reported {row['peak_allocated_bytes']}, truth {truth}", file=sys.stderr)
        untouched = sh.user_ns["torch"].cuda.max_memory_allocated() >= 1024 * 2**20
        nbmem_off(sh)
    line("peak exactness (%%cudamem, sub-ms spikes, no reset)",
         f"{exact}/{total} exact ({below} below an earlier peak); "
         f"the user's peak counter {'untouched' if untouched else 'RESET'}")


def bench_trace_memory(dev: str) -> None:
    """Host memory the allocator's trace takes for a full ring of events, without and with Python stacks."""
    if dev != "cuda":
        line("trace memory", "skipped (needs CUDA)")
        return
    import torch

    from nbmem.measure.sources import HostSource, TorchSource

    torch.cuda.init()
    src, host = TorchSource(), HostSource()
    n = 100_000
    for stacks in (False, True):
        gc.collect()
        before = host.rss_bytes() or 0
        tr = src.start_trace(stacks=stacks, max_entries=n)
        assert tr is not None
        for _ in range(n // 2):  # an alloc and a free each
            torch.empty(1024, device="cuda")
        torch.cuda.synchronize()
        grown = (host.rss_bytes() or 0) - before
        t = time.perf_counter()
        events = src.finish_trace(tr, read=True)
        read_s = time.perf_counter() - t
        got = sum(len(x) for x in events or ())
        line(f"trace memory, {n:,} events, {'Python stacks' if stacks else 'no stacks'}",
             f"{grown / 2**20:.1f} MiB of host RSS while recording ({got:,} events kept), "
             f"read in {read_s * 1e3:.0f} ms")


def bench_footprint(quick: bool) -> None:
    from nbmem.ipython.root import _ACTIVE
    from nbmem.records import Sample

    sh = new_shell()
    cells = 1_000 if quick else 10_000
    with Quiet():
        cell(sh, "import torch")
        nbmem_on(sh, gauge=False)
        sess = _ACTIVE[sh].session
        for i in range(cells):
            cell(sh, f"v{i % 50} = {i}")
        n_ticks = int(24 * 3600 / sess.settings.interval_s)
        t0 = time.time()
        for k in range(n_ticks):  # 24 h of samples on a simulated clock: cpu + 1 GPU a tick
            t = t0 + k * sess.settings.interval_s
            sess.store.add_tick([Sample(t, "cpu", None, None, None, None, None, None, None, None, 10**9 + k),
                                 Sample(t, "cuda:0", k, k, k, 0, k, 8 * 10**10, k, 0, 10**9 + k)])
        ours = deep_size([sess.store, sess.holdings, sess.cells, sess.faults])
        kept = len(sess.store.sample_list())
        threads = [t.name for t in threading.enumerate() if t.name.startswith("nbmem")]
        cbs = sum(len(v) for v in sh.events.callbacks.values())
        nbmem_off(sh)
    line(f"footprint after {cells:,} cells + 24 h of samples", f"{ours / 2**20:.1f} MiB retained by nbmem "
         f"({kept} samples kept of {2 * n_ticks}), threads {threads}, event callbacks {cbs}")


# Code, not data: a function's globals lead to whole modules (torch's), which nbmem does not keep.
_SHARED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType)


def deep_size(roots: list) -> int:
    """Bytes of everything reachable from ``roots`` (what nbmem keeps), each object once."""
    seen: set[int] = set()
    stack = list(roots)
    total = 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _SHARED):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        stack.extend(gc.get_referents(o))
    return total


def bench_widget(quick: bool) -> None:
    try:
        pass
    except Exception as e:
        line("widget traffic", f"skipped ({e})")
        return
    script = os.path.join(os.path.dirname(__file__), "bench_widget.py")
    if not os.path.exists(script):
        line("widget traffic", "skipped (benchmarks/bench_widget.py missing)")
        return
    out = subprocess.run([sys.executable, script] + (["--quick"] if quick else []), capture_output=True, text=True)
    for ln in out.stdout.splitlines():
        if ln.startswith("widget"):
            name, _, value = ln.partition(": ")
            line(name, value)
    if out.returncode:
        line("widget traffic", f"failed: {out.stderr[-500:]}")


def bench_load() -> None:
    imp = textwrap.dedent("""
        import time; t = time.perf_counter(); import nbmem; print(time.perf_counter() - t)
    """)
    load = textwrap.dedent("""
        import time, torch
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config
        c = Config(); c.HistoryManager.hist_file = ":memory:"; c.Nbmem.gauge = "none"
        sh = InteractiveShell.instance(config=c)
        t = time.perf_counter(); sh.run_line_magic("load_ext", "nbmem"); dt = time.perf_counter() - t
        print(dt)
    """)
    for name, code in (("import nbmem", imp), ("%load_ext nbmem beyond importing torch", load)):
        xs = []
        for _ in range(7):
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            xs.append(float(out.strip().splitlines()[-1]) * 1e3)
        line(name, f"median {statistics.median(xs):.1f} ms (min {min(xs):.1f}, max {max(xs):.1f})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    ap.add_argument("--only", default="", help="comma list: training,cell,peaks,trace,footprint,widget,load")
    ap.add_argument("--sizes", default="", help="comma list of namespace sizes for the per-cell figures")
    a = ap.parse_args()
    only = set(filter(None, a.only.split(",")))
    SIZES.extend(int(x) for x in a.sizes.split(",") if x)
    try:
        import ipyexperiments  # noqa: F401
        have_ipyx = True
    except ImportError:
        have_ipyx = False
    try:
        import anywidget  # noqa: F401

        have_gauge = True
    except Exception:
        have_gauge = False
    env = {"python": sys.version.split()[0], "device": a.device}
    if a.device == "cuda":
        import torch

        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        env["torch"] = torch.__version__
    print(json.dumps(env))
    steps = [("training", lambda: bench_training(a.device, a.pairs, a.quick, have_ipyx, have_gauge)),
             ("cell", lambda: bench_per_cell(a.device, a.quick)), ("peaks", lambda: bench_peaks(a.device)),
             ("trace", lambda: bench_trace_memory(a.device)),
             ("footprint", lambda: bench_footprint(a.quick)), ("widget", lambda: bench_widget(a.quick)),
             ("load", bench_load)]
    for name, fn in steps:
        if not only or name in only:
            fn()
    return print_summary()


if __name__ == "__main__":
    sys.exit(main())
