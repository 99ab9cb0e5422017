"""The fit's analysis alone, on recorded runs, this checkout against another side by side (issues 47 and 48).

    python benchmarks/bench_analysis.py                        # this checkout, the repository's recorded runs
    python benchmarks/bench_analysis.py --against DIR --turns 5  # and DIR's nbmem/, side by side

DIR holds another commit's package: ``mkdir DIR && git archive COMMIT nbmem | tar -x -C DIR``.

A fit's time at 7B is mostly its analyses of the runs (the allocator model's replays and the pairing of the runs'
allocations, RESULTS.md "A 7B fine-tune"); this replays every row of the recorded traces
(``tests/data/fit_*.json.gz``, on an H100) through ``prediction.analyse``, each checkout in a process of its own,
in turns (this one, the other, ...), and prints each turn's total, the medians' ratio, and whether the two gave
the same answers, with the rows where they differ (a change to the search may answer otherwise where fitting is
not monotone in the value; bench_fit.py --replay judges answers against the real boundary). Nothing is asserted;
no GPU is used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = sorted(str(p) for p in (ROOT / "tests" / "data").glob("fit_*.json.gz"))

CHILD = """
import gzip, json, sys, time
sys.path.insert(0, sys.argv[1])
from nbmem.fitting.analysis import allocator, model, prediction
rows = []
for path in sys.argv[2:]:
    with gzip.open(path, "rt") as f:
        for s in json.load(f):
            segs = tuple(allocator.SegmentState(x["address"], x["total_bytes"], x["stream"], x["small"],
                                                tuple(tuple(b) for b in x["blocks"]), x["usable"])
                         for x in s["segments"])
            runs = [model.RunTrace(r["value"], r["entries"], r["counted"], r["allocated_before_bytes"],
                                   r["reserved_before_bytes"], r["oom"]) for r in s["runs"]]
            rows.append((s, runs, segs))
t = time.perf_counter()
answers = [prediction.analyse(runs, model.Room(**s["room"]), name=s["family"], segments=segs).largest_value
           for s, runs, segs in rows]
print(json.dumps({"seconds": time.perf_counter() - t, "answers": answers,
                  "rows": [s["family"] + "/" + str(s.get("state", "")) for s, _, _ in rows]}))
"""


def one(src: str, traces: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, src, *traces], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="", metavar="DIR", help="another checkout (a folder holding its nbmem/)")
    ap.add_argument("--turns", type=int, default=3, help="turns of each (default 3)")
    ap.add_argument("--traces", nargs="*", default=TRACES, help="recorded runs (default: tests/data/fit_*.json.gz)")
    a = ap.parse_args(argv)
    if a.against and not (Path(a.against) / "nbmem").is_dir():
        ap.error(f"--against {a.against}: no nbmem/ there")
    mine: list[float] = []
    other: list[float] = []
    same, rows = True, 0
    differ: list[str] = []
    for turn in range(a.turns):
        got = one(str(ROOT), a.traces)
        mine.append(got["seconds"])
        rows = len(got["answers"])
        line = f"turn {turn + 1}: this checkout {got['seconds']:.2f} s"
        if a.against:
            was = one(a.against, a.traces)
            other.append(was["seconds"])
            same &= was["answers"] == got["answers"]
            differ = [f"{r}: {x:,} where {a.against} gives {y:,} ({x / y - 1:+.2%})" for r, x, y in
                      zip(got["rows"], got["answers"], was["answers"]) if x != y and x is not None and y]
            line += f", {a.against} {was['seconds']:.2f} s"
        print(line, flush=True)
    print(f"\n=== summary ===\nanalysis of the recorded runs ({rows} rows from {len(a.traces)} files): this checkout "
          f"{statistics.median(mine):.2f} s (median of {a.turns})")
    if a.against:
        print(f"{a.against}: {statistics.median(other):.2f} s; ratio this / that: "
              f"{statistics.median(mine) / statistics.median(other):.2f}x; the same answers: {'yes' if same else 'NO'}")
        for d in differ:
            print(f"  {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
