"""Owners: the findings of a scan grouped by the name a user typed (to be built)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from . import findings as judge
from .graphs import Graph
from .records import Finding
from .scanner import Scan


def cell_owners(cur: Scan, prev: Scan | None, cell: int, *, threshold_bytes: int, graphs: Mapping[int, Graph],
                lines: Mapping[int, int]) -> tuple[Finding, ...]:
    found = judge.findings(cur, prev, cell, threshold_bytes=threshold_bytes, graphs=graphs)
    out = []
    for f in found:
        _dev, _, sid = f.id.partition(":")
        line = lines.get(int(sid)) if sid.isdigit() else None
        out.append(replace(f, line=line) if line is not None else f)
    return tuple(out)


def current_owners(cur: Scan, *, threshold_bytes: int, graphs: Mapping[int, Graph],
                   cache: dict[int, Any] | None = None) -> tuple[Finding, ...]:
    return tuple(judge.current(cur, threshold_bytes=threshold_bytes, graphs=graphs, cache=cache))
