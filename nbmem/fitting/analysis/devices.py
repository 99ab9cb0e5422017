"""The GPUs a fit answers for: each one this machine's runs used (``DeviceFit``) and one it is asked about
(``--on SIZE|NAME``: a memory size, or a GPU from a small table of common ones with its memory and source).

Pure data and parsing: no torch, no IPython. A GPU's memory in the table is what CUDA gives a process there,
``cudaMemGetInfo``'s total (torch's ``get_device_properties().total_memory``): the total nvidia-smi shows (NVML's)
less what the driver keeps for itself, 250 to 900 MiB by card, driver and ECC. On an H100 80GB nvidia-smi shows
81,559 MiB and CUDA 81,079 (driver 580); a fit there is fitted to CUDA's figure, so the table must hold the same
kind of figure for ``--on`` to answer as the card itself does. The reserve changes with the driver, so each figure is
the least a card of that name was seen to report (docs/research/gpu-memory.md: every sighting and its source):
a prediction against the table errs low, never high.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nbmem.fitting.analysis.model import Room, margin_bytes_for
from nbmem.formatting import fmt_bytes, read_size

GB = 10**9
GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU model in the table: what ``--on`` accepts for it, its memory, and where that figure comes from."""

    name: str  # as the report says it: "A100 40GB"
    gb: int  # its vendor's size, for the label only: "L4 (24 GB)"
    cuda_mib: int  # what CUDA gives a process there (cudaMemGetInfo's total): the least seen reported
    smi_mib: int  # the total nvidia-smi shows in the same configuration: more, by the driver's reserve
    source: str  # where ``cuda_mib`` was seen
    bf16: bool  # whether its tensor cores run bfloat16 (Ampere and later)

    @property
    def memory_bytes(self) -> int:
        return self.cuda_mib * MiB


_ECC_OFF = "; with ECC off (the card's default) CUDA gives about {:,} MiB: give that as a size"

#: Common data-center and desktop GPUs: CUDA's total for a process on each (the least reported, in MiB), the
#: total nvidia-smi shows, and where the first was seen ("fs id": a public file docs/research/gpu-memory.md cites).
GPUS: tuple[Gpu, ...] = (
    Gpu("T4", 16, 14904, 15360, "'total capacity of 14.56 GiB' on a Colab T4 (fs id 69202590390)", False),
    Gpu("V100 16GB", 16, 16130, 16384, "torch.cuda.get_device_properties on a V100-SXM2-16GB, 16130MB (fs id "
        "36227284735)", False),
    Gpu("V100 32GB", 32, 32496, 32768, "'31.74 GiB total capacity' on a V100 32GB, "
        "https://github.com/liucongg/ChatGLM-Finetuning/issues/73", False),
    Gpu("L4", 24, 22692, 23034, "Unsloth's banner on an L4, 'Max memory: 22.161 GB' (fs id 10982666894)", True),
    Gpu("A10", 24, 22512, 23028, "'total capacty of 21.99 GiB' on an A10, "
        "https://github.com/zai-org/CogVLM/issues/236", True),
    Gpu("A10G", 24, 22515, 23028, "Unsloth's banner on an A10G, 'Max memory: 21.988 GB' (fs id 28931843527)", True),
    Gpu("A100 40GB", 40, 40441, 40960, "Unsloth's banner on an A100-SXM4-40GB, 'Max memory: 39.494 GB' (fs id "
        "60591431065)", True),
    Gpu("A100 80GB", 80, 81034, 81920, "'total capacity of 79.14 GiB' on an A100 80GB, "
        "https://github.com/lianqi1008/Control-GIC/issues/6", True),
    Gpu("H100 80GB", 80, 81003, 81559, "'total capacity of 79.11 GiB' on an H100, "
        "https://github.com/vllm-project/vllm/issues/27508 (SXM and PCIe alike)", True),
    Gpu("H100 NVL", 94, 95226, 95830, "'total capacity of 93.00 GiB' on an H100 NVL, "
        "https://github.com/ali-vilab/VACE/issues/56", True),
    Gpu("H200 141GB", 141, 143052, 143771, "Unsloth's banner on an H200, 'Max memory: 139.7 GB' (fs id 55075656286)",
        True),
    Gpu("H200 NVL", 141, 143052, 143771, "the H200's least (fs id 55075656286): an H200 NVL was seen at 139.801 GB "
        "(fs id 42905456345), one sighting", True),
    Gpu("B200", 180, 182625, 183359, "'Total Global Memory: 178.35 GB' on a B200, "
        "https://github.com/pytorch/ao/pull/4002", True),
    Gpu("L40", 48, 45460, 46068, "'total capacity of 44.40 GiB' on an L40, https://github.com/NVlabs/Eagle/issues/68",
        True),
    Gpu("L40S", 48, 45456, 46068, "Unsloth's banner on an L40S, 'Max memory: 44.392 GB' (fs id 71554635622)", True),
    Gpu("A40", 48, 45416, 46068, "torch.cuda.get_device_properties on an A40, 45416MB (fs id 31219571458)", True),
    Gpu("RTX A6000", 48, 45492, 46068, "Unsloth's banner on an RTX A6000 with ECC on, 'Max memory: 44.427 GB' "
        "(fs id 67446497642)" + _ECC_OFF.format(48568), True),
    Gpu("RTX 6000 Ada", 48, 45491, 46068, "'total capacity of 44.43 GiB' on an RTX 6000 Ada with ECC on, "
        "https://github.com/DINGYANB/MTVCrafter/issues/21" + _ECC_OFF.format(48622), True),
    Gpu("RTX 3060 12GB", 12, 11931, 12288, "torch.cuda.get_device_properties on an RTX 3060, 11931MB (fs id "
        "47313141004)", True),
    Gpu("RTX 3090", 24, 24251, 24576, "Unsloth's banner on an RTX 3090, 'Max memory: 23.684 GB' (fs id 33404547317)",
        True),
    Gpu("RTX 4080 16GB", 16, 16049, 16376, "torch.cuda.get_device_properties on an RTX 4080, 16049MB (fs id "
        "22567041692)", True),
    Gpu("RTX 4090", 24, 24073, 24564, "Unsloth's banner on an RTX 4090, 'Max memory: 23.51 GB' (fs id 11556477136)",
        True),
    Gpu("RTX 5090", 32, 32093, 32607, "Unsloth's banner on an RTX 5090, 'Max memory: 31.342 GB' (fs id 54779038834)",
        True),
)

#: Other spellings of a name in the table (after ``_key``: lower case, without spaces, dashes, "nvidia", "geforce").
#: A bare "H100" is the 80 GB card (SXM or PCIe): the H100 NVL is named as such, and is larger.
_ALIASES = {"h100": "H100 80GB", "h200": "H200 141GB", "a6000": "RTX A6000", "6000ada": "RTX 6000 Ada",
            "rtx6000adageneration": "RTX 6000 Ada", "3090": "RTX 3090", "4080": "RTX 4080 16GB", "4090": "RTX 4090",
            "5090": "RTX 5090", "rtx4080": "RTX 4080 16GB", "l40s48gb": "L40S"}

#: Names sold in several memory sizes that say none: a fit for the larger would answer above the smaller's limit.
_AMBIGUOUS = {"a100": ("A100 40GB", "A100 80GB"), "v100": ("V100 16GB", "V100 32GB"),
              "rtx3060": ("RTX 3060 12GB", "the 8 GB RTX 3060 (not in the table)"),
              "3060": ("RTX 3060 12GB", "the 8 GB RTX 3060 (not in the table)")}

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


def _ambiguous(spec: str, choices: tuple[str, ...]) -> str:
    by_name = {g.name: g for g in GPUS}
    said = [f"{c} ({by_name[c].smi_mib:,} MiB)" if c in by_name else c for c in choices]
    return f"{spec!r} is ambiguous: {', '.join(said[:-1])} or {said[-1]}; name one, or give a size"


def parse_on(spec: object) -> Target:
    """``--on`` as a ``Target``: a size (``24GiB``, ``24GB``, ``24G``) or a GPU's name (``L4``, ``"A100 40GB"``);
    a ValueError in one line otherwise, that lists the accepted forms or the sizes a bare name has."""
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
    if key in _AMBIGUOUS:
        raise ValueError(_ambiguous(spec.strip()[:40], _AMBIGUOUS[key]))
    by_key = {_key(g.name): g for g in GPUS}
    gpu = by_key.get(key) or by_key.get(_key(_ALIASES.get(key, "")))
    if gpu is None:
        raise ValueError(f"takes {ACCEPTED}; not {spec.strip()[:40]!r}")
    return Target(gpu.name if "GB" in gpu.name else f"{gpu.name} ({gpu.gb} GB)", gpu.memory_bytes, gpu)


def target_room(measured: Room, target: Target, context_bytes: int, margin_bytes: int | None = None) -> Room:
    """The room on ``target`` for the same notebook: its memory, less a CUDA context as large as this process's
    (``context_bytes``) and what this process's allocator holds now (the same segments, there as here)."""
    # Below zero where the notebook's own segments are more than the target has: then nothing fits there.
    free = target.memory_bytes - context_bytes - measured.reserved_bytes
    margin = (margin_bytes_for(free, measured.reserved_bytes, measured.allocated_bytes) if margin_bytes is None
              else int(margin_bytes))
    return Room(f"{measured.device} as {target.label}", free, measured.reserved_bytes, measured.allocated_bytes, margin,
                target.memory_bytes)


def target_notes(target: Target, measured_on: str, context_bytes: int, context_how: str) -> tuple[str, ...]:
    """What a prediction for another GPU assumes, and what can differ there."""
    g = target.gpu
    # The figure said, and where it is from: a user who knows the card by nvidia-smi's total sees why it is less.
    src = ("" if g is None else f" (CUDA gives a process {g.cuda_mib:,} MiB there, the least seen reported, of the "
           f"{g.smi_mib:,} MiB nvidia-smi shows: {g.source})")
    notes = [f"on {target.label}{src}: the runs were measured on {measured_on} and their allocations replayed "
             f"against {fmt_bytes(target.memory_bytes)}, less a CUDA context as large as this one's "
             f"({fmt_bytes(context_bytes)}: {context_how}) and what this notebook's allocator holds now",
             "on another GPU kernels and workspaces are chosen by its size and architecture (cuBLAS's and cuDNN's "
             "workspaces, attention's and convolutions' algorithms), so its allocations can differ from these runs'"]
    if g is not None and not g.bf16:
        notes.append(f"the {g.name} has no bf16 tensor cores: a body in bfloat16 runs slowly there or "
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
