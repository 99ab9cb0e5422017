"""The GPUs a fit answers for: each one this machine's runs used (``DeviceFit``) and one it is asked about
(``--on SIZE|NAME``: a memory size, or a GPU from a small table of common ones with its memory and source).

Pure data and parsing: no torch, no IPython. A GPU's memory in the table is its datasheet's figure in the
vendor's unit, GB read as 10⁹ bytes: the totals nvidia-smi shows for these cards are as large or larger (an
L4's "24 GB" is 23,034 MiB = 24.2 × 10⁹ bytes, an H100's "80 GB" 81,559 MiB = 85.5 × 10⁹), so a prediction
against the table errs low.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nbmem.fitting.analysis.model import Room, margin_bytes_for
from nbmem.formatting import fmt_bytes, read_size

GB = 10**9
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU model in the table: what ``--on`` accepts for it, its memory, and where that figure comes from."""

    name: str  # as the report says it: "A100 40GB"
    memory_bytes: int
    source: str  # the vendor document the figure is from
    bf16: bool  # whether its tensor cores run bfloat16 (Ampere and later)


#: Common data-center and desktop GPUs. Each figure is the memory its vendor's datasheet states.
GPUS: tuple[Gpu, ...] = (
    Gpu("T4", 16 * GB, "NVIDIA T4 Tensor Core GPU datasheet", False),
    Gpu("V100 16GB", 16 * GB, "NVIDIA Tesla V100 GPU datasheet", False),
    Gpu("V100 32GB", 32 * GB, "NVIDIA Tesla V100 GPU datasheet", False),
    Gpu("L4", 24 * GB, "NVIDIA L4 Tensor Core GPU datasheet", True),
    Gpu("A10", 24 * GB, "NVIDIA A10 Tensor Core GPU datasheet", True),
    Gpu("A100 40GB", 40 * GB, "NVIDIA A100 Tensor Core GPU datasheet", True),
    Gpu("A100 80GB", 80 * GB, "NVIDIA A100 Tensor Core GPU datasheet", True),
    Gpu("H100 80GB", 80 * GB, "NVIDIA H100 Tensor Core GPU datasheet (SXM and PCIe)", True),
    Gpu("H200 141GB", 141 * GB, "NVIDIA H200 Tensor Core GPU datasheet", True),
    Gpu("L40S", 48 * GB, "NVIDIA L40S GPU datasheet", True),
    Gpu("RTX A6000", 48 * GB, "NVIDIA RTX A6000 datasheet", True),
    Gpu("RTX 3060 12GB", 12 * GB, "NVIDIA GeForce RTX 3060 family specifications", True),
    Gpu("RTX 3090", 24 * GB, "NVIDIA GeForce RTX 3090 specifications", True),
    Gpu("RTX 4080 16GB", 16 * GB, "NVIDIA GeForce RTX 4080 family specifications", True),
    Gpu("RTX 4090", 24 * GB, "NVIDIA GeForce RTX 4090 specifications", True),
)

#: Other spellings of a name in the table (after ``_key``: lower case, without spaces, dashes, "nvidia", "geforce").
_ALIASES = {"a100": "A100 40GB", "h100": "H100 80GB", "h200": "H200 141GB", "v100": "V100 16GB", "a6000": "RTX A6000",
            "3060": "RTX 3060 12GB", "3090": "RTX 3090", "4080": "RTX 4080 16GB", "4090": "RTX 4090",
            "rtx3060": "RTX 3060 12GB", "rtx4080": "RTX 4080 16GB", "l40s48gb": "L40S"}

#: What ``--on`` accepts, for the one-line refusal of anything else.
ACCEPTED = ("a memory size (24GiB, 24GB, 24G = GiB, 24000MiB) or a GPU: "
            + ", ".join(g.name for g in GPUS))


@dataclass(frozen=True, slots=True)
class Target:
    """The GPU a fit is asked about (``--on``): its memory, and the table's entry when named."""

    label: str  # "L4 (24 GB)", "24 GiB"
    memory_bytes: int
    gpu: Gpu | None = None


#: Words in the names nvidia-smi and torch.cuda.get_device_name print ("NVIDIA A100-SXM4-40GB", "Tesla T4",
#: "NVIDIA H100 80GB HBM3") that say the form factor or memory kind, not the memory size. "NVL" is not one of
#: them: an H100 NVL has 94 GB, not the H100's 80.
_FORM = re.compile(r"(?<![a-z0-9])(sxm\d*|pcie|hbm\d*e?)(?![a-z0-9])")


def _key(text: str) -> str:
    t = text.lower().replace("nvidia", "").replace("geforce", "").replace("tesla", "")
    return re.sub(r"[\s_\-]+", "", _FORM.sub("", t))


def parse_on(spec: object) -> Target:
    """``--on`` as a ``Target``: a size (``24GiB``, ``24GB``, ``24G``) or a GPU's name (``L4``, ``"A100 40GB"``);
    a ValueError in one line that lists the accepted forms otherwise."""
    if isinstance(spec, Target):
        return spec
    if isinstance(spec, str):
        spec = spec.strip().strip("'\"")  # IPython's argument line keeps the quotes of "A100 40GB"
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"takes {ACCEPTED}; got {spec!r:.40}")
    size = read_size(spec)
    if size is not None:
        if size.size_bytes < GiB // 4:
            raise ValueError(f"takes {ACCEPTED}; {spec.strip()!r} is too small for a GPU")
        # A decimal size keeps its unit in the label: shown in GiB, "24 GB" would read as a different card.
        return Target(fmt_bytes(size.size_bytes) if size.binary else size.as_typed(), size.size_bytes)
    key = _key(spec)
    by_key = {_key(g.name): g for g in GPUS}
    gpu = by_key.get(key) or by_key.get(_key(_ALIASES.get(key, "")))
    if gpu is None:
        raise ValueError(f"takes {ACCEPTED}; not {spec.strip()[:40]!r}")
    return Target(f"{gpu.name} ({gpu.memory_bytes // GB} GB)" if "GB" not in gpu.name else gpu.name,
                  gpu.memory_bytes, gpu)


def target_room(measured: Room, target: Target, context_bytes: int, margin_bytes: int | None = None) -> Room:
    """The room on ``target`` for the same notebook: its memory, less a CUDA context as large as this process's
    (``context_bytes``) and what this process's allocator holds now (the same segments, there as here)."""
    # Below zero where the notebook's own segments are more than the target has: then nothing fits there.
    free = target.memory_bytes - context_bytes - measured.reserved_bytes
    margin = margin_bytes_for(free, measured.reserved_bytes) if margin_bytes is None else int(margin_bytes)
    return Room(f"{measured.device} as {target.label}", free, measured.reserved_bytes, measured.allocated_bytes, margin,
                target.memory_bytes)


def target_notes(target: Target, measured_on: str, context_bytes: int, context_how: str) -> tuple[str, ...]:
    """What a prediction for another GPU assumes, and what can differ there."""
    src = f" ({target.gpu.source})" if target.gpu is not None else ""
    notes = [f"on {target.label}{src}: the runs were measured on {measured_on} and their allocations replayed "
             f"against {fmt_bytes(target.memory_bytes)}, less a CUDA context as large as this one's "
             f"({fmt_bytes(context_bytes)}: {context_how}) and what this notebook's allocator holds now",
             "on another GPU kernels and workspaces are chosen by its size and architecture (cuBLAS's and cuDNN's "
             "workspaces, attention's and convolutions' algorithms), so its allocations can differ from these runs'"]
    if target.gpu is not None and not target.gpu.bf16:
        notes.append(f"the {target.gpu.name} has no bf16 tensor cores: a body in bfloat16 runs slowly there or "
                     "not at all, and one under autocast may be run in float16 or float32 instead, with other sizes")
    return tuple(notes)


@dataclass(frozen=True, slots=True)
class DeviceFit:
    """One device a fit's runs allocated on: its own answer (or why it has none) and the room it was fitted to."""

    device: str  # "cuda:1"
    gpu: str  # "NVIDIA H100 80GB HBM3"; "" where unknown
    largest_value: int | None
    reason: str  # why there is no answer ("" when there is one)
    room: Room | None
    peak_reserved_at_largest_bytes: int | None = None
    limits: bool = False  # the device whose answer is the fit's

    @property
    def label(self) -> str:
        return f"{self.device} ({self.gpu})" if self.gpu else self.device

    def line(self, name: str) -> str:
        """The device's line in the report."""
        what = (f"{name}={self.largest_value:,} fits" if self.largest_value is not None else f"no prediction: "
                f"{self.reason}")
        into = "" if self.room is None else f" into {fmt_bytes(self.room.capacity_bytes)}"
        peak = ("" if self.peak_reserved_at_largest_bytes is None or self.largest_value is None else
                f" (peak {fmt_bytes(self.peak_reserved_at_largest_bytes)} reserved)")
        return f"{'limited by ' if self.limits else ''}{self.label}: {what}{into if self.largest_value else ''}{peak}"


__all__ = ["ACCEPTED", "GPUS", "DeviceFit", "Gpu", "Target", "parse_on", "target_notes", "target_room"]
