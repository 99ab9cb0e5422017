"""The holders of host memory the flight recorder names: sizes read without running user code, in a bounded time."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pandas as pd
import torch

from nbmem.holders.hostheld import MIN_BYTES, scan_host

MiB = 2**20


def held(**names: Any) -> dict[str, tuple[str, int, bool, str]]:
    r = scan_host(names.items(), budget_s=5.0)
    assert r.reason == "", r.reason
    return {h.name: (h.what, h.bytes, h.partial, h.uncounted) for h in r.holders}


def test_arrays_frames_buffers_and_cpu_tensors_by_their_own_sizes() -> None:
    big = [bytearray(2 * MiB) for _ in range(20)]
    arr = np.ones((1000, 500))
    df = pd.DataFrame({"a": np.arange(500_000.0), "b": np.arange(500_000, dtype=np.int32)})
    t = torch.zeros(1_000_000)
    got = held(big=big, arr=arr, df=df, t=t, blob=b"x" * (3 * MiB), small=[1, 2, 3])
    assert got["big"][:2] == ("list of 20 bytearray", 20 * bytearray.__sizeof__(big[0]) + list.__sizeof__(big))
    assert got["arr"][:2] == ("ndarray float64 (1000, 500)", 4_000_000)
    assert got["df"][:2] == ("DataFrame 500,000 × 2", 500_000 * 12)
    assert got["t"][:2] == ("Tensor float32 [1000000]", 4_000_000)
    assert got["blob"][1] == bytes.__sizeof__(b"x" * (3 * MiB))
    assert "small" not in got  # under MIN_BYTES
    r = scan_host({"arr": arr, "big": big}.items())
    assert [h.name for h in r.holders] == ["big", "arr"]  # biggest first


def test_memory_two_names_reach_is_counted_once_and_views_count_their_base() -> None:
    base = np.zeros(1_000_000)
    view = base[:10]
    chunk = bytearray(4 * MiB)
    got = held(view=view, base=base, chunks=[chunk] * 100, again=[chunk])
    assert got["view"][1] == 8_000_000  # a view keeps its whole base alive
    assert "base" not in got  # already counted under `view`, read first
    assert got["chunks"][1] == bytearray.__sizeof__(chunk) + list.__sizeof__([chunk] * 100)
    assert "again" not in got
    t = torch.zeros(1_000_000)
    got = held(t=t, t2=t[10:], s=pd.Series(np.arange(300_000.0)))
    assert got["t"][1] == 4_000_000 and "t2" not in got  # one storage
    assert got["s"][:2] == ("Series 300,000 float64", 2_400_000)


def test_what_is_not_counted_is_said() -> None:
    obj = np.empty(300_000, dtype=object)
    nums = [float(i) for i in range(300_000)]
    got = held(obj=obj, nums=nums, mv=memoryview(bytearray(2 * MiB)))
    assert got["mv"][:2] == ("memoryview", bytearray.__sizeof__(bytearray(2 * MiB)))  # the buffer it keeps
    assert got["obj"][3] == "an object array's elements"
    assert got["nums"][3] == "its numbers' objects" and got["nums"][1] == list.__sizeof__(nums)


def test_user_objects_are_read_through_their_dict_and_slots_without_running_their_code() -> None:
    calls: list[str] = []

    class Hostile:
        __slots__ = ("__dict__", "slotted")

        def __getattr__(self, name: str) -> Any:
            calls.append(f"__getattr__ {name}")
            raise AttributeError(name)

        def __getattribute__(self, name: str) -> Any:
            calls.append(f"__getattribute__ {name}")
            return object.__getattribute__(self, name)

        def __len__(self) -> int:
            calls.append("__len__")
            raise RuntimeError

        def __sizeof__(self) -> int:
            calls.append("__sizeof__")
            raise RuntimeError

        def __iter__(self) -> Any:
            calls.append("__iter__")
            raise RuntimeError

        def __eq__(self, other: object) -> bool:
            calls.append("__eq__")
            raise RuntimeError

        def __hash__(self) -> int:
            calls.append("__hash__")
            raise RuntimeError

        def __repr__(self) -> str:
            calls.append("__repr__")
            raise RuntimeError

        @property
        def data(self) -> Any:
            calls.append("property")
            raise RuntimeError

    class Meta(type):
        def __hash__(cls) -> int:
            calls.append("metaclass __hash__")
            raise RuntimeError

        def __eq__(cls, other: object) -> bool:
            calls.append("metaclass __eq__")
            raise RuntimeError

    class Odd(metaclass=Meta):
        pass

    class Buf(bytearray):
        def __sizeof__(self) -> int:
            calls.append("Buf.__sizeof__")
            raise RuntimeError

        def __len__(self) -> int:
            calls.append("Buf.__len__")
            raise RuntimeError

    class Seq(list):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            calls.append("Seq.__iter__")
            raise RuntimeError

        def __len__(self) -> int:
            calls.append("Seq.__len__")
            raise RuntimeError

    class Arr(np.ndarray):  # type: ignore[type-arg]
        @property
        def nbytes(self) -> int:  # type: ignore[override]
            calls.append("Arr.nbytes")
            raise RuntimeError

        @property
        def base(self) -> Any:  # type: ignore[override]
            calls.append("Arr.base")
            raise RuntimeError

        def __getattr__(self, name: str) -> Any:
            calls.append(f"Arr.__getattr__ {name}")
            raise AttributeError(name)

    class Frame(pd.DataFrame):
        def __getattribute__(self, name: str) -> Any:
            if name == "_mgr":
                calls.append("Frame._mgr")
            return super().__getattribute__(name)

        def __sizeof__(self) -> int:
            calls.append("Frame.__sizeof__")
            raise RuntimeError

    h = Hostile()
    object.__setattr__(h, "payload", bytearray(3 * MiB))
    object.__setattr__(h, "slotted", np.zeros(500_000))
    frame = Frame({"a": np.zeros(400_000)})
    calls.clear()
    got = held(h=h, odd=[Odd() for _ in range(100)], buf=Buf(2 * MiB), seq=Seq([bytearray(2 * MiB)]),
               arr=np.zeros(300_000).view(Arr), frame=frame)
    assert calls == []
    payload = 3 * MiB + 4_000_000  # and its instance dict's own few hundred bytes
    assert got["h"][0] == "Hostile" and payload < got["h"][1] < payload + 4096
    assert got["buf"][1] == bytearray.__sizeof__(Buf(2 * MiB))
    assert got["seq"][1] >= 2 * MiB and got["arr"][1] == 2_400_000 and got["frame"][1] == 3_200_000


def test_the_scan_stays_in_its_budget_and_says_what_it_left(capsys: Any) -> None:
    many = {f"v{i}": [i, str(i), {"a": i}] for i in range(20_000)}
    many["late"] = [bytearray(2 * MiB) for _ in range(3)]
    many["arr"] = np.ones(1_000_000)
    t0 = time.perf_counter()
    r = scan_host(many.items(), budget_s=0.005)
    took = time.perf_counter() - t0
    assert took < 1.0 and r.elapsed_s <= took  # a budget of 5 ms, on a busy two-core machine
    assert r.names < 20_002 and r.reason.startswith("the scan's budget (5 ms) ran out with ")
    if r.names_total is None:  # the budget ran out while the names were listed
        assert "and the rest not listed" in r.reason
    full = scan_host(many.items(), budget_s=10.0)
    assert full.reason == "" and full.names == full.names_total == 20_002
    assert {"late", "arr"} <= {h.name for h in full.holders}
    with capsys.disabled():
        print(f"\nhost holders of 20,002 names: {full.elapsed_s * 1000:.0f} ms for {full.objects:,} objects")


def test_a_long_list_of_numbers_does_not_starve_the_names_after_it() -> None:
    nums = list(range(3_000_000))
    big = [bytearray(2 * MiB) for _ in range(3)]
    r = scan_host({"nums": nums, "big": big}.items(), budget_s=0.05)
    assert "big" in {h.name for h in r.holders}, r
    assert all(h.bytes >= MIN_BYTES for h in r.holders)
