"""The gauge's split (js/layout.js) and nbmem.plot()'s (ui/plotting.py) read one spec and give the same bars."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from nbmem.ui.frontend import GAUGE_COLUMNS, ROW_COLUMNS, SAMPLED_COLUMNS, js_dir, segment_spec
from nbmem.ui.plotting import stack

GiB = 2**30
MiB = 2**20
LAYOUT = Path(__file__).resolve().parents[1] / "js" / "layout.js"
ROWS = [  # gauge rows: a GPU with every number, one whose process numbers are unknown, a CPU scanned and not
    {"device": "cuda:0", "allocated": 2 * GiB, "reserved": 3 * GiB, "process": 4 * GiB, "children": GiB,
     "others": 2 * GiB, "used": 7 * GiB, "total": 80 * GiB, "tensors": None, "paged": None},
    {"device": "cuda:1", "allocated": GiB, "reserved": 2 * GiB, "process": None, "children": None,
     "others": None, "used": 7 * GiB, "total": 80 * GiB, "tensors": None, "paged": None},
    {"device": "cpu", "allocated": None, "reserved": None, "process": 6 * GiB, "children": None, "others": None,
     "used": 10 * GiB, "total": 16 * GiB, "tensors": 2 * GiB, "paged": None},
    {"device": "cpu", "allocated": None, "reserved": None, "process": 6 * GiB, "children": None, "others": None,
     "used": 10 * GiB, "total": 16 * GiB, "tensors": None, "paged": None},
    # a bitsandbytes paged optimizer's state found by the last scan, and a scan that found none
    {"device": "cuda:0", "allocated": 500 * MiB, "reserved": 600 * MiB, "process": 1000 * MiB, "children": 0,
     "others": 0, "used": 1000 * MiB, "total": 2000 * MiB, "tensors": None, "paged": 300 * MiB},
    {"device": "cuda:0", "allocated": 500 * MiB, "reserved": 600 * MiB, "process": 1000 * MiB, "children": 0,
     "others": 0, "used": 1000 * MiB, "total": 2000 * MiB, "tensors": None, "paged": 0},
]


def js_segments(row: dict) -> dict[str, float | None]:
    script = (f"import {{ segments }} from {json.dumps(LAYOUT.as_uri())};"
              f"console.log(JSON.stringify(segments({json.dumps(row)})));")
    out = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, check=True)
    return {g["label"]: g["bytes"] for g in json.loads(out.stdout) if g["bytes"] is not None}


def py_segments(row: dict) -> dict[str, float | None]:
    kind = "cpu" if row["device"] == "cpu" else "gpu"
    samples = pd.DataFrame([{col: row[name] for name, col in ROW_COLUMNS[kind].items()}])
    scanned = row["tensors" if kind == "cpu" else "paged"]
    bands, _ = stack(row["device"], samples, [math.nan if scanned is None else scanned])
    return {b.label: float(b.bytes[0]) for b in bands if math.isfinite(b.bytes[0])}


@pytest.mark.skipif(shutil.which("node") is None, reason="node runs the gauge's layout.js")
@pytest.mark.parametrize("row", ROWS, ids=["gpu", "gpu-unsplit", "cpu", "cpu-unscanned", "gpu-paged", "gpu-no-paged"])
def test_the_gauge_and_the_plot_split_a_device_the_same_way(row: dict) -> None:
    js, py = js_segments(row), py_segments(row)
    assert js == py
    assert sum(v for k, v in py.items() if k != "free") + py["free"] == row["total"]


def test_paged_memory_is_carved_out_of_non_pytorch_and_absent_where_there_is_none() -> None:
    paged, none = (py_segments(r) for r in ROWS[4:])
    assert paged == {"torch allocated": 500 * MiB, "torch cached": 100 * MiB,
                     "paged (bitsandbytes, CUDA managed)": 300 * MiB, "non-PyTorch (this process)": 100 * MiB,
                     "child processes (this notebook)": 0, "other processes": 0, "free": 1000 * MiB}
    unscanned = py_segments({**ROWS[5], "paged": None})
    assert none == unscanned == {"torch allocated": 500 * MiB, "torch cached": 100 * MiB,
                                 "non-PyTorch (this process)": 400 * MiB, "child processes (this notebook)": 0,
                                 "other processes": 0, "free": 1000 * MiB}


def test_the_spec_is_the_file_the_gauge_ships() -> None:
    spec = segment_spec()
    assert (js_dir() / "segments.js").is_file()
    assert [d["key"] for d in spec["gpu"]] == ["allocated", "cached", "paged", "nontorch", "children", "others"]
    assert all(d["color"].startswith("#") and d["css"].startswith("--jp-") for d in [*spec["gpu"], *spec["cpu"]])


def test_the_gauge_reads_back_the_columns_the_kernel_sends() -> None:
    text = LAYOUT.read_text(encoding="utf-8")
    listed = re.search(r"^const COLUMNS = (\[.*?\]);", text, re.M | re.S)
    assert listed, "js/layout.js has no `const COLUMNS = [...]`"
    assert json.loads(listed.group(1)) == list(GAUGE_COLUMNS)
    typedef = text[text.index("@typedef {object} DeviceRow"):]
    typedef = typedef[:typedef.index("*/")]
    assert sorted(re.findall(r"@property \{[^}]*\} (\w+)", typedef)) == sorted(GAUGE_COLUMNS)
    assert set(SAMPLED_COLUMNS) <= set(GAUGE_COLUMNS)
