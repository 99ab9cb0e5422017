"""CUDA-graph pools: counted from the allocator's segments, named in the report, freed only when asked.

The pure part reads snapshots shaped as ``torch.cuda.memory_snapshot()`` returns them. The engine part runs
in a real shell, with a real ``torch.compile`` (backend "eager": no compiler needed) and a real
``torch._dynamo.reset()``; only the CUDA allocator is a stand-in (this machine has no GPU), whose counters
and segments move as a compiled model's graph pool would. tests/gpu/test_stack_gpu.py does it on a GPU.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

import nbmem
from nbmem.clean.release import TorchRelease
from nbmem.holders import pools
from nbmem.ipython.root import root_of
from nbmem.records import AllocatorReading, PoolUse
from nbmem.reports import UNATTRIBUTED, UNATTRIBUTED_SHORT, CellReport
from tests.conftest import ok

MiB = 2**20
GRAPH_POOL = (1, 0)  # what torch.cuda.graph_pool_handle() returns first; the default pool is (0, 0)


def segment(device: int, pool: tuple[int, int], address: int, blocks: list[tuple[int, str]]) -> dict[str, Any]:
    """A segment as ``torch.cuda.memory_snapshot()`` lists it, its blocks laid out from its address."""
    out, addr = [], address
    for size, state in blocks:
        out.append({"address": addr, "size": size, "requested_size": size, "state": state, "frames": []})
        addr += size
    return {"device": device, "address": address, "total_size": addr - address, "segment_pool_id": pool,
            "allocated_size": sum(s for s, st in blocks if st == "active_allocated"), "stream": 0,
            "segment_type": "large", "blocks": out}


def test_only_private_pools_count_per_device_and_a_named_block_is_the_users() -> None:
    segs = [
        segment(0, (0, 0), 0x1000_0000, [(64 * MiB, "active_allocated")]),  # the default pool: a model, say
        segment(0, GRAPH_POOL, 0x2000_0000, [(8 * MiB, "active_allocated"), (4 * MiB, "inactive"),
                                             (2 * MiB, "active_allocated")]),
        segment(0, (2, 0), 0x3000_0000, [(2 * MiB, "active_pending_free")]),
        segment(1, GRAPH_POOL, 0x4000_0000, [(6 * MiB, "active_allocated")]),
    ]
    # A variable holds the compiled model's 2 MiB output, inside the first graph segment.
    named = pools.named_addresses([("cuda:0", 0x2000_0000 + 8 * MiB + 4 * MiB + 512), ("cpu", 0x2000_0000),
                                   ("cuda:0", 0x1000_0000)])
    got = pools.private_pools(segs, named, ("cm",))
    assert got == {
        "cuda:0": PoolUse("cuda:0", pools=2, reserved_bytes=16 * MiB, allocated_bytes=10 * MiB,
                          unnamed_bytes=8 * MiB, compiled=("cm",)),
        "cuda:1": PoolUse("cuda:1", pools=1, reserved_bytes=6 * MiB, allocated_bytes=6 * MiB,
                          unnamed_bytes=6 * MiB, compiled=("cm",)),
    }


def test_no_private_pool_is_no_entry_and_an_old_snapshot_has_only_the_default_pool() -> None:
    seg = segment(0, (0, 0), 0x1000, [(MiB, "active_allocated")])
    assert pools.private_pools([seg]) == {}
    del seg["segment_pool_id"]
    assert pools.private_pools([seg]) == {}
    # Blocks without their own address are laid out from the segment's.
    seg2 = segment(0, GRAPH_POOL, 0x10_0000, [(MiB, "inactive"), (MiB, "active_allocated")])
    for b in seg2["blocks"]:
        del b["address"]
    named = pools.named_addresses([("cuda:0", 0x10_0000 + MiB)])
    assert pools.private_pools([seg2], named)["cuda:0"].unnamed_bytes == 0


def test_compiled_modules_are_the_roots_torch_compile_made() -> None:
    assert pools.compiled_modules({"model": "Sequential", "cm": "OptimizedModule", "b": "OptimizedModule",
                                   "Out[3]": "Tensor"}) == ("b", "cm")


def test_the_report_counts_the_pool_apart_from_unattributed() -> None:
    pool = PoolUse("cuda:0", 1, 96 * MiB, 40 * MiB, 32 * MiB, ("cm",))
    rep = CellReport(5, 0.1, (), unattributed=(("cuda:0", 40 * MiB),), pools=(pool,), compiled=("cm",))
    text = str(rep)
    assert "CUDA graphs on cuda:0: 96.0 MiB reserved" in text and "`cm`" in text
    assert "`%cudamem clean --compiled`" in text
    assert "unattributed on cuda:0: 8.00 MiB more" in text  # 40 MiB no name reaches, 32 MiB of it the graphs'
    assert "%cudamem clean --compiled" in rep._repr_html_()
    alone = CellReport(5, 0.1, (), unattributed=(("cuda:0", 32 * MiB),), pools=(pool,), compiled=("cm",))
    assert "unattributed" not in str(alone), "the pool explains all of it"


# -- the engine, with a stand-in for the CUDA allocator ------------------------------------------------------
class GraphPoolAllocator(TorchRelease):
    """One CUDA device whose counters and segments the test moves as a compiled model's CUDA graphs would.

    Everything else is the real TorchRelease: ``reset_compiled`` runs the real ``torch._dynamo.reset()``, after
    which the pool's memory is cached, and ``empty_cache`` gives it back, as the allocator does. The session reads
    it (``probe.torch``) and gives back through it (``release``).
    """

    def __init__(self) -> None:
        self.segs: list[dict[str, Any]] = []
        self.allocated = self.reserved = 0
        self.resets = 0

    def cuda_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def read(self, index: int) -> AllocatorReading:
        return AllocatorReading(self.allocated, self.reserved, self.allocated, 0, self.allocated, self.reserved)

    def trace_unsupported(self) -> str | None:
        return "a stand-in allocator keeps no history"

    def segments(self) -> list[dict[str, Any]]:
        return [dict(s) for s in self.segs]

    def record_graph(self, reserved: int, allocated: int) -> None:
        """What recording a CUDA graph does: a private segment, some of it still allocated."""
        self.segs.append(segment(0, GRAPH_POOL, 0x7000_0000, [(allocated, "active_allocated"),
                                                            (reserved - allocated, "inactive")]))
        self.allocated += allocated
        self.reserved += reserved

    def reset_compiled(self) -> str:
        note = super().reset_compiled()
        self.resets += 1
        for seg in self.segs:  # the graphs are gone: their blocks are free, still cached
            self.allocated -= seg["allocated_size"]
            for b in seg["blocks"]:
                b["state"] = "inactive"
            seg["allocated_size"] = 0
        return note

    def empty_cache(self, device: int | None = None) -> bool:
        self.reserved -= sum(s["total_size"] for s in self.segs if not s["allocated_size"])
        self.segs = [s for s in self.segs if s["allocated_size"]]
        return True


@pytest.fixture
def graphs(ip: Any) -> GraphPoolAllocator:
    """The monitored shell with a compiled module `cm`, its allocator a stand-in that a cell can move."""
    fake = GraphPoolAllocator()
    root_of(ip).session.probe.torch = root_of(ip).session.release = fake
    ip.user_ns["_record_graph"] = fake.record_graph
    ok(ip, "model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())\n"
           "cm = torch.compile(model, backend='eager')\n"
           "y = cm(torch.randn(8, 64))")
    return fake


def test_a_compiled_models_graph_pool_is_named_with_its_bytes(ip: Any, graphs: GraphPoolAllocator) -> None:
    ok(ip, "y = cm(torch.randn(8, 64))\n_record_graph(96 * 2**20, 40 * 2**20)")
    rep = root_of(ip).session.last_report
    assert rep is not None
    assert rep.pools == (PoolUse("cuda:0", 1, 96 * MiB, 40 * MiB, 40 * MiB, ("cm",)),)
    assert rep.unattributed == (("cuda:0", 40 * MiB),)
    assert root_of(ip).session.should_show(rep)
    status = nbmem.status()
    assert status.pools == ("cuda:0: 96.0 MiB reserved in 1 private pool(s), 40.0 MiB allocated (40.0 MiB reached "
                            "by no name); compiled modules: cm",)
    # A cell that changes nothing names it no more.
    ok(ip, "z = 1")
    assert root_of(ip).session.last_report.pools == ()


def test_measuring_never_resets_and_the_compiled_step_frees_the_pool(ip: Any, graphs: GraphPoolAllocator) -> None:
    ok(ip, "_record_graph(96 * 2**20, 40 * 2**20)")
    nbmem.status()
    nbmem.leaks()
    ok(ip, "%cudamem leaks")
    assert graphs.resets == 0, "only an explicit request resets torch.compile"
    dynamo = sys.modules["torch._dynamo"]
    assert dynamo.convert_frame.FRAME_COUNTER > 0

    rep = nbmem.cleanup(compiled=True)
    assert [s.action for s in rep.steps] == ["reset torch.compile", "gc.collect()", "empty_cache()"]
    reset = rep.steps[0]
    assert (reset.freed_allocated_bytes, reset.freed_reserved_bytes) == (40 * MiB, 0)
    assert "torch._dynamo.reset()" in reset.note and not reset.error
    assert rep.steps[2].freed_reserved_bytes == 96 * MiB
    assert (rep.freed_allocated_bytes, rep.freed_reserved_bytes) == (40 * MiB, 96 * MiB)
    assert graphs.resets == 1 and dynamo.convert_frame.FRAME_COUNTER == 0, "the real reset ran"
    ok(ip, "y = cm(torch.randn(8, 64))")  # the compiled module still works: it compiles again
    assert dynamo.convert_frame.FRAME_COUNTER > 0


def test_the_magic_takes_compiled_and_says_so_in_its_help(ip: Any, graphs: GraphPoolAllocator) -> None:
    ip.run_line_magic("cudamem", "clean --compiled --no-collect")
    rep = root_of(ip).session.last_cleanup
    assert [s.action for s in rep.steps] == ["reset torch.compile", "empty_cache()"]
    assert "--compiled" in root_of(ip).magics.cudamem.__doc__
    with pytest.raises(ValueError, match="compiled must be True or False"):
        nbmem.cleanup(compiled="yes")


def test_without_torch_compile_there_is_nothing_to_reset() -> None:
    code = ("import sys, torch\nfrom nbmem.clean.release import TorchRelease\n"
            "print(TorchRelease().reset_compiled())\nprint('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines() == ["torch.compile was not used in this process: nothing to reset", "False"]


def test_the_long_unattributed_text_is_said_once_then_the_status_has_it(ip: Any, graphs: GraphPoolAllocator) -> None:
    def grow(n: int) -> None:  # memory no name reaches: a C extension's, say
        graphs.allocated += n
        graphs.reserved += n

    ip.user_ns["_grow"] = grow
    ok(ip, "_grow(8 * 2**20)")
    first = root_of(ip).session.last_report
    ok(ip, "_grow(8 * 2**20)")
    second = root_of(ip).session.last_report
    assert first is not None and second is not None and first.cell != second.cell
    assert UNATTRIBUTED in str(first) and "memory torch keeps in C++, such as the cuBLAS" in first._repr_html_()
    assert "unattributed on cuda:0: " in str(second)
    assert UNATTRIBUTED not in str(second) and UNATTRIBUTED_SHORT in str(second)
    assert UNATTRIBUTED in str(nbmem.status()), "the status keeps the explanation the short line points to"


def test_an_unattributed_line_says_what_this_cell_added_beside_what_earlier_cells_left() -> None:
    rep = CellReport(9, 0.1, (), unattributed=(("cuda:0", 65 * MiB),), unattributed_before=(("cuda:0", 32 * MiB),),
                     explain_unattributed=False)
    assert f"unattributed on cuda:0: 33.0 MiB more in this cell (65.0 MiB in all) ({UNATTRIBUTED_SHORT})" in str(rep)
    first = CellReport(9, 0.1, (), unattributed=(("cuda:0", 32 * MiB),), unattributed_before=(("cuda:0", 0),))
    assert "unattributed on cuda:0: 32.0 MiB (" in str(first)
    assert "unattributed" not in str(CellReport(9, 0.1, (), unattributed=(("cuda:0", 0),))), "never a 0 B line"
