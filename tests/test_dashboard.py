"""The operators' Grafana dashboard (docs/grafana/nbmem.json) and alert rules (docs/grafana/alerts.yaml) query only
what the server serves: every metric and label in their PromQL is checked against a real ``/metrics``.

The served names come from a real jupyter server with the extension and the fake NVML (tests/test_server.py's
``JupyterServer``): a notebook's kernel holds memory on a GPU, then is killed, so that every nbmem family has
samples, and so labels. Prometheus adds the target's labels to every series it scrapes: its own ``job`` and
``instance``, and those the scrape config in docs/operators.md gives each target (``user``, ``host``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests import fake_nvml
from tests.test_server import GiB, JupyterServer, fake_gpu

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs/grafana/nbmem.json"
ALERTS = ROOT / "docs/grafana/alerts.yaml"
OPERATORS = ROOT / "docs/operators.md"

# -- reading PromQL -------------------------------------------------------------------------------------------
AGGREGATIONS = frozenset("sum min max avg group stddev stdvar count count_values bottomk topk quantile".split())
FUNCTIONS = frozenset(
    """
    abs absent absent_over_time avg_over_time ceil changes clamp clamp_max clamp_min count_over_time day_of_month
    day_of_week day_of_year days_in_month delta deriv exp floor histogram_quantile hour idelta increase irate
    label_join label_replace last_over_time ln log10 log2 max_over_time min_over_time minute month predict_linear
    present_over_time quantile_over_time rate resets round scalar sgn sort sort_desc sqrt stddev_over_time
    stdvar_over_time sum_over_time time timestamp vector year""".split()
)
#: Label lists: ``by``/``without`` of an aggregation, ``on``/``ignoring``/``group_*`` of a binary operator.
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "offset", "bool", "atan2", "inf", "nan", "group_left", "group_right"})
MATCHERS = frozenset({"=", "!=", "=~", "!~"})
# Grafana's variables ($near, ${near}, $__range, [[near]]) stand for numbers, durations or regexes: a number
# reads as any of them (inside a string or a range it is read as part of that).
GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])                                        # [5m], [1h:1m]
  | (?P<number>(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:ms|[smhdwy])?)
  | (?P<word>[A-Za-z_:][\w:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=(){},@])
  | (?P<space>\s+)
""",
    re.X,
)
LEGEND_LABEL = re.compile(r"\$labels\.(\w+)")  # a rule's annotations; Grafana's {{label}} is read as this too
LABEL_VALUES = re.compile(r"^\s*label_values\((?P<expr>.*),\s*(?P<label>\w+)\s*\)\s*$", re.S)


@dataclass
class Uses:
    """What one PromQL expression names: its metrics, the labels of its selectors ``(metric, label)``, and its label
    lists ``(clause, labels, metrics in the clause's scope)``; ``functions``: calls that PromQL does not have."""

    metrics: list[str] = field(default_factory=list)
    selectors: list[tuple[str | None, str]] = field(default_factory=list)
    groupings: list[tuple[str, tuple[str, ...], frozenset[str]]] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)


def tokens(expr: str) -> list[tuple[str, str]]:
    """``expr`` as (kind, text) pairs, spaces left out; ValueError at what PromQL cannot have."""
    text, at, out = GRAFANA_VARIABLE.sub("1", expr), 0, []
    while at < len(text):
        m = TOKEN.match(text, at)
        if m is None:
            raise ValueError(f"cannot read {text[at : at + 20]!r}")
        assert m.lastgroup is not None
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
        at = m.end()
    return out


def uses(expr: str) -> Uses:
    """Read ``expr`` (a small reader, not a parser: enough to find names in the expressions we write).

    A ``by``/``without`` list's scope is its aggregation's argument; an ``on``/``ignoring``/``group_*`` list's is
    the innermost parenthesised group around it (the whole expression at the top)."""
    toks = tokens(expr)
    closing: dict[int, int] = {}
    opened: list[int] = []
    for i, (_, t) in enumerate(toks):
        if t == "(":
            opened.append(i)
        elif t == ")":
            if not opened:
                raise ValueError("a ')' closes nothing")
            closing[opened.pop()] = i
    if opened:
        raise ValueError("a '(' is never closed")
    u = Uses()
    metric_at: dict[int, str] = {}
    lists: list[tuple[int, str, int, int]] = []  # (clause's index, clause, its list's "(" and ")")
    owner: str | None = None
    in_braces = False
    skip: set[int] = set()
    for i, (kind, t) in enumerate(toks):
        after = toks[i + 1][1] if i + 1 < len(toks) else ""
        if t == "{":
            owner, in_braces = metric_at.get(i - 1), True
        elif t == "}":
            in_braces = False
        elif kind != "word" or i in skip:
            continue
        elif in_braces:
            if after not in MATCHERS:
                raise ValueError(f"{t!r} in a selector is not followed by a matcher")
            u.selectors.append((owner, t))
        elif t in AGGREGATIONS and after in ("(", "by", "without"):
            continue
        elif after == "(" and t in GROUPING:
            lists.append((i, t, i + 1, closing[i + 1]))
            skip.update(range(i + 1, closing[i + 1]))
        elif after == "(":
            if t not in FUNCTIONS:
                u.functions.append(t)
        elif t.lower() not in KEYWORDS:
            metric_at[i] = t
            u.metrics.append(t)
    for i, clause, start, end in lists:
        labels = tuple(t for k, t in toks[start + 1 : end] if k == "word")
        if clause in ("by", "without") and toks[i - 1][1] in AGGREGATIONS:
            scope = (end + 1, closing.get(end + 1, end + 1))
        elif clause in ("by", "without") and toks[i - 1][1] == ")":
            scope = next((o, c) for o, c in closing.items() if c == i - 1)
        else:
            scope = max(((o, c) for o, c in closing.items() if o < i < c), default=(-1, len(toks)))
        u.groupings.append((clause, labels, frozenset(m for j, m in metric_at.items() if scope[0] < j < scope[1])))
    return u


# -- what the dashboard and the alert rules query ---------------------------------------------------------------
@dataclass(frozen=True)
class Query:
    """One PromQL expression, where it is (file, then titles and names), and the text that names its labels."""

    where: str
    expr: str
    legend: str = ""  # text whose $labels.label names a label of the result


def queries_of(doc: Any, where: str = "") -> Iterator[Query]:
    """Every PromQL expression in a dashboard or a rule file: each ``expr`` (panel targets, annotations, rules) and
    each query variable, whose ``label_values(EXPR, LABEL)`` is read as ``group by (LABEL) (EXPR)``."""
    if isinstance(doc, Mapping):
        name = doc.get("title") or doc.get("alert") or doc.get("name")
        where = f"{where}/{name}" if isinstance(name, str) else where
        if isinstance(doc.get("expr"), str):
            grafana = " ".join(str(doc.get(k, "")) for k in ("legendFormat", "titleFormat", "textFormat"))
            tags = " ".join(f"$labels.{t.strip()}" for t in str(doc.get("tagKeys", "")).split(",") if t.strip())
            legend = re.sub(r"\{\{\s*(\w+)\s*\}\}", r"$labels.\1", grafana) + tags
            yield Query(where, doc["expr"], legend + json.dumps(doc.get("annotations", {})))
        if doc.get("type") == "query" and "query" in doc:
            q = doc["query"]["query"] if isinstance(doc["query"], Mapping) else doc["query"]
            m = LABEL_VALUES.match(q)
            yield Query(where, f"group by ({m['label']}) ({m['expr']})" if m else q)
        for v in doc.values():
            yield from queries_of(v, where)
    elif isinstance(doc, list):
        for v in doc:
            yield from queries_of(v, where)


def problems(queries: list[Query], served: Mapping[str, frozenset[str]], scrape_labels: frozenset[str]) -> list[str]:
    """What in ``queries`` is not served: metrics, and labels of served metrics; [] when all of it is."""
    out: list[str] = []

    def on(label: str, metric: str) -> bool:
        return label in scrape_labels or label in served.get(metric, ())

    for q in queries:
        try:
            u = uses(q.expr)
        except ValueError as e:
            out.append(f"{q.where}: {e} in {q.expr!r}")
            continue
        out += [f"{q.where}: {f}() is no PromQL function" for f in u.functions]
        out += [f"{q.where}: no metric {m} is served" for m in u.metrics if m not in served]
        out += [f"{q.where}: a selector without a metric name" for m, _ in u.selectors if m is None]
        out += [f"{q.where}: {m} has no label {label}" for m, label in u.selectors if m in served and not on(label, m)]
        for clause, labels, metrics in u.groupings:
            known = [m for m in metrics if m in served]
            check = all if clause in ("on", "ignoring") else any
            out += [
                f"{q.where}: {clause} ({label}): not a label of {', '.join(sorted(known))}"
                for label in labels
                if known and not check(on(label, m) for m in known)
            ]
        named = set(LEGEND_LABEL.findall(q.legend))
        out += [
            f"{q.where}: the legend's {label} is not a label of its query"
            for label in sorted(named)
            if not any(on(label, m) for m in u.metrics)
        ]
    return out


def scrape_labels() -> frozenset[str]:
    """``job``, ``instance`` and the labels docs/operators.md's file_sd example gives each target."""
    blocks = [
        json.loads(b) for b in re.findall(r"```json\n(.*?)```", OPERATORS.read_text(), re.S) if "__metrics_path__" in b
    ]
    assert blocks, "docs/operators.md has no file_sd example"
    return frozenset({"job", "instance"} | {k for t in blocks[0] for k in t["labels"] if not k.startswith("__")})


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def alerts() -> dict[str, Any]:
    return dict(yaml.safe_load(ALERTS.read_text()))


def panels(board: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [p for top in board["panels"] for p in [top, *top.get("panels", [])]]


# -- what the server serves --------------------------------------------------------------------------------------
IDLE = "nbmem-idle"
# An idle kernel: says its PID next to its connection file, then sleeps until the server that started it is gone.
SLEEP = (
    "import os, sys, time\nopen(sys.argv[1] + '.pid', 'w').write(str(os.getpid()))\nparent = os.getppid()\n"
    "while os.getppid() == parent:\n    time.sleep(1)\n"
)


def idle_kernels(server: Any, n: int) -> list[int]:
    """``n`` notebooks (``team/nb000.ipynb``...), each with a kernel that only sleeps; their PIDs.

    Real processes that the server starts, watches and restarts like any kernel, in milliseconds each, that need
    no client: ipykernel's import would cost each of them a second, and nothing here talks to a kernel."""
    spec = server.root / "data/kernels" / IDLE
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {"argv": [sys.executable, "-c", SLEEP, "{connection_file}"], "display_name": IDLE, "language": "python"}
        )
    )
    kernel_ids = []
    for i in range(n):
        model = {
            "path": f"team/nb{i:03d}.ipynb",
            "name": f"nb{i:03d}.ipynb",
            "type": "notebook",
            "kernel": {"name": IDLE},
        }
        status, body = server.request("POST", "/api/sessions", model)
        assert status == 201, f"POST /api/sessions: {status} {body[:300]!r}\n{server.log()[-2000:]}"
        kernel_ids.append(json.loads(body)["kernel"]["id"])
    pids = []
    deadline = time.monotonic() + 60
    for kid in kernel_ids:
        said = server.runtime / f"kernel-{kid}.json.pid"
        while not (said.exists() and said.read_text()):
            assert time.monotonic() < deadline, f"kernel {kid} never said its PID"
            time.sleep(0.05)
        pids.append(int(said.read_text()))
    return pids


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, frozenset[str]]:
    """Each sample name in a real server's ``/metrics`` and its labels, with a kernel on a GPU and a kernel dead."""
    root = tmp_path_factory.mktemp("served")
    gpus = root / "gpus.json"
    fake_nvml.write(gpus, [fake_gpu(0, 0, [])])  # devices are read at startup
    config = {"NbmemServer": {"nvml_module": "tests.fake_nvml"}, "KernelManager": {"shutdown_wait_time": 1.0}}
    with JupyterServer(root, config, {fake_nvml.ENV: str(gpus)}) as server:
        [pid] = idle_kernels(server, 1)
        fake_nvml.write(gpus, [fake_gpu(0, 2 * GiB, [(pid, GiB)])])
        texts = [server.request("GET", "/metrics")[1].decode()]
        time.sleep(2)  # the extension registers with a kernel's restarter within a second of its start (busy: more)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not re.search(r"^nbmem_kernel_deaths_total\{.*\} [1-9]", texts[-1], re.M):
            assert time.monotonic() < deadline, "the death was never counted:\n" + server.log()[-3000:]
            time.sleep(0.2)
            texts.append(server.request("GET", "/metrics")[1].decode())
    assert "nbmem_kernel_gpu_memory_bytes{" in texts[0], texts[0]
    labels: dict[str, set[str]] = {}
    families: dict[str, bool] = {}
    for text in (texts[0], texts[-1]):
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels.setdefault(s.name, set()).update(s.labels)
            families[family.name] = families.get(family.name, False) or bool(family.samples)
    assert all(sampled for name, sampled in families.items() if name.startswith("nbmem_")), families
    return {name: frozenset(ls) for name, ls in labels.items()}


# -- the tests --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_metric_and_label_the_dashboard_and_the_alerts_query_is_served(served: dict[str, frozenset[str]]) -> None:
    board, rules = dashboard(), alerts()
    queries = [*queries_of(board, "nbmem.json"), *queries_of(rules, "alerts.yaml")]
    written = (
        sum(len(p.get("targets", [])) for p in panels(board))
        + sum("expr" in a for a in board["annotations"]["list"])
        + sum(v["type"] == "query" for v in board["templating"]["list"])
        + sum(len(g["rules"]) for g in rules["groups"])
    )
    assert len(queries) == written, [q.where for q in queries]
    assert problems(queries, served, scrape_labels()) == []
    named = {m for q in queries for m in uses(q.expr).metrics}
    assert {m for m in served if m.startswith("nbmem_")} <= named, "every nbmem metric has a place on the board"


@pytest.mark.slow
def test_a_made_up_metric_or_label_fails_the_same_check(served: dict[str, frozenset[str]]) -> None:
    board, rules = dashboard(), alerts()
    targets = [t for p in panels(board) for t in p.get("targets", [])]
    targets[0]["expr"] = "sum by (user) (nbmem_kernel_gpu_memory_byte)"  # a typo
    targets[1]["expr"] = 'sum by (notebok) (nbmem_kernel_gpu_memory_bytes{gpuu="0"})'
    targets[2]["legendFormat"] = "{{kernel}}"
    rules["groups"][0]["rules"][0]["expr"] = 'nbmem_kernel_deaths{reason="oom-kill"} > 0'  # the family, not a series
    variable = "label_values(nbmem_gpu_memory_used_bytes, notebook)"
    board["templating"]["list"][-1] = {"type": "query", "name": "x", "query": variable}
    queries = [*queries_of(board, "nbmem.json"), *queries_of(rules, "alerts.yaml")]
    found = "\n".join(problems(queries, served, scrape_labels()))
    for wrong in (
        "no metric nbmem_kernel_gpu_memory_byte is served",
        "has no label gpuu",
        "by (notebok)",
        "legend's kernel",
        "no metric nbmem_kernel_deaths is served",
        "by (notebook): not a label of nbmem_gpu_memory_used_bytes",
    ):
        assert wrong in found, found
    assert problems([Query("q", "sum(nbmem_gpu_memory_used_bytes) by (gpuu)")], served, frozenset()) == [
        "q: by (gpuu): not a label of nbmem_gpu_memory_used_bytes"
    ]
    assert problems(
        [Query("q", "nbmem_gpu_memory_used_bytes * on (notebook) nbmem_kernel_gpu_memory_bytes")], served, frozenset()
    ) == ["q: on (notebook): not a label of nbmem_gpu_memory_used_bytes, nbmem_kernel_gpu_memory_bytes"]


def test_the_reader_finds_metrics_not_functions_keywords_strings_durations_or_variables() -> None:
    u = uses(
        'sum without (kernel_id) (rate(a_total{x="b c", y=~"$user"}[$__rate_interval] offset 1h30m)) / on (gpu) '
        "group_left (notebook) max by (gpu, notebook) (b:recorded) > bool 1e9 and c unless d offset 5m or "
        "vector(0) * -Inf"
    )
    assert u.metrics == ["a_total", "b:recorded", "c", "d"]
    assert u.selectors == [("a_total", "x"), ("a_total", "y")]
    assert [(c, ls, sorted(ms)) for c, ls, ms in u.groupings] == [
        ("without", ("kernel_id",), ["a_total"]),
        ("on", ("gpu",), ["a_total", "b:recorded", "c", "d"]),
        ("group_left", ("notebook",), ["a_total", "b:recorded", "c", "d"]),
        ("by", ("gpu", "notebook"), ["b:recorded"]),
    ]
    assert uses("sum(x) by (a) + frobnicate(y)").functions == ["frobnicate"]
    assert [(c, sorted(ms)) for c, _, ms in uses("sum(x) by (a) + y").groupings] == [("by", ["x"])]
    for broken in ("sum(x", "x)", "x{a}", "x ~ y"):
        with pytest.raises(ValueError):
            uses(broken)


def test_the_dashboard_asks_for_its_prometheus_and_the_docs_explain_every_panel_and_alert() -> None:
    board, rules = dashboard(), alerts()
    assert board["schemaVersion"] == 42 and board["uid"] == "nbmem" and "id" not in board
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"host", "user", "notebook", "gpu"} <= set(variables)
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for p in panels(board):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
        assert p.get("description"), f"{p['title']}: says what it shows"
    docs = OPERATORS.read_text()
    titles = [p["title"] for p in panels(board) if p["type"] != "row"]
    for title in titles + [r["alert"] for g in rules["groups"] for r in g["rules"]]:
        assert f"**{title}**" in docs, f"docs/operators.md explains {title!r}"
    for r in (r for g in rules["groups"] for r in g["rules"]):
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"], r["alert"]
