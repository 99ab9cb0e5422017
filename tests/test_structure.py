"""The layers as the README draws them: consumers use the engine's seam, never its insides."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nbmem"
CONSUMERS = ["widget.py", "plotting.py", "server.py"]
#: The engine's insides: a consumer that reads them is wired past the seam.
INSIDES = {"store", "sampler", "probe", "nvml", "scanner", "holdings", "cells", "_listeners", "last_scan"}


def modules() -> list[str]:
    """Every module of the package, sub-packages too, as a path from ``nbmem/`` (``fitting/runner.py``)."""
    return sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py"))


def tree(name: str) -> ast.Module:
    return ast.parse((PKG / name).read_text(), filename=name)


@pytest.mark.parametrize("name", [n for n in CONSUMERS if (PKG / n).exists()])
def test_consumers_do_not_import_the_magics_or_reach_into_the_engine(name: str) -> None:
    t = tree(name)
    imports = [n.module for n in ast.walk(t) if isinstance(n, ast.ImportFrom)]
    assert "magics" not in imports, f"{name} imports the IPython adapter"
    reached = sorted({n.attr for n in ast.walk(t) if isinstance(n, ast.Attribute) and n.attr in INSIDES})
    assert reached == [], f"{name} reaches into the engine: {reached}"


def test_nothing_below_the_adapter_imports_ipython() -> None:
    for name in modules():
        if name in ("magics.py", "widget.py", "server.py", "reconnect.py"):  # the adapter and the presentation
            continue
        mods = {n.module or "" for n in ast.walk(tree(name)) if isinstance(n, ast.ImportFrom)}
        mods |= {a.name for n in ast.walk(tree(name)) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m.split(".")[0] in ("IPython", "ipywidgets", "anywidget") for m in mods), name


def test_output_cache_names_and_holder_kinds_are_defined_once() -> None:
    for path in PKG.rglob("*.py"):
        if path.name == "records.py":
            continue
        src = path.read_text()
        assert '("_", "__", "___")' not in src, f"{path.name} spells IPython's rotating names again"
        assert '"namespace": 0' not in src, path.name


def test_the_architecture_note_names_every_module_and_stays_true() -> None:
    note = (PKG.parent / "docs" / "architecture.md").read_text()
    missing = [n for n in modules() if not n.endswith("__init__.py") and f"`{n}`" not in note
               and f" {n} " not in note and f"{n}:" not in note]
    assert not missing, f"docs/architecture.md does not name {missing}"
    js = [p.name for p in (PKG.parent / "js").glob("*.js") if not p.name.endswith(".test.js")]
    assert all(f"`{name}`" in note for name in js), js


def test_no_module_is_a_monolith() -> None:
    """One job per module: no file over ~600 lines, no class over ~300 (the structural review's bounds)."""
    for name in modules():
        t = tree(name)
        lines = len((PKG / name).read_text().splitlines())
        assert lines <= 650, f"{name} has {lines} lines"
        for node in ast.walk(t):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                assert size <= 310, f"{name}: class {node.name} has {size} lines"


def test_every_front_end_module_ships_in_the_wheel() -> None:
    # A module the gauge imports but the wheel lacks breaks the gauge only where nbmem is installed (Binder).
    import tomllib

    root = Path(__file__).resolve().parents[1]
    shipped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"][
        "force-include"]
    modules = {f"js/{p.name}" for p in (root / "js").glob("*.js") if not p.name.endswith(".test.js")}
    assert modules <= set(shipped), sorted(modules - set(shipped))
