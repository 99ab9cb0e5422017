"""The fit's analysis over allocator traces recorded on an H100 (benchmarks/bench_fit.py), against the real
out-of-memory boundary measured there: 13 rows of 2026-11-24 (five model families, the notebook fresh, after a
step, and holding half the GPU, and the sequence length), 12 of 2026-11-25 (four families plainly and under
each remedy the fit measured, in a 16 GiB room; and the CNN's three again from a run whose runs near the answer
spanned 1.997×), and issue 27's five training setups (checkpointing both ways, a scaler with accumulation, a
scheduler, LoRA in bf16). The analysis is pure, so these run anywhere."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from nbmem.fitting.analysis.allocator import SegmentState
from nbmem.fitting.analysis.model import Room, RunTrace
from nbmem.fitting.analysis.prediction import analyse

DATA = Path(__file__).parent / "data"
ROWS = json.load(gzip.open(DATA / "fit_traces_h100.json.gz", "rt"))
REMEDY_ROWS = [*json.load(gzip.open(DATA / "fit_remedy_traces_h100.json.gz", "rt")),
               *json.load(gzip.open(DATA / "fit_remedy_resnet_h100_b.json.gz", "rt"))]
#: ckpt's blocks are 12.3 GiB: whether one more segment fits decided its real OOM at 25,280, and the model
#: answered 25,280 until it checked new segments placed both below and above the others (cudaMalloc's choice).
TRAINING_ROWS = json.load(gzip.open(DATA / "fit_training_traces_h100.json.gz", "rt"))
#: Safe but further below: near its limit cuDNN picks a convolution algorithm without the 2 MiB-per-sample
#: workspace the fit's runs used (12.05 MiB per sample at the peak of every run of the fit, 11.05 at 1,354).
FURTHER_BELOW = {"resnet/activation checkpointing": 0.75}


ALL_ROWS = ROWS + REMEDY_ROWS + TRAINING_ROWS


@pytest.mark.parametrize("row", ALL_ROWS, ids=[f"{r['family']}-{r['state']}" for r in ALL_ROWS])
def test_the_prediction_is_never_above_the_real_boundary_and_within_10_percent_below(row):
    segments = tuple(SegmentState(s["address"], s["total_bytes"], s["stream"], s["small"],
                                  tuple(tuple(b) for b in s["blocks"]), s["usable"]) for s in row["segments"])
    runs = [RunTrace(r["value"], r["entries"], r["counted"], r["allocated_before_bytes"], r["reserved_before_bytes"],
                     r["oom"]) for r in row["runs"]]
    res = analyse(runs, Room(**row["room"]), name=row["family"], segments=segments)
    real = row["real"]
    assert res.method == "timeline" and res.largest_value is not None, res.reason
    assert res.largest_value <= real, f"above the real boundary: {res.largest_value:,} > {real:,}"
    low = FURTHER_BELOW.get(row["family"], 0.9)
    assert res.largest_value >= low * real, f"more than {1 - low:.0%} below: {res.largest_value:,} of {real:,}"
    assert res.power_of_two <= res.largest_value < 2 * res.power_of_two
    # What the runner asks between runs: the same answer, without the curve and lines drawn from it.
    quick = analyse(runs, Room(**row["room"]), name=row["family"], segments=segments, largest_only=True)
    assert quick.largest_value == res.largest_value and quick.method == res.method
    assert res.curve and not quick.curve and not quick.lines
