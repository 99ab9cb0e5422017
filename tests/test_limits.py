"""The memory limit that applies: cgroup v1 and v2 layouts as fixture directories, and this machine's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from nbmem.measure.host import HostSource
from nbmem.measure.limits import V1_UNLIMITED, Cgroup, applied, oom_kills_of
from nbmem.measure.sources import NvmlSource, Probe
from nbmem.records import MemoryLimit
from nbmem.reports import near_limit

GiB = 2**30
HOST = 64 * GiB


def put(root: Path, rel: str, text: str) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


V1_MOUNTINFO = """\
23 1 0:21 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
33 23 0:30 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
35 23 0:32 {base} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 23 0:37 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
"""


def v1_layout(root: Path, *, path: str = "/kubepods/pod1/abc", base: str = "/", limit: int = 4 * GiB,
              hierarchical: int | None = None, usage: int = 3 * GiB, inactive: int = GiB // 4,
              oom_kill: int | None = 2) -> Path:
    put(root, "proc/self/cgroup", f"12:pids:/x\n4:memory:{path}\n1:cpu,cpuacct:/y\n0::/\n")
    put(root, "proc/self/mountinfo", V1_MOUNTINFO.format(base=base))
    rel = path[len(base):] if base != "/" else path
    d = root / "sys/fs/cgroup/memory" / rel.lstrip("/")
    put(d, "memory.limit_in_bytes", f"{limit}\n")
    put(d, "memory.usage_in_bytes", f"{usage}\n")
    stat = f"cache 100\nrss 200\nhierarchical_memory_limit {hierarchical or limit}\ntotal_inactive_file {inactive}\n"
    put(d, "memory.stat", stat)
    oom = "oom_kill_disable 0\nunder_oom 0\n" + (f"oom_kill {oom_kill}\n" if oom_kill is not None else "")
    put(d, "memory.oom_control", oom)
    return d


def v2_layout(root: Path, *, path: str = "/user.slice/kernel.scope", limits: dict[str, str] | None = None,
              current: int = 3 * GiB, inactive: int = GiB // 2, oom_kill: int = 1) -> Path:
    put(root, "proc/self/cgroup", f"0::{path}\n")
    put(root, "proc/self/mountinfo", "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n")
    mount = root / "sys/fs/cgroup"
    put(mount, "cgroup.controllers", "cpu io memory pids\n")
    limits = limits if limits is not None else {path: str(4 * GiB)}
    d = mount / path.lstrip("/")
    for p in [d, *d.parents]:
        if p == mount.parent:
            break
        key = "/" + str(p.relative_to(mount)) if p != mount else "/"
        if p != mount:
            put(p, "memory.max", limits.get(key, "max") + "\n")
        put(p, "memory.current", f"{current}\n")
        put(p, "memory.stat", f"anon 100\nfile 200\ninactive_file {inactive}\n")
        put(p, "memory.events", f"low 0\nhigh 0\nmax 5\noom 3\noom_kill {oom_kill}\noom_group_kill 0\n")
    return d


def test_v1_limit_usage_less_inactive_file_and_oom_kills(tmp_path: Path) -> None:
    d = v1_layout(tmp_path)
    c = Cgroup(tmp_path, environ={})
    assert (c.version, c.dirs, c.reason) == (1, [d.resolve()], "")
    lim = c.read(HOST)
    assert lim == MemoryLimit(4 * GiB, 3 * GiB - GiB // 4, 2, "cgroup v1 memory.limit_in_bytes", str(d.resolve()),
                              "", HOST)
    assert lim.applies and lim.share == pytest.approx((3 - 0.25) / 4)
    assert "4.00 GiB container limit" in lim.text() and "OOM kills so far: 2" in lim.text()


def test_v1_a_parent_limit_binds_through_the_hierarchical_figure(tmp_path: Path) -> None:
    v1_layout(tmp_path, limit=V1_UNLIMITED + 1, hierarchical=2 * GiB)
    lim = Cgroup(tmp_path, environ={}).read(HOST)
    assert lim.limit_bytes == 2 * GiB and lim.source == "cgroup v1 hierarchical_memory_limit"


def test_v1_unlimited_is_no_limit_not_a_huge_one(tmp_path: Path) -> None:
    v1_layout(tmp_path, limit=9223372036854771712, oom_kill=None)
    lim = Cgroup(tmp_path, environ={}).read(HOST)
    assert lim.limit_bytes is None and lim.reason == "" and not lim.applies
    assert lim.oom_kills is None  # an old kernel without the oom_kill line: unknown, not 0
    assert lim.text() == "memory limit: none set (the host's RAM applies)"
    assert applied(lim, HOST, 10 * GiB) == (HOST, 10 * GiB)


def test_v1_container_that_sees_the_hosts_path_reads_its_mount_root(tmp_path: Path) -> None:
    """Docker without a cgroup namespace: /proc/self/cgroup names /docker/<id>, mounted at the mount point."""
    put(tmp_path, "proc/self/cgroup", "4:memory:/docker/0123abcd\n")
    put(tmp_path, "proc/self/mountinfo", V1_MOUNTINFO.format(base="/docker/0123abcd"))
    m = tmp_path / "sys/fs/cgroup/memory"
    put(m, "memory.limit_in_bytes", f"{GiB}\n")
    put(m, "memory.usage_in_bytes", f"{GiB // 2}\n")
    lim = Cgroup(tmp_path, environ={}).read(HOST)
    assert lim.limit_bytes == GiB and lim.usage_bytes == GiB // 2 and lim.oom_kills is None


def test_v2_the_lowest_limit_on_the_way_up_binds(tmp_path: Path) -> None:
    d = v2_layout(tmp_path, path="/kubepods/pod1/ctr", limits={"/kubepods/pod1": str(3 * GiB),
                                                                "/kubepods/pod1/ctr": str(5 * GiB)})
    c = Cgroup(tmp_path, environ={})
    assert c.version == 2 and c.dirs[0] == d.resolve()
    lim = c.read(HOST)
    assert lim.limit_bytes == 3 * GiB and lim.cgroup_dir == str(d.parent.resolve())
    assert lim.usage_bytes == 3 * GiB - GiB // 2 and lim.oom_kills == 1
    assert oom_kills_of(lim.cgroup_dir) == 1


def test_v2_max_everywhere_is_no_limit(tmp_path: Path) -> None:
    v2_layout(tmp_path, limits={})
    lim = Cgroup(tmp_path, environ={}).read(HOST)
    assert lim.limit_bytes is None and lim.reason == "" and lim.share is None


def test_v2_cgroup_namespace_root(tmp_path: Path) -> None:
    """Inside a cgroup namespace the process's cgroup is "/": the mount point itself."""
    put(tmp_path, "proc/self/cgroup", "0::/\n")
    put(tmp_path, "proc/self/mountinfo", "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    m = tmp_path / "sys/fs/cgroup"
    put(m, "memory.max", f"{2 * GiB}\n")
    put(m, "memory.current", f"{GiB}\n")
    lim = Cgroup(tmp_path, environ={}).read(HOST)
    assert lim.limit_bytes == 2 * GiB and lim.usage_bytes == GiB


def test_v2_without_the_memory_controller_is_unknown_with_a_reason(tmp_path: Path) -> None:
    put(tmp_path, "proc/self/cgroup", "0::/a\n")
    put(tmp_path, "proc/self/mountinfo", "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    (tmp_path / "sys/fs/cgroup/a").mkdir(parents=True)
    lim = Cgroup(tmp_path, environ={}).read(HOST)
    assert lim.limit_bytes is None and "memory controller is not enabled" in lim.reason
    assert lim.text().startswith("memory limit unknown: ")


def test_no_proc_is_unknown_and_mem_limit_still_counts(tmp_path: Path) -> None:
    lim = Cgroup(tmp_path, environ={}).read(HOST)
    assert lim.limit_bytes is None and "no /proc/self/cgroup" in lim.reason
    hub = Cgroup(tmp_path, environ={"MEM_LIMIT": str(GiB)}).read(HOST)
    assert (hub.limit_bytes, hub.source, hub.usage_bytes, hub.reason) == (GiB, "JupyterHub's MEM_LIMIT", None, "")
    assert applied(hub, HOST, 10 * GiB) == (GiB, None)  # the host's 10 GiB in use are not this container's


def test_mem_limit_below_the_cgroup_wins_and_keeps_the_cgroup_usage(tmp_path: Path) -> None:
    v1_layout(tmp_path, limit=8 * GiB)
    lim = Cgroup(tmp_path, environ={"MEM_LIMIT": str(4 * GiB)}).read(HOST)
    assert lim.limit_bytes == 4 * GiB and lim.source == "JupyterHub's MEM_LIMIT"
    assert lim.usage_bytes == 3 * GiB - GiB // 4 and lim.oom_kills == 2
    above = Cgroup(tmp_path, environ={"MEM_LIMIT": str(16 * GiB)}).read(HOST)
    assert above.limit_bytes == 8 * GiB
    junk = Cgroup(tmp_path, environ={"MEM_LIMIT": "4G"}).read(HOST)
    assert junk.limit_bytes == 8 * GiB


def test_a_limit_above_the_host_does_not_apply(tmp_path: Path) -> None:
    v1_layout(tmp_path, limit=128 * GiB)
    lim = Cgroup(tmp_path, environ={}).read(HOST)
    assert lim.limit_bytes == 128 * GiB and not lim.applies and near_limit(lim) is None
    assert "not below the host's RAM" in lim.text()


def test_near_limit_at_ninety_percent(tmp_path: Path) -> None:
    below = MemoryLimit(4 * GiB, int(3.5 * GiB), 0, "x", host_total_bytes=HOST)
    above = MemoryLimit(4 * GiB, int(3.7 * GiB), 0, "x", host_total_bytes=HOST)
    assert near_limit(below) is False and near_limit(above) is True
    no_usage = MemoryLimit(4 * GiB, None, None, "MEM_LIMIT", host_total_bytes=HOST)
    assert near_limit(no_usage) is None and near_limit(no_usage, rss_bytes=int(3.9 * GiB)) is True


def test_the_cpu_sample_uses_the_limit_where_it_is_lower(tmp_path: Path) -> None:
    v1_layout(tmp_path)
    probe = Probe(nvml=_nvml(), host=HostSource(limits=Cgroup(tmp_path, environ={})))
    probe.start()
    cpu = probe.samples()[0]
    assert cpu.device == "cpu" and cpu.memory_limit is not None and cpu.memory_limit.applies
    assert (cpu.host_total_bytes, cpu.host_used_bytes) == (4 * GiB, 3 * GiB - GiB // 4)
    probe.close()


def _nvml() -> NvmlSource:
    """No NVML: the cpu row is what is looked at."""
    return NvmlSource(SimpleNamespace(), environ={})


def test_this_machine() -> None:
    """Whatever this machine is, the reading is either a limit, no limit, or unknown with a reason."""
    host = psutil.virtual_memory().total
    c = Cgroup()
    lim = c.read(host)
    text = Path("/proc/self/cgroup").read_text() if Path("/proc/self/cgroup").exists() else ""
    if "memory" in text or "0::" in text:
        assert c.version in (1, 2) or c.reason
    if c.version is not None:
        assert c.dirs and c.dirs[0].is_dir()
        assert lim.usage_bytes is not None and lim.usage_bytes > 0
        assert lim.oom_kills is None or lim.oom_kills >= 0
    if lim.limit_bytes is None:
        assert applied(lim, host, 1) == (host, 1)
    else:
        assert lim.limit_bytes > 0
    h = HostSource()
    total, used, read = h.memory()
    assert read.host_total_bytes == host and total is not None and used is not None
    assert total == (read.limit_bytes if read.applies else host)


def test_status_and_the_gauge_show_the_limit(shell, tmp_path: Path) -> None:
    from nbmem.ipython.root import session_of
    from nbmem.ui.widget import snapshot_columns

    v1_layout(tmp_path, usage=int(3.9 * GiB), inactive=0)
    shell.run_line_magic("load_ext", "nbmem")
    s = session_of(shell)
    s.probe.host.limits = Cgroup(tmp_path, environ={})
    s.sampler.sample_once()
    text = str(s.status())
    assert "of a 4.00 GiB container limit (cgroup v1 memory.limit_in_bytes); 3.90 GiB of it in use" in text
    cols = snapshot_columns(s.store.latest_tick(), models={}, peaks={}, cpu_tensors_bytes=None)
    assert cols["device"][0] == "cpu" and cols["total"][0] == 4 * GiB and cols["used"][0] == int(3.9 * GiB)
    assert cols["limit"][0] == "cgroup v1 memory.limit_in_bytes" and cols["near_limit"][0] is True
    assert cols["model"][0] == "container memory limit"


def test_the_gauge_has_no_limit_where_none_applies(shell) -> None:
    from nbmem.ipython.root import session_of
    from nbmem.ui.widget import snapshot_columns

    shell.run_line_magic("load_ext", "nbmem")
    s = session_of(shell)
    s.probe.host.limits = Cgroup("/nonexistent-root", environ={})
    s.sampler.sample_once()
    assert "memory limit unknown: no /proc/self/cgroup" in str(s.status())
    cols = snapshot_columns(s.store.latest_tick(), models={}, peaks={}, cpu_tensors_bytes=None)
    assert cols["limit"][0] is None and cols["near_limit"][0] is None
    assert cols["model"][0] == "host RAM"
    assert cols["total"][0] == psutil.virtual_memory().total
