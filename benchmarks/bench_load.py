"""What loading nbmem costs, this checkout against another commit's code, measured side by side in one run.

Each try is a fresh interpreter (imports are cached within one): ``import nbmem`` alone, then ``%load_ext nbmem``
in a plain IPython shell after ``import torch`` (torch's own import is not nbmem's cost). The two codes
alternate try by try so that drift on the machine falls on both alike; the medians and their ratio are printed.

    python benchmarks/bench_load.py                 # against 5f1a762, the code before the house by capability
    python benchmarks/bench_load.py --base HEAD~3 --tries 21
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = r"""
import json, os, sys, time, tempfile
os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp())
t0 = time.perf_counter(); import nbmem; t_import = time.perf_counter() - t0
assert os.path.realpath(nbmem.__file__).startswith(os.path.realpath(sys.argv[1])), nbmem.__file__
import torch
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config
cfg = Config(); cfg.HistoryManager.hist_file = ":memory:"
if sys.argv[2] != "default":
    cfg.Nbmem.gauge = sys.argv[2]
sh = InteractiveShell.instance(config=cfg)
t0 = time.perf_counter(); sh.run_line_magic("load_ext", "nbmem"); t_load = time.perf_counter() - t0
sh.run_line_magic("unload_ext", "nbmem")
print(json.dumps({"import_s": t_import, "load_ext_s": t_load}))
"""


def one(tree: Path, gauge: str = "default") -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(tree), gauge], cwd=tree, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="5f1a762", help="the commit to compare with (default: %(default)s)")
    ap.add_argument("--tries", type=int, default=11, help="fresh interpreters per code (default: %(default)s)")
    ap.add_argument("--gauge", default="default",
                    help="Nbmem.gauge for both ('none': neither imports the gauge; default: as they come)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), a.base], check=True)
        try:
            runs: dict[str, list[dict[str, float]]] = {"this checkout": [], a.base: []}
            one(ROOT, a.gauge), one(old, a.gauge)  # warm the file cache for both
            for _ in range(a.tries):
                runs["this checkout"].append(one(ROOT, a.gauge))
                runs[a.base].append(one(old, a.gauge))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    print(f"{a.tries} fresh interpreters per code, alternating, Nbmem.gauge {a.gauge}; medians (min)")
    med = {}
    for code, rs in runs.items():
        for k in ("import_s", "load_ext_s"):
            vals = [r[k] for r in rs]
            med[code, k] = statistics.median(vals)
            print(f"  {code:>14}  {k:<10} {1e3 * med[code, k]:7.1f} ms ({1e3 * min(vals):.1f})")
    for k in ("import_s", "load_ext_s"):
        print(f"ratio {k}: this checkout / {a.base} = {med['this checkout', k] / med[a.base, k]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
