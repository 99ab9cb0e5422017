"""The leak scan over real tensors, without IPython: paths, dedup, graphs, and no references kept."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from nbmem.holders import findings, root_name, scan

MB = 2**20


def ns_scan(ns: dict, **kw):
    return scan([(k, "namespace", v) for k, v in ns.items()], torch=torch, **kw)


def by_holder(s, path):
    got = [h for h in s.storages.values() if path in h.holders]
    assert got, f"{path} not found; have {[h.holders for h in s.storages.values()]}"
    return got[0]


def test_paths_are_written_as_a_user_would_type_them():
    class Box:
        pass

    box = Box()
    box.saved = [None, None, torch.empty(MB)]
    model = torch.nn.Sequential(torch.nn.Linear(512, 512))
    model[0].weight.grad = torch.zeros(512, 512)
    model.extra = [torch.empty(MB // 4)]  # a module attribute that is not a parameter
    ns = {"x": torch.empty(MB // 4), "state": {"runs": [{"acts": torch.empty(MB // 4)}]}, "box": box,
          "model": model, "t": (1, torch.empty(10))}
    s = ns_scan(ns)
    for path in ("x", "state['runs'][0]['acts']", "box.saved[2]", "model.0.weight", "model.0.weight.grad",
                 "model.0.bias", "model.extra[0]", "t[1]"):
        by_holder(s, path)


def test_a_view_counts_its_whole_storage_once_and_lists_every_holder():
    big = torch.empty(4 * MB // 4)
    view = big[:2]
    s = ns_scan({"big": big, "view": view, "alias": big})
    assert len(s.storages) == 1
    h = next(iter(s.storages.values()))
    assert h.nbytes == 4 * MB
    assert set(h.holders) == {"big", "view", "alias"}
    assert s.totals["cpu"] == 4 * MB


def test_shared_containers_report_every_path():
    shared = [torch.empty(MB // 4)]
    s = ns_scan({"a": shared, "b": {"k": shared}})
    h = next(iter(s.storages.values()))
    assert {"a[0]", "b['k'][0]"} <= set(h.holders)


def test_closures_defaults_partials_methods_and_user_classes():
    import functools

    kept = torch.empty(MB // 4)

    def make():
        inner = torch.empty(MB // 4)

        def f():
            return inner
        return f

    def g(x=torch.empty(MB // 4)):
        return x

    class Cache:
        store = [torch.empty(MB // 4)]  # noqa: RUF012

    Cache.__module__ = "__main__"
    p = functools.partial(lambda a: a, kept)
    s = ns_scan({"f": make(), "g": g, "p": p, "Cache": Cache})
    by_holder(s, "f.<closure inner>")
    by_holder(s, "g.__defaults__[0]")
    by_holder(s, "p.args[0]")
    by_holder(s, "Cache.store[0]")


def test_optimizer_state_is_named_by_the_parameter_it_belongs_to():
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    s = ns_scan({"model": model, "opt": opt})
    h = by_holder(s, "opt.state[model.weight]['exp_avg']")
    assert h.nbytes == 256 * 256 * 4


def test_a_kept_graph_is_flagged_and_its_saved_tensors_counted():
    lin = torch.nn.Linear(1024, 1024)
    losses = []
    for _ in range(3):
        out = lin(torch.randn(512, 1024)).relu()
        losses.append(out.mean())
    del out
    s = ns_scan({"lin": lin, "losses": losses})
    graph_held = [h for h in s.storages.values() if h.holds_graph]
    assert len(graph_held) == 3
    # each graph keeps the input (2 MiB) and the relu output (2 MiB); the weight is lin's, not the graph's
    for h in graph_held:
        assert h.graph_bytes == 2 * 512 * 1024 * 4
        assert root_name(h.name) == "losses"
    detached = ns_scan({"lin": lin, "vals": [x.item() for x in losses]})
    assert not any(h.holds_graph for h in detached.storages.values())


def test_graph_memory_shared_by_two_holders_is_counted_once():
    lin = torch.nn.Linear(512, 512)
    total = 0
    for _ in range(2):
        total = total + lin(torch.randn(256, 512)).relu().mean()
    s = ns_scan({"lin": lin, "total": total, "again": total})
    assert sum(h.graph_bytes for h in s.storages.values()) == 2 * 2 * 256 * 512 * 4


def test_the_scan_holds_no_reference_once_it_returns():
    t = torch.empty(MB)
    g = t.requires_grad_().mul(2)  # a graph too: its nodes are visited
    ref, gref = weakref.ref(t), weakref.ref(g)
    ptr = t.untyped_storage().data_ptr()
    ns = {"t": t, "l": [t], "g": g}
    s = ns_scan(ns)
    assert ("cpu", ptr) in s.storages
    del t, g, ns
    gc.collect()
    assert ref() is None and gref() is None


def test_cycles_and_self_references_terminate():
    a: list = []
    a.append(a)
    a.append(torch.empty(10))
    d: dict = {}
    d["me"] = d
    s = ns_scan({"a": a, "d": d})
    by_holder(s, "a[1]")


def test_no_torch_means_nothing_to_find():
    s = scan([("x", "namespace", [1, 2, 3])], torch=None)
    assert s.storages == {} and s.totals == {}


def test_odd_objects_do_not_sink_the_scan():
    class Exploding:
        def __getattribute__(self, name):
            raise RuntimeError("boom")

    proxy = weakref.proxy(type("T", (), {})())  # a dead weakproxy (memlab#40)
    s = ns_scan({"e": Exploding(), "p": proxy, "t": torch.empty(4), "sparse": torch.eye(3).to_sparse(),
                 "meta": torch.empty(10, device="meta")})
    by_holder(s, "t")


def test_max_objects_truncates_and_says_so():
    s = ns_scan({"many": [[object()] for i in range(1000)]}, max_objects=10)
    assert s.truncated
    big = {"many": [[object()] for i in range(200_000)], "t": torch.empty(4)}
    assert ns_scan(big, budget_s=0.0).truncated
    assert not ns_scan(big).truncated


def test_small_containers_of_plain_values_are_not_walked_into():
    s = ns_scan({"rows": [{"a": i, "b": "x"} for i in range(1000)], "t": torch.empty(4)})
    assert s.objects_visited < 10


def test_findings_new_storage_new_holder_and_deleted_name_still_alive():
    x = torch.empty(MB)
    before = ns_scan({"x": x})
    after = ns_scan({"x": x, "y": x})
    f = findings(after, before, 7, threshold_bytes=MB)
    assert [(g.cell, g.name) for g in f] == [(7, "x")] and set(f[0].holders) == {"x", "y"}
    gone = ns_scan({"y": x})
    f = findings(gone, after, 8, threshold_bytes=MB)
    assert len(f) == 1 and "x was deleted or rebound" in f[0].hint and f[0].holders == ("y",)
    assert findings(gone, gone, 9, threshold_bytes=MB) == []
    assert findings(ns_scan({"small": torch.empty(10)}), None, 1, threshold_bytes=MB) == []


@pytest.mark.parametrize("path,root", [("x", "x"), ("losses[3]", "losses"), ("model.fc.weight", "model"),
                                       ("state['a']", "state"), ("Out[3]", "Out")])
def test_root_name(path, root):
    assert root_name(path) == root
