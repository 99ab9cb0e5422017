"""Reports at the scale of real models: one row per owner (the name a user typed), the detail one call away."""

from __future__ import annotations

import nbmem
from nbmem.ipython.root import session_of
from nbmem.reports import REPORT_ROWS
from tests.cells import autocast_steps, checkpointed_training
from tests.conftest import last_cell, ok

MiB = 2**20

# A peft-style stack without peft: a base model, a wrapper that adds small adapter tensors (each far under
# the 1 MiB threshold), and a trainer-like object that holds the wrapper and an optimizer over it.
STACK = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)

class TinyLM(nn.Module):
    def __init__(self, d=512, layers=8, vocab=2048):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one storage, two names

class LoraWrapper(nn.Module):
    def __init__(self, base, r=16):
        super().__init__()
        self.base_model = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.adapters = nn.ParameterList()
        for block in base.layers:
            for proj in (block.q_proj, block.k_proj):
                d = proj.in_features
                self.adapters.append(nn.Parameter(torch.zeros(r, d)))
                self.adapters.append(nn.Parameter(torch.zeros(d, r)))

class Trainer:
    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
"""


def rows(cell: int | None = None, **kw):
    return nbmem.leaks(cell=cell, **kw)


def test_a_40_layer_model_is_one_row_with_its_parameters_in_words(ip):
    ok(ip, "model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(40)])")
    f = rows(last_cell(ip))
    assert list(f["name"]) == ["model"], f
    row = f.iloc[0]
    assert row["tensors"] == 80 and row["bytes"] == 40 * (4 * MiB + 4096)
    assert row["what"] == "Sequential: 42M parameters", row["what"]
    assert row["hint"] == "`del model` frees it" and row["action"] == "%cudamem clean model"
    detail = rows(last_cell(ip), detail=True)
    # The detail explains the row: its 40 weights, and the 40 small biases as one row under the owner.
    assert len(detail) == 41 and set(detail["owner"]) == {"model"} and detail["bytes"].sum() == row["bytes"]
    assert (detail["bytes"] == 4 * MiB).sum() == 40
    assert detail.iloc[-1]["name"] == "model" and detail.iloc[-1]["tensors"] == 40
    report = session_of(ip).last_report
    assert len(report.findings) == 1 and "<details>" in report._repr_html_()
    assert "model.0.weight" in report._repr_html_(), "the HTML row expands to its biggest members"


def test_a_model_kept_by_another_object_after_del_is_one_row_naming_the_keeper(ip):
    ok(ip, "model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(40)])\n"
           "class Keeper:\n    pass\nkeeper = Keeper()\nkeeper.model = model")
    ok(ip, "del model")
    f = rows(last_cell(ip))
    assert list(f["name"]) == ["keeper"] and f["tensors"].iloc[0] == 80, f
    assert f["hint"].iloc[0] == ("`model` was deleted or rebound, but `keeper.model` still holds it: "
                                 "`%cudamem clean keeper` frees it")
    assert f["what"].iloc[0] == "Keeper: 42M parameters"


def test_thirty_losses_with_graphs_are_one_row_their_graphs_counted_once(ip):
    ok(ip, "lin = torch.nn.Linear(1024, 1024)\nlosses = []")
    ok(ip, "for _ in range(30):\n    losses.append(lin(torch.randn(256, 1024)).pow(2).mean())")
    f = rows(last_cell(ip))
    assert list(f["name"]) == ["losses"], f
    row = f.iloc[0]
    # each loss keeps its input (1 MiB) and the linear's output (1 MiB); lin's weight is lin's, not the graph's
    assert row["tensors"] == 30 and row["graph_bytes"] == 30 * 2 * MiB and row["holds_graph"]
    assert row["what"] == f"list of 30 scalars + their graphs ({60:.1f} MiB)"
    assert "`.item()`" in row["hint"]
    assert len(rows(last_cell(ip), detail=True)) == 30


def test_a_peft_style_stack_names_the_model_not_the_optimizers_alias(ip):
    ok(ip, STACK)
    ok(ip, "base = TinyLM()")
    ok(ip, "model = LoraWrapper(base)")  # 32 adapter tensors of 32 KiB: 1 MiB together, none over the threshold
    f = rows(last_cell(ip))
    assert list(f["name"]) == ["model"], f
    assert f["tensors"].iloc[0] == 32 and f["bytes"].iloc[0] == 32 * 16 * 512 * 4
    assert f["what"].iloc[0] == "LoraWrapper: 262K parameters", f["what"].iloc[0]
    ok(ip, "del base")  # base lives on in model.base_model: one row, not one per parameter
    f = rows(last_cell(ip))
    assert list(f["name"]) == ["model"] and f["tensors"].iloc[0] == 17, f
    assert f["hint"].iloc[0] == ("`base` was deleted or rebound, but `model.base_model` still holds it: "
                                 "`%cudamem clean model` frees it")
    ok(ip, "trainer = Trainer(model)\nmodel(torch.zeros(1, dtype=torch.long)) if False else None")
    now = rows()
    by_name = now.set_index("name")
    assert "trainer" not in by_name.index, "the trainer holds only aliases of the model's parameters"
    assert by_name.loc["model", "also_held_by"] == ["trainer"]
    assert by_name.loc["model", "what"] == "LoraWrapper: 5.51M parameters (262K trainable)"
    ok(ip, "del model")
    f = rows(last_cell(ip))
    assert list(f["name"]) == ["trainer"], f
    assert f["hint"].iloc[0].startswith("`model` was deleted or rebound, but `trainer.model` still holds it")


def test_tied_weights_and_views_are_counted_once(ip):
    ok(ip, STACK)
    ok(ip, "lm = TinyLM()\nembeddings = lm.embed.weight[:100]")  # a view of the tied storage, by another name
    f = rows(last_cell(ip)).set_index("name")
    params = 2048 * 512 + 8 * 2 * 512 * 512  # the tied matrix once, 16 projections
    assert f.loc["lm", "bytes"] == params * 4 and f.loc["lm", "what"] == "TinyLM: 5.24M parameters"
    assert "embeddings" not in f.index, "a view of memory lm already owns adds nothing"
    assert session_of(ip).last_report.held_bytes == params * 4


def test_a_report_shows_at_most_eight_owners_then_says_how_many_more(ip):
    ok(ip, "\n".join(f"t{i} = torch.empty({(i + 2) * 2**18})" for i in range(12)))
    report = session_of(ip).last_report
    assert [f.name for f in report.holders.shown] == [f"t{i}" for i in range(11, 3, -1)], "largest first"
    rest = sum((i + 2) * MiB for i in range(4))
    call = f"nbmem.leaks(cell={report.cell})"
    assert report.holders.more_line() == f"and 4 more ({rest / MiB:.1f} MiB): `{call}` lists them all"
    assert str(report).count("\n") < 20 and report.holders.more_line() in str(report)
    assert len(report.holders.shown) == REPORT_ROWS
    # --last-report removes exactly the owners the report showed
    assert str(report).splitlines()[-1] == ("`%cudamem clean --last-report` would run: "
                                            + " ".join(f"t{i}" for i in range(11, 3, -1)))
    ip.run_line_magic("cudamem", "clean --last-report")
    assert {f"t{i}" for i in range(4)} <= set(ip.user_ns) and not {f"t{i}" for i in range(4, 12)} & set(ip.user_ns)


def test_grouping_changes_rows_never_totals(ip):
    ok(ip, STACK)
    ok(ip, "lm = TinyLM()\nlosses = [lm.lm_head(torch.randn(64, 512)).sum() for _ in range(5)]\n"
           "stats = {e: {'acc': torch.zeros(1000)} for e in range(300)}")
    sess = session_of(ip)
    cur = sess.holdings.scan_all()
    owners = sess.holdings.current()
    detail_storage = sum(h.nbytes for h in cur.storages.values())
    assert sum(f.storage_bytes for f in owners.owners) <= detail_storage
    from nbmem.holders import owners as owners_mod

    every = owners_mod.group(list(cur.storages.values()), lambda hs: 0, threshold_bytes=0, graphs={},
                             types=cur.root_types)[0]
    assert sum(f.storage_bytes for f in every) == detail_storage == cur.totals["cpu"]
    # 300 per-epoch dicts of 4 KB tensors: each far under the threshold, together 1.1 MiB, under one owner
    stats = next(f for f in owners.owners if f.name == "stats")
    assert stats.tensors == 300 and stats.what() == "dict of 300 tensors"


MIXED_PRECISION = checkpointed_training(width=256, blocks=4, classes=10, batch=256, device="cpu", lr=1e-3)
TRAIN = autocast_steps(steps=4, device="cpu", dtype="bfloat16")


def test_a_rerun_mixed_precision_checkpointed_training_cell_finds_nothing_new(ip):
    """Autocast's cached casts, GradScaler's state and recomputed activations are no news on a re-run: the
    first run makes the optimizer's state and the gradients (true), the next ones nothing."""
    ok(ip, MIXED_PRECISION)
    session = session_of(ip)
    found = []
    for _ in range(4):
        ok(ip, TRAIN)
        rep = session.last_report
        found.append({f.name: f.what() for f in rep.findings})
    assert set(found[0]) == {"opt", "model"} and "gradients" in found[0]["model"], found[0]
    assert found[1:] == [{}, {}, {}], found
    assert session.last_report.unattributed == () and not session.should_show(session.last_report)
    assert ip.user_ns["out"].dtype == ip.user_ns["torch"].bfloat16, "the cell really ran under autocast"


def test_what_a_cell_adds_to_an_owner_it_already_had_is_said_to_be_new(ip):
    ok(ip, "model = torch.nn.Sequential(torch.nn.Linear(1024, 1024))")
    ok(ip, "model.add_module('head', torch.nn.Linear(1024, 1024))")  # an adapter, a new head: added to `model`
    f = rows(last_cell(ip))
    assert list(f["name"]) == ["model"] and f["what"].iloc[0] == "Sequential: 1.05M new parameters", f["what"]
    assert rows().set_index("name").loc["model", "what"] == "Sequential: 2.1M parameters"


def test_many_ways_to_a_model_through_a_trainer_do_not_hide_that_the_models_own_name_still_holds_it(ip):
    # transformers' Trainer reaches the model as model, model_wrapped, accelerator._models[0],
    # callback_handler.model, bound methods...: more ways than a walk keeps per object
    ok(ip, "model = torch.nn.Linear(512, 512)\nopt = torch.optim.Adam(model.parameters())\n"
           "class Trainer:\n    pass\ntrainer = Trainer()\n"
           "for i in range(12):\n    setattr(trainer, f'ref{i}', model)\ntrainer.optimizer = opt")
    ok(ip, "trainer.ref0(torch.randn(8, 512)).sum().backward()\ntrainer.optimizer.step()")
    f = rows(last_cell(ip))
    assert not f["hint"].str.contains("was deleted").any(), f[["name", "hint"]].to_string()
    assert set(f["name"]) == {"model", "opt"}, "the gradients are the model's, the Adam state the optimizer's"
    assert rows().set_index("name").loc["model", "also_held_by"] == ["trainer", "opt"]


def test_the_detail_explains_every_owner_row_even_of_many_small_tensors(ip, capsys):
    # 1,000 dicts of one 4 KiB tensor each: every tensor far under the threshold, in a container of its own.
    ok(ip, "import torch\nmetrics = []")
    ok(ip, "for i in range(1000):\n    metrics.append({'loss': torch.zeros(1024)})")
    cell = last_cell(ip)
    owners, detail = rows(cell), rows(cell, detail=True)
    assert list(owners["name"]) == ["metrics"]
    assert len(detail) >= 1 and detail["bytes"].sum() == owners["bytes"].sum() == 1000 * 4096
    assert set(detail["owner"]) == {"metrics"} and detail["tensors"].sum() == 1000
    capsys.readouterr()
    ip.run_line_magic("cudamem", f"leaks --cell {cell} --detail")
    text = capsys.readouterr().out
    assert "metrics" in text and "nothing" not in text
    # Held now, with a big tensor beside small ones under one owner: the big one is its own row, the 50
    # small ones in one container are grouped, and the rows add up to the owner's.
    ok(ip, "big = {'w': torch.zeros(2**20), 'small': [torch.zeros(100) for _ in range(50)]}")
    now = rows(detail=True)
    mine = now[now["owner"] == "big"]
    assert list(mine["name"]) == ["big['w']", "big['small']"] and list(mine["tensors"]) == [1, 50]
    assert mine["bytes"].sum() == rows().set_index("name").loc["big", "bytes"]
    assert set(now["owner"]) == set(rows()["name"]), "every owner row has its detail"


# -- whose memory it is, and what frees it (issue 37) ----------------------------------------------------
def test_state_is_told_by_the_type_alone_without_running_user_code():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nbmem.holders.intent import state_of

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = TensorDataset(torch.zeros(4, 2))
    told = [state_of(type(x)) for x in (model, opt, torch.optim.lr_scheduler.StepLR(opt, 1),
                                        torch.amp.GradScaler("cpu", enabled=False), ds, DataLoader(ds))]
    assert told == ["model", "optimizer", "LR scheduler", "gradient scaler", "dataset", "data loader"]
    assert [state_of(type(x)) for x in (torch.zeros(1), [model], {"m": model})] == ["", "", ""]

    class Meta(type):
        def __getattribute__(cls, name):
            raise AssertionError(f"user code ran: {name}")

        def __subclasscheck__(cls, sub):
            raise AssertionError("user code ran: __subclasscheck__")

    class Hostile(torch.nn.Module, metaclass=type("M", (Meta, type(torch.nn.Module)), {})):
        pass

    assert state_of(Hostile) == "model"


def test_a_loop_leftover_names_memory_after_its_container_and_state_never_passes_to_a_list():
    from nbmem.holders.naming import container_first
    from nbmem.records import HolderKind

    ns = HolderKind.NAMESPACE
    assert container_first([("m.weight", ns), ("model.2.weight", ns)], lambda r: True)[0][0] == "model.2.weight"
    # a trainer's attribute is not an element: the model keeps its memory
    ranked = [("model.0.weight", ns), ("trainer.model.0.weight", ns)]
    assert container_first(ranked, lambda r: True) == ranked
    # a plain list of models is not state: the model stays the owner of its own weights
    ranked = [("model.0.weight", ns), ("ensemble[0].0.weight", ns)]
    assert container_first(ranked, lambda r: r == "model") == ranked


def test_a_hint_says_del_frees_it_only_where_that_name_alone_frees_it(ip):
    ok(ip, "model = torch.nn.Linear(512, 1024)\nx = torch.randn(2048, 512)\npreds = model(x)\n"
           "kept = torch.randn(2048, 512)")
    by = {r.name: r for r in session_of(ip).last_report.findings}
    assert by["kept"].hint == "`del kept` frees it"
    assert by["x"].hint == ("`del x` frees nothing: `x` is also saved by the graph of `preds`, so it goes with "
                            "`preds` → `%cudamem clean x preds`")
    assert by["preds"].hint == "`del preds` frees it", "its graph saved only x, which x's row counts"
    # x needs no grad, so the graph saves no weight; but its AccumulateGrad nodes hold the parameters themselves.
    assert by["model"].state == "model" and by["model"].hint.startswith(
        "`del model` frees nothing: `model.weight` is also saved by the graph of `preds` (and 1 more of its "
        "tensors)"), by["model"].hint  # the bias: saved by the same graph
    assert by["model"].hint.endswith("→ `%cudamem clean model preds`")
    assert session_of(ip).last_report.last_report_cleanup().names == ("preds", "x", "kept")


def test_the_cell_report_and_leaks_agree_after_a_loop_binds_the_last_batch(ip):
    ok(ip, "val_batches = [(torch.randn(512, 512), torch.randn(512, 512)) for _ in range(4)]")
    made = rows(last_cell(ip))
    ok(ip, "for x, y in val_batches:\n    pass")
    now = rows()
    assert dict(zip(made.name, made.tensors)) == dict(zip(now.name, now.tensors)) == {"val_batches": 8}, now
    assert list(now.also_held_by.iloc[0]) == ["x", "y"] and "`%cudamem clean val_batches x y`" in now.hint.iloc[0]
