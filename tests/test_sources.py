"""Sources: CUDA_VISIBLE_DEVICES mapping, the NVML choke point's error policy, torch without CUDA."""

from __future__ import annotations

import gc
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from nbmem.clean.release import TorchRelease
from nbmem.measure.host import HeapWatch, HostSource, heap_bytes
from nbmem.measure.sources import NvmlSource, Probe, TorchSource, parse_visible_devices

UUIDS = ["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-cccc-3333"]


@pytest.mark.parametrize("value,expect", [
    (None, [0, 1, 2]),
    ("", []),
    ("1", [1]),
    ("2,0", [2, 0]),
    ("0,7,1", [0]),  # CUDA stops at the first invalid entry
    ("-1,0", []),
    ("1,1", [1]),
    ("GPU-bbbb-2222", [1]),
    ("GPU-cccc", [2]),  # a unique UUID prefix
    ("bbbb-2222,0", [1, 0]),
    ("GPU-zzzz", []),
    (" 1 , 2 ", [1, 2]),
])
def test_cuda_visible_devices(value, expect):
    assert parse_visible_devices(value, UUIDS) == (expect, None)


def test_mig_is_named_not_guessed():
    idx, why = parse_visible_devices("MIG-1234", UUIDS)
    assert idx == [] and "MIG" in why


class NVMLError(Exception):
    pass


class FakeNvml:
    """Stands in for pynvml where there is no GPU: only NVML's numbers are faked, nbmem's logic is real."""

    nvmlMemory_v2 = 2
    NVML_VALUE_NOT_AVAILABLE = 2**64 - 1

    def __init__(self, *, v2=True, procs=None, fail=()):
        self.v2, self.procs, self.fail, self.calls = v2, procs, set(fail), []

    def __getattr__(self, name):
        raise AttributeError(name)

    def _c(self, name):
        self.calls.append(name)
        if name in self.fail:
            raise NVMLError(f"{name} failed")

    def nvmlInit(self): self._c("nvmlInit")
    def nvmlShutdown(self): self._c("nvmlShutdown")
    def nvmlDeviceGetCount(self):
        self._c("count")
        return 2
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetUUID(self, h): return UUIDS[h].encode()
    def nvmlDeviceGetName(self, h): return "Fake H200"

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        self._c("mem")
        if version is not None and not self.v2:
            raise NVMLError("Function Not Found")
        used = 1000 if version else 1500  # v1 counts driver-reserved memory as used
        return SimpleNamespace(used=used + h, total=10_000)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self._c("procs")
        if self.procs is None:
            return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=600), SimpleNamespace(pid=999999, usedGpuMemory=300)]
        return self.procs


def started(nv, env=None, clock=None):
    s = NvmlSource(nv, environ=env or {}, clock=clock or (lambda: 0.0))
    s.start()
    return s


def test_v2_memory_first_then_v1():
    s = started(FakeNvml())
    assert [d.name for d in s.devices] == ["cuda:0", "cuda:1"] and s.reason is None
    assert s.memory("cuda:1") == (1001, 10_000)
    assert started(FakeNvml(v2=False)).memory("cuda:0") == (1500, 10_000)


def test_visible_devices_renumber():
    s = started(FakeNvml(), env={"CUDA_VISIBLE_DEVICES": "1"})
    assert [(d.name, d.nvml_index) for d in s.devices] == [("cuda:0", 1)]


def test_own_and_other_processes():
    g = started(FakeNvml()).read("cuda:0", cuda_in_use=True)
    assert (g.process_used_bytes, g.other_processes_bytes) == (600, 300)
    assert [p.pid for p in g.processes] == [999999]


def test_container_without_host_pids_is_unknown_not_zero():
    s = started(FakeNvml(procs=[SimpleNamespace(pid=4242, usedGpuMemory=700)]))
    g = s.read("cuda:0", cuda_in_use=True)
    assert g.process_used_bytes is None and g.other_processes_bytes is None
    assert "container" in s.process_reason
    # After its cache is emptied the context is still there: once its PID cannot be matched, unknown stays unknown
    idle = s.read("cuda:0", cuda_in_use=False)
    assert idle.process_used_bytes is None and idle.other_processes_bytes is None
    never = started(FakeNvml(procs=[SimpleNamespace(pid=4242, usedGpuMemory=700)]))
    fresh = never.read("cuda:0", cuda_in_use=False)  # never used CUDA here: this process holds nothing
    assert fresh.process_used_bytes == 0 and fresh.other_processes_bytes == 700


def test_wddm_or_mig_per_process_na():
    s = started(FakeNvml(procs=[SimpleNamespace(pid=os.getpid(), usedGpuMemory=None)]))
    g = s.read("cuda:0", cuda_in_use=True)
    assert g.process_used_bytes is None and "WDDM or MIG" in s.process_reason


def test_process_list_asked_at_most_once_a_second():
    t = [0.0]
    nv = FakeNvml()
    s = started(nv, clock=lambda: t[0])
    for _ in range(5):
        s.read("cuda:0", cuda_in_use=True)
    assert nv.calls.count("procs") == 1
    t[0] = 1.01
    s.read("cuda:0", cuda_in_use=True)
    assert nv.calls.count("procs") == 2


def test_errors_become_unknown_with_a_reason():
    s = started(FakeNvml(fail={"nvmlInit"}))
    assert s.devices == [] and s.reason.startswith("NVML did not start (nvmlInit")
    s = started(FakeNvml(fail={"mem", "procs"}))
    g = s.read("cuda:0", cuda_in_use=True)
    assert (g.used_bytes, g.total_bytes, g.process_used_bytes) == (None, None, None)
    assert "cannot list processes" in s.process_reason


def test_gpu_lost_mid_run_keeps_the_probe_going():
    nv = FakeNvml()
    p = Probe(nvml=started(nv))
    assert len(p.samples()) == 3
    nv.fail |= {"mem", "procs"}
    later = p.samples()
    assert [x.device for x in later] == ["cpu", "cuda:0", "cuda:1"]
    assert later[1].nvml_used_bytes is None and later[0].rss_bytes


def test_real_nvml_here_is_missing_and_said_so():
    s = NvmlSource()
    s.start()
    if s.devices:
        pytest.skip("this machine has a GPU")
    assert s.reason and s.devices == []


def test_torch_source_never_initialises_cuda():
    t = TorchSource()
    assert t.read(0) is None and t.device_count() == 0 and t.context_devices() == []
    assert t.device_free(0) is None and t.segments() is None
    release = TorchRelease()
    assert not release.empty_cache(0) and not release.empty_cache() and not release.clear_cublas_workspaces()
    release.make_cublas_workspace(release.CUBLAS_WORKSPACES[0], 0)
    assert not torch.cuda.is_initialized()


def test_the_torch_source_only_reads() -> None:
    """Measurement never changes what it measures: what gives memory back is ``clean.release``'s alone."""
    for name in ("empty_cache", "reset_compiled", "clear_cublas_workspaces", "make_cublas_workspace"):
        assert not hasattr(TorchSource, name), name
        assert callable(getattr(TorchRelease, name)), name


def test_the_devices_with_a_context_are_those_torch_says_have_a_primary_context(monkeypatch):
    """Asked of torch once CUDA is up, for each device torch counts: never of a device it does not count."""
    asked = []

    def has(i):
        asked.append(i)
        return i > 0

    cuda = SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 3, current_device=lambda: 2)
    binding = SimpleNamespace(_cuda_hasPrimaryContext=has)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda, _C=binding))
    assert TorchSource().context_devices() == [1, 2] and asked == [0, 1, 2]
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda, _C=SimpleNamespace()))
    assert TorchSource().context_devices() == [2], "without the binding: the current device"
    cuda.is_initialized = lambda: False
    assert TorchSource().context_devices() == [] and asked == [0, 1, 2], "nothing asked before CUDA is up"


def test_host_numbers():
    h = HostSource()
    assert h.rss_bytes() > 0 and h.max_rss_bytes() >= h.rss_bytes() // 2
    if heap_bytes is not None:
        before = heap_bytes()
        x = torch.empty(4 * 2**20)
        assert heap_bytes() - before >= 16 * 2**20
        del x


@pytest.mark.skipif(heap_bytes is None, reason="the C heap is read with glibc's mallinfo2")
def test_the_heap_watch_adds_back_what_a_collection_freed_and_only_that():
    w = HeapWatch()
    w.install()
    try:
        junk: list[object] = [bytearray(2**24)]
        junk.append(junk)  # 16 MiB that only a collection frees
        del junk
        before, plain = w.bytes(), heap_bytes()
        gc.collect()
        assert heap_bytes() - plain <= -16 * 2**20, "the collection freed the cycle"
        assert w.collected_bytes >= 16 * 2**20 and abs(w.bytes() - before) < 2**20, (w.collected_bytes, before)
        kept = bytearray(2**24)  # freed by no collection: the figure follows it
        assert w.bytes() - before >= 16 * 2**20
        del kept
    finally:
        w.remove()
    assert w._on_collection not in gc.callbacks


def test_the_heap_watch_never_raises_inside_the_collector():
    def broken() -> int:
        raise OSError("mallinfo2 went away")

    w = HeapWatch(broken)
    w._on_collection("start", {"generation": 2})
    w._on_collection("stop", {"generation": 2})
    assert w.collected_bytes == 0 and HeapWatch(None).bytes() is None


def test_a_list_cached_before_our_context_existed_is_refreshed_once():
    nv = FakeNvml(procs=[SimpleNamespace(pid=999999, usedGpuMemory=300)])
    s = started(nv)
    assert s.read("cuda:0", cuda_in_use=False).process_used_bytes == 0
    nv.procs = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=900), SimpleNamespace(pid=999999, usedGpuMemory=300)]
    g = s.read("cuda:0", cuda_in_use=True)  # within the cache's second: must not say "container"
    assert g.process_used_bytes == 900 and s.process_reason is None


def test_a_pid_namespace_is_concluded_once_then_not_asked_every_read():
    nv = FakeNvml(procs=[SimpleNamespace(pid=4242, usedGpuMemory=700)])
    s = started(nv)
    for _ in range(5):
        assert s.read("cuda:0", cuda_in_use=True).process_used_bytes is None
    assert nv.calls.count("procs") == 2  # the cached list, then one fresh look


def test_a_device_this_process_does_not_use_is_not_blamed_on_containers():
    s = started(FakeNvml(procs=[SimpleNamespace(pid=4242, usedGpuMemory=700)]))
    g = s.read("cuda:1", cuda_in_use=False)
    assert g.process_used_bytes == 0 and s.process_reason is None


def test_other_processes_are_named_by_notebook_where_the_jupyter_server_knows(monkeypatch):
    import nbmem.measure.sources as sources

    monkeypatch.setattr(sources, "notebook_of_pids", lambda pids: {4242: "team/train.ipynb"})
    procs = [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in ((os.getpid(), 100), (4242, 300), (5151, 200))]
    src = NvmlSource(nvml=FakeNvml(procs=procs), environ={})
    src.start()
    names = {p.pid: p.name for p in src.processes("cuda:0")}
    assert names[4242] == "notebook team/train.ipynb" and not names[5151].startswith("notebook")


def test_the_allocator_is_held_to_a_cap_only_where_cuda_is_up() -> None:
    """No CUDA context is made to cap it: without one, nothing is set and the caller is told (tests/gpu has the
    cap itself)."""
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is up in this process: tests/gpu/test_fit_beyond_gpu.py checks the cap")
    src = TorchRelease()
    assert src.memory_fraction(0) is None
    with src.capped({0: 1 << 30}) as held:
        assert held is False
    assert not torch.cuda.is_initialized()
