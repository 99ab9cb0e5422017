"""Reports as a notebook's author reads them, on a real GPU (issue 26): no headroom line on cells that use a
sliver of the device, the long unattributed text at most once, the headroom line where the room is at stake,
and a move to the CPU that reports the bytes that left the GPU."""

from __future__ import annotations

from typing import Any

import nbmem
from nbmem.ipython.root import session_of
from nbmem.reports import UNATTRIBUTED, UNATTRIBUTED_SHORT
from tests.conftest import ok

MiB = 2**20


def allocated(torch: Any) -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def test_a_short_session_has_no_headroom_line_and_explains_unattributed_memory_once(gpu: Any) -> None:
    cells = [
        "model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()",
        "x = torch.randn(64, 512, device='cuda')\nw = torch.randn(512, 512, device='cuda')",
        "y = x @ w",  # the first matmul: cuBLAS's workspace, which no name reaches
        "logits = model(x)\nloss = logits.square().mean()\nloss.backward()",
        "z = (x @ w).relu() @ w",
        "with torch.no_grad():\n    out = model(torch.randn(256, 512, device='cuda'))",
    ]
    texts = []
    for src in cells:
        ok(gpu, src)
        rep = session_of(gpu).last_report
        assert rep is not None
        texts.append(str(rep))
    assert not any("room for" in t or "more cell" in t for t in texts), "a sliver of an idle device is not at stake"
    assert sum(UNATTRIBUTED in t for t in texts) <= 1
    later = [t for t in texts if "unattributed on" in t][1:]
    assert all(UNATTRIBUTED_SHORT in t for t in later)


def test_a_cell_that_takes_most_of_the_device_gets_its_headroom_line(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    torch.cuda.synchronize()
    # What this process can still use: the device's free memory and what its own cache holds unallocated
    # (earlier tests leave some cached).
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    n = int(free * 0.6) // 4
    try:
        # --reset-peak: earlier tests (fits near the limit) left the process's peak counter far above this
        # cell's, and a peak the counters cannot pin is unknown, so no headroom line would be said.
        ok(gpu, f"%%cudamem --reset-peak\ntmp = torch.empty({n}, device='cuda')\ntmp.fill_(1.0)\ndel tmp")
        rep = session_of(gpu).last_report
        assert rep is not None
        lines = [a for a in rep.notes if "room for" in a]
        assert len(lines) == 1, rep
        assert lines[0].startswith("cuda:0: peak ") and "this cell's growth" in lines[0]
        ratio = float(lines[0].split("room for ~")[1].split("×")[0])
        assert 1.0 <= ratio < 2.0, lines[0]
    finally:
        ok(gpu, "torch.cuda.empty_cache()")  # the next tests expect no 48 GiB segment left cached


def test_to_cpu_of_a_model_with_adam_state_reports_what_left_the_gpu(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    ok(gpu, "net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()\n"
            "opt = torch.optim.Adam(net.parameters())\n"
            "net(torch.randn(64, 1024, device='cuda')).sum().backward()\n"
            "opt.step()")
    weights = 4 * (1024 * 1024 + 1024) * 4
    before = allocated(torch)
    rep = nbmem.cleanup(to_cpu=["net"], collect=False, empty_cache=False)
    (move,) = rep.steps
    assert move.action == "to CPU" and not move.error
    assert move.freed_allocated_bytes == before - allocated(torch), rep
    assert move.freed_allocated_bytes == 2 * weights, "the weights and their gradients; Adam's state stays"
    assert "more on the CPU" in move.note
    assert rep.freed_allocated_bytes == move.freed_allocated_bytes
    ok(gpu, "del opt, net")


def test_after_the_compiled_step_and_a_dynamo_reset_new_tensors_are_the_users_not_a_pools(gpu: Any) -> None:
    torch = gpu.user_ns["torch"]
    ok(gpu, "mlp2 = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(),\n"
            "                     torch.nn.Linear(2048, 2048)).cuda()\n"
            "x2 = torch.randn(1024, 2048, device='cuda')\n"
            "cm2 = torch.compile(mlp2, mode='reduce-overhead')\n"
            "with torch.no_grad():\n    for _ in range(4):\n        y2 = cm2(x2)\ntorch.cuda.synchronize()")
    clean = nbmem.cleanup(names=["y2"], compiled=True)
    assert not clean.errors, clean
    ok(gpu, "torch._dynamo.reset()")
    ok(gpu, "z2 = torch.empty(32 * 2**20, device='cuda')")
    rep = session_of(gpu).last_report
    assert rep is not None and rep.pools == (), "no CUDA-graph pool is claimed for a plain tensor"
    assert [f.name for f in rep.findings] == ["z2"] and rep.findings[0].bytes == 128 * MiB
    assert not [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0)]
    assert nbmem.status().pools == ()
    ok(gpu, "del z2, x2, mlp2, cm2")
