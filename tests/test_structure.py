"""The house by capability, held against the code: folders, what may import what, sizes, no cycles.

Each sub-package's docstring says what it may import (a line ``May import: ``nbmem.x``, ...``); these tests read
those lines and the top-level modules' rules below, so the docs and the checks cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nbmem"
#: The top-level modules and what each may import (sub-packages and modules, by their first name under nbmem).
TOP_RULES: dict[str, set[str]] = {
    "formatting": set(),
    "options": {"formatting"},
    "records": {"formatting"},
    "reports": {"formatting", "records"},
    "store": {"formatting", "records"},
    "sampler": {"records", "measure"},
    "session": {"formatting", "options", "records", "reports", "store", "sampler", "measure", "trace", "holders",
                "recorder", "cells", "clean", "fitting"},
    "server": {"formatting", "records", "measure", "recorder"},
    "__init__": {"*"},  # the public functions: thin wrappers that import what they wrap, lazily
}
MAX_TOP_MODULES = 12
MAX_LINES = 600
MAX_CLASS_LINES = 310
#: The presentation's consumers use the session's seam, never the engine's insides.
CONSUMERS = ["ui/widget.py", "ui/plotting.py", "server.py"]
INSIDES = {"store", "sampler", "probe", "nvml", "scanner", "holdings", "cells", "_listeners", "last_scan"}
PUBLIC = ["leaks", "cleanup", "fit", "samples", "plot", "plot_fit", "report", "status", "last_death", "lines", "Gauge"]


def modules() -> list[str]:
    """Every module of the package, sub-packages too, as a path from ``nbmem/`` (``fitting/runs/runner.py``)."""
    return sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py"))


def subpackages() -> list[str]:
    return sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())


def tree(name: str) -> ast.Module:
    return ast.parse((PKG / name).read_text(), filename=name)


def dotted(name: str) -> str:
    """``holders/walk.py`` → ``nbmem.holders.walk``; ``clean/__init__.py`` → ``nbmem.clean``."""
    parts = ["nbmem", *Path(name).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(mod: str) -> str:
    """The folder or top-level module a dotted name belongs to: ``nbmem.holders.walk`` → ``holders``."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(name: str) -> set[str]:
    """The nbmem modules ``name`` imports, anywhere in it (type-only and function-local imports too)."""
    out: set[str] = set()
    known = {dotted(m) for m in modules()}
    for n in ast.walk(tree(name)):
        if isinstance(n, ast.ImportFrom) and n.level:
            raise AssertionError(f"{name}: relative import; nbmem's imports are absolute (`from nbmem.x import y`)")
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "nbmem":
            for a in n.names:  # `from nbmem.holders import walk` imports the module nbmem.holders.walk
                out.add(f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in known else n.module)
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.split(".")[0] == "nbmem"}
    return {m for m in out if m != "nbmem" and m != dotted(name)}


def declared(pkg: str) -> set[str]:
    """What a sub-package's docstring says it may import ({"*"} for "anything")."""
    doc = ast.get_docstring(tree(f"{pkg}/__init__.py")) or ""
    m = re.search(r"^May import(?::| anything)(.*?)(?:\n\n|\Z)", doc, re.S | re.M)
    assert m, f"nbmem/{pkg}/__init__.py's docstring does not say what {pkg}/ may import ('May import: ...')"
    if "anything" in m.group(0).split(".")[0]:
        return {"*"}
    return {unit(x) for x in re.findall(r"``(nbmem\.[\w.]+)``", m.group(1))}


def rules() -> dict[str, set[str]]:
    return {**TOP_RULES, **{p: declared(p) for p in subpackages()}}


def test_the_top_holds_few_modules_and_the_rest_is_in_folders_that_say_what_they_own() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly in nbmem/: {top}"
    assert {p.removesuffix(".py") for p in top} <= set(TOP_RULES), f"a top-level module without a rule: {top}"
    for pkg in subpackages():
        doc = ast.get_docstring(tree(f"{pkg}/__init__.py"))
        assert doc and len(doc.splitlines()) >= 3, f"nbmem/{pkg}/ does not say what it owns"
        declared(pkg)


@pytest.mark.parametrize("name", modules())
def test_every_import_is_one_its_folder_allows(name: str) -> None:
    me = unit(dotted(name))
    allowed = rules()[me]
    if "*" in allowed:
        return
    bad = sorted(m for m in imports_of(name) if unit(m) != me and unit(m) not in allowed)
    assert not bad, f"{name} ({me}/) imports {bad}; {me} may import {sorted(allowed)}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules_or_between_folders() -> None:
    by_module = {dotted(n): imports_of(n) for n in modules() if not n.endswith("__init__.py") or "/" in n}
    by_module.pop("nbmem", None)  # the public functions import everything lazily; nothing imports them back
    assert _cycles(by_module) == [], "modules import each other (type-only imports count too)"
    by_unit: dict[str, set[str]] = {}
    for mod, deps in by_module.items():
        by_unit.setdefault(unit(mod), set()).update(unit(d) for d in deps if unit(d) != unit(mod))
    assert _cycles(by_unit) == [], "folders import each other"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_is_a_monolith() -> None:
    """One job per module: no file over 600 lines, no class over ~300."""
    for name in modules():
        lines = len((PKG / name).read_text().splitlines())
        assert lines <= MAX_LINES, f"{name} has {lines} lines"
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                assert size <= MAX_CLASS_LINES, f"{name}: class {node.name} has {size} lines"


def test_no_folder_hides_a_public_function() -> None:
    # Importing nbmem.x binds the attribute x of nbmem: a folder named like a public function replaces it.
    assert not set(subpackages()) & set(PUBLIC)
    import nbmem

    for pkg in subpackages():
        __import__(f"nbmem.{pkg}")
    for name in PUBLIC[:-1]:
        assert callable(getattr(nbmem, name)), name


@pytest.mark.parametrize("name", [n for n in CONSUMERS if (PKG / n).exists()])
def test_consumers_do_not_import_the_adapter_or_reach_into_the_engine(name: str) -> None:
    assert not any(unit(m) == "ipython" for m in imports_of(name)), f"{name} imports the IPython adapter"
    reached = sorted({n.attr for n in ast.walk(tree(name)) if isinstance(n, ast.Attribute) and n.attr in INSIDES})
    assert reached == [], f"{name} reaches into the engine: {reached}"


#: What gives torch's memory back, as the code spells it; only ``clean/release.py`` may (one choke point).
RELEASES = {"empty_cache": "cuda", "reset": "dynamo", "_cuda_clearCublasWorkspaces": ""}


def releases_in(name: str) -> list[str]:
    """Where a module empties CUDA's cache (``t.cuda.empty_cache``), resets torch.compile (``dynamo.reset``) or
    clears cuBLAS's workspaces (the binding, by attribute or by its name as a string)."""
    out = []
    for n in ast.walk(tree(name)):
        if isinstance(n, ast.Attribute) and n.attr in RELEASES:
            owner = n.value.attr if isinstance(n.value, ast.Attribute) else getattr(n.value, "id", "")
            if RELEASES[n.attr] in owner:
                out.append(f"{name}:{n.lineno}: {owner}.{n.attr}")
        elif isinstance(n, ast.Constant) and n.value == "_cuda_clearCublasWorkspaces":
            out.append(f"{name}:{n.lineno}: {n.value!r}")
    return out


def test_torchs_memory_is_given_back_in_one_place() -> None:
    assert releases_in("clean/release.py"), "the rule no longer sees the releases it is about"
    found = [r for n in modules() if n != "clean/release.py" for r in releases_in(n)]
    assert not found, found


def test_nothing_outside_the_adapter_and_the_presentation_imports_ipython() -> None:
    for name in modules():
        if name.startswith(("ipython/", "ui/")) or name == "server.py":
            continue
        t = tree(name)
        mods = {n.module or "" for n in ast.walk(t) if isinstance(n, ast.ImportFrom)}
        mods |= {a.name for n in ast.walk(t) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m.split(".")[0] in ("IPython", "ipywidgets", "anywidget") for m in mods), name


def test_output_cache_names_and_holder_kinds_are_defined_once() -> None:
    for path in PKG.rglob("*.py"):
        if path.name == "records.py":
            continue
        src = path.read_text()
        assert '("_", "__", "___")' not in src, f"{path.name} spells IPython's rotating names again"
        assert '"namespace": 0' not in src, path.name


def test_the_architecture_note_names_every_folder_and_module_and_stays_true() -> None:
    note = (PKG.parent / "docs" / "architecture.md").read_text()
    missing = [n for n in modules() if not n.endswith("__init__.py") and f"`{n}`" not in note
               and f"`{Path(n).stem}`" not in note and f"`{Path(n).name}`" not in note]
    assert not missing, f"docs/architecture.md does not name {missing}"
    assert all(f"`{p}/`" in note for p in subpackages()), "docs/architecture.md does not name every folder"
    js = [p.name for p in (PKG.parent / "js").glob("*.js") if not p.name.endswith(".test.js")]
    assert all(f"`{name}`" in note for name in js), js
    for what in ("a holder kind", "a gauge segment", "a fit remedy", "a server metric", "a report step"):
        assert f"**{what.capitalize()}**" in note, f"docs/architecture.md does not say where to add {what}"


def test_every_front_end_module_ships_in_the_wheel() -> None:
    # A module the gauge imports but the wheel lacks breaks the gauge only where nbmem is installed (Binder).
    import tomllib

    root = Path(__file__).resolve().parents[1]
    shipped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"][
        "force-include"]
    fronts = {f"js/{p.name}" for p in (root / "js").iterdir()
              if p.suffix in (".js", ".json") and not p.name.endswith(".test.js")}
    assert fronts <= set(shipped), sorted(fronts - set(shipped))
