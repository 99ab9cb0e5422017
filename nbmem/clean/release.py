"""Giving torch's memory back: the one place nbmem empties CUDA's cache, resets compiled code or clears cuBLAS.

``measure`` only reads the allocator (``TorchSource``). ``TorchRelease`` reads it the same way and adds the calls
that change it, each only on a request: a cleanup (``cleaner``: ``empty_cache()``, ``torch._dynamo.reset()``) or
a fit, which empties the cache after each of its runs and gives back the cuBLAS workspaces its runs made. It
reaches torch only through ``TorchSource.cuda``, so nothing here runs before CUDA is initialised, and nothing
here ever creates a CUDA context.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping

from nbmem.measure.sources import TorchSource


class TorchRelease(TorchSource):
    """The torch caching allocator read as ``TorchSource`` reads it, and the calls that give its memory back."""

    def empty_cache(self, device: int | None = None) -> bool:
        """``torch.cuda.empty_cache()``: only on an explicit request (cleanup, a fit); False without CUDA.
        With ``device``, that device's work is waited for first, so blocks its streams still use come back too."""
        t = self.cuda()
        if t is None:
            return False
        if device is None:
            t.cuda.empty_cache()
            return True
        with t.cuda.device(device):
            t.cuda.synchronize()
            t.cuda.empty_cache()
        return True

    def reset_compiled(self) -> str:
        """``torch._dynamo.reset()``: drop what ``torch.compile`` made (compiled code, CUDA graphs and their
        private pools), only on an explicit request (``%cudamem clean --compiled``). Says what it did."""
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:  # torch.compile imports it: without it nothing was compiled
            return "torch.compile was not used in this process: nothing to reset"
        dynamo.reset()
        return ("compiled code and CUDA graphs dropped (torch._dynamo.reset()); a compiled module compiles again "
                "when it is next called")

    @contextlib.contextmanager
    def capped(self, caps: Mapping[int, int]) -> Iterator[bool]:
        """Each device's allocator held to ``caps[device]`` bytes of segments while inside (``torch.cuda.
        set_per_process_memory_fraction``, as a fit's checks past its model's answer ask), the fraction it had and
        the current device put back after, whatever happened. Yields False, and holds nothing, where torch cannot
        say what the fraction was or a device's total is unknown."""
        t = self.cuda()
        before = {d: self.memory_fraction(d) for d in caps}
        totals = {d: self.allocator_total(d) for d in caps}  # what torch's fraction is a share of
        if t is None or any(f is None for f in before.values()) or not all(totals.values()):
            yield False
            return
        current = t.cuda.current_device()
        try:
            for d, cap in caps.items():
                t.cuda.set_per_process_memory_fraction(min(1.0, max(0.0, cap / (totals[d] or 1))), d)
            yield True
        finally:
            failed: list[BaseException] = []
            for d, fraction in before.items():  # every device, whatever one of them says
                try:
                    t.cuda.set_per_process_memory_fraction(1.0 if fraction is None else fraction, d)
                except Exception as e:
                    failed.append(e)
            t.cuda.set_device(current)
            if failed:
                raise RuntimeError("nbmem could not give the allocator its memory fraction back on every device: "
                                   f"{failed[0]}; torch.cuda.set_per_process_memory_fraction(1.0, device) lifts it")

    def clear_cublas_workspaces(self) -> bool:
        """Drop cuBLAS's per-handle workspaces (a fit that made them takes them back); False where torch cannot."""
        clear = getattr(getattr(self.cuda(), "_C", None), "_cuda_clearCublasWorkspaces", None)
        if clear is None:
            return False
        clear()
        return True

    # Clearing takes every handle's workspace, the user's own too; these make one of them again, as torch makes
    # it at a first product: this thread's cuBLAS handle, cuBLASLt's (a product with a bias), the autograd
    # thread's (a backward). Ones, not random: nothing is drawn from the user's generators, nothing is kept.
    CUBLAS_WORKSPACES = ("this thread's cuBLAS", "cuBLASLt", "the autograd thread's cuBLAS")

    def make_cublas_workspace(self, kind: str, device: int) -> None:
        """Make the workspace ``kind`` (one of ``CUBLAS_WORKSPACES``) on ``device`` again, if torch has none."""
        t = self.cuda()
        if t is None:
            return
        with t.cuda.device(device), t.enable_grad():
            if kind == self.CUBLAS_WORKSPACES[0]:
                t.cuda.current_blas_handle()
            elif kind == self.CUBLAS_WORKSPACES[1]:
                x = t.ones(64, 64, device=f"cuda:{device}")
                t.nn.functional.linear(x, x, x[0])
            else:
                w = t.ones(64, 64, device=f"cuda:{device}", requires_grad=True)
                (w @ w).sum().backward()
            t.cuda.synchronize()
