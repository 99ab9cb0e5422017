"""On a real GPU: every cleanup frees what its report says, to the byte of memory_allocated() (issue 10)."""

from __future__ import annotations

import nbmem
from tests.conftest import ok, run

MiB = 2**20


def allocated(sh) -> int:
    torch = sh.user_ns["torch"]
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def test_each_cleanup_frees_what_its_report_says(gpu):
    cases = [
        ("a = torch.empty(64 * 2**20, device='cuda')", dict(names=["a"]), 256 * MiB),
        ("b = torch.empty(16 * 2**20, device='cuda')\nalias = b", dict(names=["b"]), 0),
        ("torch.ones(8 * 2**20, device='cuda')", dict(outputs=True), 32 * MiB),
        ("def f():\n    local = torch.empty(4 * 2**20, device='cuda')\n    raise RuntimeError\nf()",
         dict(traceback=True), 16 * MiB),
        ("lin = torch.nn.Linear(1024, 1024).cuda()\nlosses = [lin(torch.randn(512, 1024, device='cuda')).relu()"
         ".mean() for _ in range(4)]", dict(names=["losses"]), 4 * 2 * 512 * 1024 * 4 + 4 * 512),
    ]
    for src, kw, expect in cases:
        run(gpu, src)
        before = allocated(gpu)
        rep = nbmem.cleanup(**kw)
        assert before - allocated(gpu) == rep.freed_allocated_bytes == expect, (src, kw, rep)
    assert nbmem.cleanup(names=["alias"]).freed_allocated_bytes == 64 * MiB
    ok(gpu, "x = 1")
