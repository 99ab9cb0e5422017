"""The holder scan over real tensors, without IPython: paths, identity, graphs, hostile objects, cost by change."""

from __future__ import annotations

import functools
import gc
import sys
import types
import weakref
from collections import OrderedDict, defaultdict, deque
from unittest import mock

import pytest
import torch

from nbmem.holders import walk
from nbmem.holders.findings import current, findings, graph_candidates
from nbmem.holders.scanner import Scanner
from nbmem.holders.walk import Root
from nbmem.records import HolderKind, root_name

MB = 2**20
NS = HolderKind.NAMESPACE
RAN: list[str] = []  # every hostile hook below appends here; nothing may run while looking


@pytest.fixture(autouse=True)
def _nothing_ran():
    RAN.clear()
    yield
    assert RAN == [], f"user code ran during the scan: {RAN}"


def test_each_strategy_name_in_the_walk_is_its_member_and_every_type_gets_a_named_one() -> None:
    for member in walk.Strategy:
        assert getattr(walk, f"_{member.name}") is member
    info = walk.classify(OrderedDict, torch.Tensor, torch.nn.Module, torch.optim.Optimizer)
    assert info.strategy is walk.Strategy.DICT and "DICT" in repr(info)


def roots(ns: dict) -> list[Root]:
    return [Root(k, NS, v) for k, v in ns.items()]


def scan(ns: dict, scanner: Scanner | None = None, **kw):
    sc = scanner or Scanner(lambda: torch)
    return sc.update(roots(ns), cell=kw.pop("cell", 0), walk=kw.pop("walk", "all"), **kw)


def by_holder(s, path):
    got = [h for h in s.storages.values() if path in h.holders]
    assert got, f"{path} not found; have {[h.holders for h in s.storages.values()]}"
    return got[0]


def finds(ns: dict, threshold=MB):
    sc = Scanner(lambda: torch)
    s = scan(ns, sc)
    return current(s, threshold_bytes=threshold, graphs=sc.graphs(graph_candidates(s, None), exclude=s.storages))


# -- paths ---------------------------------------------------------------------------------------------
def test_paths_are_written_as_a_user_would_type_them():
    class Box:
        pass

    box = Box()
    box.saved = [None, None, torch.empty(MB)]
    model = torch.nn.Sequential(torch.nn.Linear(512, 512))
    model[0].weight.grad = torch.zeros(512, 512)
    model.extra = [torch.empty(MB // 4)]
    ns = {"x": torch.empty(MB // 4), "state": {"runs": [{"acts": torch.empty(MB // 4)}]}, "box": box,
          "model": model, "t": (1, torch.empty(10)), "od": OrderedDict(k=torch.empty(8)),
          "dd": defaultdict(list, k=[torch.empty(8)]), "dq": deque([torch.empty(8)]), "fs": frozenset([torch.empty(8)])}
    s = scan(ns)
    for path in ("x", "state['runs'][0]['acts']", "box.saved[2]", "model.0.weight", "model.0.weight.grad",
                 "model.0.bias", "model.extra[0]", "t[1]", "od['k']", "dd['k'][0]", "dq[0]", "fs{…}"):
        by_holder(s, path)


def test_a_view_counts_its_whole_storage_once_lists_every_holder_and_says_it_is_a_view():
    big = torch.empty(4 * MB // 4)
    s = scan({"big": big, "view": big[:2], "alias": big})
    assert len(s.storages) == 1
    h = next(iter(s.storages.values()))
    assert h.nbytes == 4 * MB and set(h.holders) == {"big", "view", "alias"} and s.totals["cpu"] == 4 * MB
    (only_view,) = finds({"dataset": torch.empty(MB)[:1]})
    assert only_view.view_bytes == 4 and only_view.storage_bytes == 4 * MB
    assert only_view.what() == "a 4 B view of a 4.00 MiB storage"
    (whole,) = finds({"big": big})
    assert whole.what() == "tensor", "the bytes column already says 4.00 MiB"


def test_a_storage_is_named_by_a_whole_tensor_before_a_short_name_for_a_small_view():
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.empty(MB, 2))
    sc = Scanner(lambda: torch)
    s = scan({"test_data": data, "x": data[0][0]}, sc)
    assert by_holder(s, "x").holders[:2] == ("test_data.tensors[0]", "x")
    # the same name, later bound to the whole tensor, is a whole tensor again: no longer a view, it is an alias
    # of the dataset's tensor, which names it (the container a person deletes, before a bare name)
    s = scan({"test_data": data, "x": data.tensors[0]}, sc)
    assert by_holder(s, "x").holders[:2] == ("test_data.tensors[0]", "x")
    # between two bare names, the whole tensor still names it before the view
    s = scan({"v": data[0][0], "x": data.tensors[0]}, Scanner(lambda: torch))
    assert by_holder(s, "x").holders[:2] == ("x", "v")


def test_closures_defaults_partials_methods_user_classes_and_hook_closures():
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

        def method(self):
            return None

    Cache.__module__ = "__main__"
    model = torch.nn.Linear(4, 4)
    captured = torch.empty(MB // 4)
    model.register_forward_hook(lambda m, i, o: captured)
    p = functools.partial(lambda a: a, kept)
    s = scan({"f": make(), "g": g, "p": p, "Cache": Cache, "m": Cache().method, "model": model})
    by_holder(s, "f.<closure inner>")
    by_holder(s, "g.__defaults__[0]")
    by_holder(s, "p.args[0]")
    by_holder(s, "Cache.store[0]")
    assert any("<closure captured>" in p for h in s.storages.values() for p in h.holders), "the hook's closure"


def test_optimizer_state_is_named_by_the_parameter_it_belongs_to():
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    s = scan({"model": model, "opt": opt})
    h = by_holder(s, "opt.state[model.weight]['exp_avg']")
    assert h.nbytes == 256 * 256 * 4 and "optimizer state" in h.roles


def test_sparse_tensors_count_their_indices_and_values():
    sp = torch.eye(512).to_sparse()
    csr = torch.eye(512).to_sparse_csr()
    s = scan({"sp": sp, "csr": csr})
    by_holder(s, "sp.indices()")
    by_holder(s, "sp.values()")
    by_holder(s, "csr.crow_indices()")
    by_holder(s, "csr.col_indices()")


def test_slots_from_every_class_in_the_mro_without_getattr():
    class Base:
        __slots__ = ("a", "unset")

    class Child(Base):
        __slots__ = ("b",)

        def __getattr__(self, name):
            RAN.append(f"__getattr__ {name}")
            raise AttributeError(name)

    c = Child()
    c.a, c.b = torch.empty(8), torch.empty(8)
    s = scan({"c": c})
    by_holder(s, "c.a")
    by_holder(s, "c.b")


def test_generator_and_coroutine_frames_are_followed():
    def gen():
        local = torch.empty(MB // 4)
        yield 1
        del local

    g = gen()
    next(g)
    s = scan({"g": g})
    assert any(h.holders[0].startswith("g.") for h in s.storages.values())


def test_tensor_attributes_and_exception_args():
    t = torch.empty(8)
    t.extra = torch.empty(16)
    err = ValueError("bad", torch.empty(32))
    s = scan({"t": t, "err": err})
    by_holder(s, "t.extra")
    by_holder(s, "err.args[1]")


# -- graphs ------------------------------------------------------------------------------------------------
def test_a_kept_graph_is_flagged_and_its_saved_tensors_counted():
    lin = torch.nn.Linear(1024, 1024)
    losses = []
    for _ in range(3):
        out = lin(torch.randn(512, 1024)).relu()
        losses.append(out.mean())
    del out
    sc = Scanner(lambda: torch)
    s = scan({"lin": lin, "losses": losses}, sc)
    graphs = sc.graphs(graph_candidates(s, None), exclude=s.storages)
    kept = [h for h in s.storages.values() if h.holds_graph]
    assert len(kept) == 3
    for h in kept:  # the input (2 MiB) and the relu output (2 MiB); the weight is lin's, not the graph's
        assert graphs[h.sid].nbytes == 2 * 512 * 1024 * 4 and root_name(h.name) == "losses"
    fs = [f for f in current(s, threshold_bytes=MB, graphs=graphs) if f.name.startswith("losses")]
    assert sorted(f.name for f in fs) == ["losses[0]", "losses[1]", "losses[2]"], "4 bytes + a 4 MiB graph each"
    assert all(f.graph_bytes == 4 * MB and f.holds_graph and ".item()" in f.hint for f in fs)


def test_after_a_truncated_scan_a_kept_loss_is_not_blamed_for_the_model_the_scan_did_not_reach():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))  # 4 MiB
    loss = model(torch.randn(16, 1024)).sum()  # its graph saves 64 KiB of activations, and holds the weights
    ns = {"loss": loss, "huge": [[i, str(i)] for i in range(300_000)], "model": model}
    sc = Scanner(lambda: torch)
    s = scan(ns, sc, budget_s=0.0)
    assert s.truncated and "model" in s.unfinished and by_holder(s, "loss")
    sid = by_holder(s, "loss").sid
    blamed = sc.graphs([sid], exclude=s.storages)[sid]  # what the graph's bytes were: the model's weights in them
    weights = {sc.storages.known(p.untyped_storage()) for p in model.parameters()}  # seen by that graph walk
    assert blamed.nbytes >= 4 * MB
    g = sc.graphs([sid], exclude=s.storages, truncated=True)[sid]
    assert weights <= g.named and not weights & set(g.saved) and 0 < g.nbytes < MB
    full = scan(ns, sc)  # a scan that reaches the model: its weights are named, and the graph's bytes the same
    assert sc.graphs([sid], exclude=full.storages, truncated=full.truncated)[sid].nbytes == g.nbytes


def test_saved_tensor_hooks_do_not_run_while_looking():
    def pack(x):
        return x

    def unpack(x):
        RAN.append("unpack hook")
        return x

    a = torch.randn(1000, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        b = (a * a).sum()
    sc = Scanner(lambda: torch)
    s = scan({"b": b, "a": a}, sc)
    g = sc.graphs(graph_candidates(s, None), exclude=s.storages)
    assert sum(x.nbytes for x in g.values()) == 0, "a is held by name: not the graph's"


def test_a_graph_shared_by_two_names_is_listed_under_each():
    lin = torch.nn.Linear(1024, 1024)
    outs = lin(torch.randn(1024, 1024)).relu()
    loss = outs.sum()
    fs = finds({"lin": lin, "val_outputs": outs, "val_losses": loss})
    by = {f.name: f for f in fs}
    assert by["val_losses"].graph_shared_with == ("val_outputs",) or "val_outputs" in by["val_losses"].graph_shared_with
    assert "shared with" in by["val_losses"].hint and "val_outputs" in by["val_losses"].hint


def test_many_small_tensors_are_one_group():
    lin = torch.nn.Linear(64, 64)
    losses = [lin(torch.randn(256, 64)).relu().mean() for _ in range(1000)]
    (f,) = [f for f in finds({"lin": lin, "losses": losses}) if f.name == "losses"]
    assert f.tensors == 1000 and f.storage_bytes == 4000 and f.graph_bytes > MB
    assert f.what().startswith("1,000 tensors, 3.91 KiB + graph")
    assert f.roots == ("losses",)


# -- identity ------------------------------------------------------------------------------------------------
def test_rebinding_to_a_same_size_tensor_is_not_news():
    sc = Scanner(lambda: torch)
    ns = {"x": torch.empty(MB)}
    s1 = scan(ns, sc)
    ns["x"] = torch.empty(MB)  # the allocator may even hand out the same address
    s2 = sc.update(roots(ns), cell=2, walk="changed", mentioned={"x"})
    assert findings(s2, s1, 2, threshold_bytes=MB, graphs={}) == []
    ns["x"] = torch.empty(2 * MB)  # bigger: that is news
    s3 = sc.update(roots(ns), cell=3, walk="changed", mentioned={"x"})
    assert [f.name for f in findings(s3, s2, 3, threshold_bytes=MB, graphs={})] == ["x"]


def test_a_gradient_recreated_by_the_next_step_is_not_news_and_first_seen_cells_stay_right():
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = Scanner(lambda: torch)
    ns = {"model": model, "opt": opt}
    prev = scan(ns, sc, cell=1)
    for cell in range(2, 5):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 1024)).sum().backward()
        opt.step()
        cur = sc.update(roots(ns), cell=cell, walk="changed", mentioned={"model", "opt"})
        got = findings(cur, prev, cell, threshold_bytes=MB, graphs={})
        assert [f.name for f in got] == (["model.weight.grad"] if cell == 2 else []), cell
        prev = cur
    grad = by_holder(cur, "model.weight.grad")
    assert grad.first_cell == 4, "each step made a new gradient storage: it first appeared in the last cell"
    assert by_holder(cur, "model.weight").first_cell == 1


def test_a_name_deleted_while_a_container_still_holds_it():
    sc = Scanner(lambda: torch)
    x = torch.empty(MB)
    ns = {"x": x, "bag": []}
    s1 = scan(ns, sc)
    ns["bag"].append(x)
    del ns["x"], x
    s2 = sc.update(roots(ns), cell=2, walk="changed", mentioned={"bag"})
    (f,) = findings(s2, s1, 2, threshold_bytes=MB, graphs={})
    assert f.name == "bag[0]" and "`x` was deleted or rebound, but `bag[0]` still holds it" in f.hint


def test_the_scan_keeps_no_strong_reference():
    t = torch.empty(MB)
    g = t.requires_grad_().mul(2)
    ref, gref = weakref.ref(t), weakref.ref(g)
    ns = {"t": t, "l": [t], "g": g}
    sc = Scanner(lambda: torch)
    s = scan(ns, sc)
    sc.graphs(graph_candidates(s, None), exclude=s.storages)
    del t, g, ns
    gc.collect()
    assert ref() is None and gref() is None


# -- hostile objects ----------------------------------------------------------------------------------------
class Loud(list):
    def __len__(self):
        RAN.append("__len__")
        raise RuntimeError("len")

    def __iter__(self):
        RAN.append("__iter__")
        raise RuntimeError("iter")

    def __getitem__(self, i):
        RAN.append("__getitem__")
        raise RuntimeError("getitem")


class LoudDict(dict):
    def items(self):
        RAN.append("items")
        raise RuntimeError

    def __iter__(self):
        RAN.append("dict __iter__")
        raise RuntimeError

    def keys(self):
        RAN.append("keys")
        raise RuntimeError


class BadKey:
    def __repr__(self):
        RAN.append("__repr__")
        raise RuntimeError("repr")

    def __hash__(self):
        return 1  # hashing happens when the user builds the dict, not while nbmem looks

    def __eq__(self, other):
        RAN.append("__eq__")
        return self is other


class Attrs:
    def __getattribute__(self, name):
        RAN.append(f"__getattribute__ {name}")
        raise RuntimeError("boom")


class Proxy:
    """A lazy proxy: reading its __dict__ would resolve it (and allocate)."""

    @property
    def __dict__(self):
        RAN.append("property __dict__")
        return {"resolved": torch.empty(4 * MB)}

    @property
    def __class__(self):
        RAN.append("property __class__")
        return dict


class Meta(type):
    def __eq__(cls, other):
        RAN.append("metaclass __eq__")
        return False

    def __hash__(cls):
        RAN.append("metaclass __hash__")
        return 1

    def __instancecheck__(cls, obj):
        RAN.append("metaclass __instancecheck__")
        return False

    def __subclasscheck__(cls, sub):
        RAN.append("metaclass __subclasscheck__")
        return False


class Weird(metaclass=Meta):
    pass


class Node:
    def __init__(self, nxt):
        self.next = nxt


class Counting(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        RAN.append(f"__torch_function__ {getattr(func, '__name__', func)}")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_containers_are_read_through_their_base_type_never_their_overrides():
    loud = Loud([torch.empty(8), torch.empty(8)])
    ld = LoudDict(k=torch.empty(8))
    s = scan({"loud": loud, "ld": ld})
    by_holder(s, "loud[0]")
    by_holder(s, "loud[1]")
    by_holder(s, "ld['k']")


def test_keys_are_labelled_without_their_repr_and_big_reprs_are_bounded():
    s = scan({"d": {BadKey(): torch.empty(8), "k" * 5_000_000: torch.empty(16), ("a", 1): torch.empty(32)}})
    by_holder(s, "d[<BadKey>]")
    by_holder(s, "d[('a', 1)]")
    long = [p for h in s.storages.values() for p in h.holders if p.startswith("d['kkk")]
    assert long and all(len(p) < 100 for p in long)


def test_objects_that_raise_or_run_code_on_access_are_skipped_alone():
    siblings = [Attrs(), torch.empty(8), Proxy(), torch.empty(16), Weird(), mock.MagicMock(), torch.empty(32)]
    m = siblings[5]
    s = scan({"siblings": siblings, "proxy": Proxy(), "weird": Weird, "w": Weird()})
    for i in (1, 3, 6):
        by_holder(s, f"siblings[{i}]")
    assert m.mock_calls == [] and m.method_calls == []


def test_tensor_subclasses_are_read_without_torch_function():
    x = torch.empty(64).as_subclass(Counting)
    s = scan({"x": x})
    by_holder(s, "x")


def test_a_dead_weak_proxy_and_a_deep_chain_do_not_break_the_scan():
    proxy = weakref.proxy(type("T", (), {})())
    chain = torch.empty(8)
    for _ in range(100_000):
        chain = Node(chain)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # nothing in the scan may recurse per level
    try:
        s = scan({"p": proxy, "chain": chain})
    finally:
        sys.setrecursionlimit(limit)
    assert s.errors == 0 and not s.unfinished
    assert s.storages == {} or all(len(p) < 400 for h in s.storages.values() for p in h.holders)


def test_a_chain_of_a_thousand_is_found_and_its_path_is_shortened():
    chain = torch.empty(8)
    for _ in range(1000):
        chain = Node(chain)
    sys.setrecursionlimit(sys.getrecursionlimit())
    s = scan({"chain": chain, "short": Node(Node(torch.empty(16)))})
    by_holder(s, "short.next.next")


def test_cycles_and_self_references_terminate():
    a: list = []
    a.append(a)
    a.append(torch.empty(10))
    d: dict = {}
    d["me"] = d
    big = [[i] for i in range(100)]
    big.append(big)
    s = scan({"a": a, "d": d, "big": big})
    by_holder(s, "a[1]")


def test_containers_of_plain_data_are_skipped_at_c_speed_yet_a_tensor_inside_is_found():
    rows = [{"a": i, "b": [i, float(i)]} for i in range(50_000)]
    s = scan({"rows": rows, "t": torch.empty(4)})
    assert s.objects >= 100_000, "proven inert in bulk, every object counted"
    rows[31_337]["b"].append(torch.empty(16))
    s = scan({"rows": rows})
    by_holder(s, "rows[31337]['b'][2]")


def test_no_torch_means_nothing_to_find():
    s = Scanner(lambda: None).update(roots({"x": [1, 2, 3]}), cell=0)
    assert s.storages == {} and s.totals == {}


# -- cost in proportion to change -----------------------------------------------------------------------
def test_only_changed_or_mentioned_roots_are_walked_again():
    sc = Scanner(lambda: torch)
    ns = {"data": [[i] for i in range(10_000)], "bag": [], "model": torch.nn.Linear(8, 8)}
    scan(ns, sc)
    s = sc.update(roots(ns), cell=1, walk="changed")
    assert s.walked == ()
    ns["bag"].append(torch.empty(MB))  # resized: walked
    s = sc.update(roots(ns), cell=2, walk="changed")
    assert s.walked == ("bag",) and by_holder(s, "bag[0]")
    ns["bag"][0] = torch.empty(2 * MB)  # same size, not mentioned: the cached tensor is gone, so walked
    s = sc.update(roots(ns), cell=3, walk="changed")
    assert s.walked == ("bag",) and by_holder(s, "bag[0]").nbytes == 2 * MB * 4
    ns["model"].weight.data = torch.empty(8, 8)  # a storage swapped under an unchanged root
    s = sc.update(roots(ns), cell=4, walk="changed")
    assert s.walked == ("model",)
    s = sc.update(roots(ns), cell=5, walk="changed", mentioned={"data"})
    assert s.walked == ("data",)


def test_a_time_budget_stops_the_walk_and_names_what_it_did_not_finish():
    ns = {"small": torch.empty(8), "huge": [[i, str(i)] for i in range(300_000)]}
    s = scan(ns, budget_s=0.0)
    assert s.truncated and "huge" in s.unfinished
    s = scan(ns)
    assert not s.truncated and by_holder(s, "small")


def test_hidden_types_module_objects_are_walked_when_reached():
    mod = types.ModuleType("made_by_hand")
    mod.big = torch.empty(MB)
    s = scan({"mod": mod})
    by_holder(s, "mod.big")


def test_a_new_gradient_found_under_one_root_is_also_named_under_the_others_that_reach_it():
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = Scanner(lambda: torch)
    ns = {"model": model, "opt": opt}
    scan(ns, sc)
    model(torch.randn(4, 512)).sum().backward()
    s = sc.update(roots(ns), cell=2, walk="changed", mentioned={"model"}, validate=False)
    grad = by_holder(s, "model.weight.grad")
    assert grad.roots == {"model", "opt"} and set(s.walked) == {"model", "opt"}


def test_outputs_of_one_model_do_not_share_a_graph_but_a_loss_made_from_them_does():
    lin = torch.nn.Linear(1024, 1024)
    outs = [lin(torch.randn(512, 1024)) for _ in range(3)]
    by = {f.name: f for f in finds({"lin": lin, "outs": outs})}
    assert all(not by[f"outs[{i}]"].graph_shared_with for i in range(3)), "they meet only at lin's parameters"


def test_a_parameter_is_part_of_its_model_whichever_root_was_walked_first():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    hints = {f.name: f.hint for f in finds({"opt": opt, "model": model})}  # the optimizer's state keys first
    assert hints["model.0.weight"] == "part of `model`, also held by opt: deleting them frees it"
    assert hints["opt.state[model.0.weight]['exp_avg']"] == "optimizer state: it lives as long as `opt` does"
    # the model deleted: only the optimizer holds the weight, and says so
    hints = {f.name: f.hint for f in finds({"opt": opt})}
    assert hints["opt.param_groups[0]['params'][0]"].startswith("a parameter only `opt` still holds")


# -- odd holders: each of these was missed or mislabelled before -------------------------------------------
def test_a_holder_deep_in_a_linked_structure_is_named_with_its_middle_counted():
    class Node:
        def __init__(self, prev):
            self.prev, self.state = prev, None

    head = None
    for i in range(1500):
        head = Node(head)
        if i == 0:
            head.state = torch.empty(MB)  # on the oldest node: 1,499 steps from the root
    h = by_holder(scan({"head": head}), "head" + ".prev" * 7 + "…(1,486 more)" + ".prev" * 6 + ".state")
    assert h.nbytes == 4 * MB


def test_enum_frozenset_and_weakref_keys_are_written_out_without_running_their_code():
    import enum

    class Split(enum.Enum):
        TRAIN = "train"

        def __repr__(self):
            RAN.append("Split.__repr__")
            return "no"

        def __hash__(self):
            return 1

    class Key:
        pass

    key = Key()
    wkd = weakref.WeakKeyDictionary()
    wkd[key] = torch.empty(8)
    s = scan({"by_split": {Split.TRAIN: torch.empty(8)}, "by_set": {frozenset({"a"}): torch.empty(8)},
              "wkd": wkd, "key": key})
    by_holder(s, "by_split[Split.TRAIN]")
    by_holder(s, "by_set[frozenset({'a'})]")
    by_holder(s, "wkd.data[<weakref to Key>]")  # a weak key, a strong value: the value is held


def test_caches_state_bags_iterators_and_class_registries_are_reached():
    @functools.cache
    def features(n):
        return torch.empty(n)

    @functools.lru_cache(maxsize=2)
    def bounded(n):
        return torch.empty(n)

    features(8), bounded(16)

    class Registry:
        items = {"a": torch.empty(8)}  # noqa: RUF012

    Registry.__module__ = "__main__"
    batches = [torch.empty(8), torch.empty(8)]
    s = scan({"features": features, "bounded": bounded, "state": types.SimpleNamespace(w=torch.empty(8)),
              "it": iter(batches), "pairs": zip(batches, batches, strict=False), "vals": {"x": torch.empty(8)}.values(),
              "Registry": Registry})
    for path in ("features.<lru_cache>[8]", "bounded.<lru_cache>[…]", "state.w", "it.<iterator>[0]",
                 "pairs.<iterator>[1].<iterator>[1]", "vals.<iterator>['x']", "Registry.items['a']"):
        by_holder(s, path)
    (f,) = [f for f in finds({"features": features}, threshold=0)]
    assert f.hint == "a result cached by `features` (functools.lru_cache): `features.cache_clear()` frees it"


def test_weak_values_are_not_holders():
    t = torch.empty(MB)
    wvd = weakref.WeakValueDictionary(a=t)
    ws = weakref.WeakSet([t])
    s = scan({"wvd": wvd, "ws": ws})
    assert not s.storages, "only weak references reach it"
    del t
