"""Human formatting of numbers and tables, in one place (bytes mirrored by js/format.js)."""

from __future__ import annotations

import difflib
import html
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def is_na(value: object) -> bool:
    """True for the values nbmem uses to mean "unknown": None, NaN and pandas' NA."""
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    return type(value).__name__ in ("NAType", "NaTType")


def fmt_bytes(n: int | float | None, *, signed: bool = False) -> str:
    """Bytes in binary units with three significant digits; NA for unknown."""
    if is_na(n):
        return "NA"
    assert n is not None
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    v = float(abs(n))
    unit = 0
    while v >= 1024 and unit < len(_UNITS) - 1:
        v /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{int(v)} B"
    digits = 2 if v < 10 else 1 if v < 100 else 0
    return f"{sign}{v:.{digits}f} {_UNITS[unit]}"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|g|mib|mb|m|tib|tb|t|kib|kb|k)\s*$", re.IGNORECASE)
#: A bare K, G, M or T is binary: what nvidia-smi and torch print is GiB, and people type "24G" for it. KiB is
#: there because reports print it ("+286 KiB"): a threshold is typed as it was read.
_SIZE_UNITS = {"gib": 1 << 30, "g": 1 << 30, "gb": 10**9, "mib": 1 << 20, "m": 1 << 20, "mb": 10**6,
               "tib": 1 << 40, "t": 1 << 40, "tb": 10**12, "kib": 1 << 10, "k": 1 << 10, "kb": 10**3}


@dataclass(frozen=True, slots=True)
class TypedSize:
    """A memory size as someone typed it: its bytes, and its number and unit as written ("24", "gb")."""

    size_bytes: int
    number: str
    unit: str  # lower case

    @property
    def binary(self) -> bool:
        return self.unit in ("gib", "g", "mib", "m", "tib", "t")

    def as_typed(self) -> str:
        """The number and unit as written, spaced, the unit upper case: "24 GB" for "24gb"."""
        return f"{self.number} {self.unit.upper()}"


def read_size(text: str) -> TypedSize | None:
    """A typed memory size ("24GiB", "24GB", "24G", "8000MiB"); None for anything else. The one reader of sizes,
    so every option takes the same spellings."""
    m = _SIZE.match(text)
    if m is None:
        return None
    unit = m.group(2).lower()
    return TypedSize(int(float(m.group(1)) * _SIZE_UNITS[unit]), m.group(1), unit)


def fmt_count(n: int) -> str:
    """A count as people say it: 950, 12.3K, 2.1M, 169M, 6.74B (three significant digits)."""
    if abs(n) < 1000:
        return str(n)
    for unit, scale in (("K", 1e3), ("M", 1e6), ("B", 1e9), ("T", 1e12)):
        v = n / scale
        if abs(v) < 999.5 or unit == "T":
            return f"{v:.3g}{unit}"
    return str(n)


def plural(n: int, noun: str, many: str | None = None) -> str:
    """A count and its noun, agreeing: "1 output", "2 outputs", "12,345 objects" (``many``: an irregular plural)."""
    return f"{n:,} {noun if n == 1 else many or noun + 's'}"


#: A name must be this close (difflib's ratio) to be offered as "did you mean".
CLOSE = 0.6


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean `clean`?)`` when ``word`` is close to one of ``choices``, else "": the one "did you mean"
    of every refusal (a command, an option, a variable to clean)."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=CLOSE)
    return f" (did you mean `{near[0]}`?)" if near else ""


def fmt_times(x: float) -> str:
    """A ratio as a person reads it: "~2.4×" below ten, "~12×" above."""
    return f"~{x:.1f}×" if round(x, 1) < 10 else f"~{x:.0f}×"


def fmt_seconds(s: float | None) -> str:
    """A duration: ms below a second, else seconds or minutes."""
    if is_na(s):
        return "NA"
    assert s is not None
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.2f} s"
    return f"{s / 60:.1f} min"


def esc(text: object) -> str:
    """Escape user data (names, dict keys) for HTML: it is always shown as text."""
    return html.escape(str(text), quote=True)


_TICKS = re.compile(r"`([^`]+)`")


def prose(text: object) -> str:
    """Escaped like ``esc``; then the `code` in backticks a hint or note carries is set as code."""
    return _TICKS.sub(r"<code>\1</code>", esc(text))


@dataclass(frozen=True)
class Column:
    """How a table column reads: numbers right-aligned and never wrapped, text left-aligned."""

    title: str
    numeric: bool = False
    code: bool = False  # names and paths: monospace, kept whole unless one alone is wider than the table
    wide: bool = False  # prose (hints): takes the remaining width, wraps between words, `code` set as code


def _cell_style(c: Column) -> str:
    if c.numeric:
        return "text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums"
    if c.code:
        # A name breaks only when it alone is wider than the table; the hint column gives way first.
        return "text-align:left;font-family:var(--jp-code-font-family,monospace);overflow-wrap:break-word"
    if c.wide:
        return "text-align:left;min-width:16em"
    return "text-align:left;white-space:nowrap"


def html_table(columns: Sequence[Column], rows: Sequence[Sequence[str]], *, caption: str = "",
               html: Sequence[Mapping[int, str]] | None = None) -> str:
    """A table as wide as the notebook at most; cells are escaped here so callers pass plain text.

    ``html[i][j]``, where given, is HTML nbmem built (already escaped) to show in row i, column j instead
    of that cell's text: a ``<details>`` that expands an owner's "what" into its members, say.
    """
    pad = "padding:2px 8px;vertical-align:top"
    head = "".join(f"<th style='{pad};{_cell_style(c)}'>{esc(c.title)}</th>" for c in columns)
    built = list(html or ())

    def cell(i: int, j: int, c: Column, v: str) -> str:
        own = built[i].get(j) if i < len(built) else None
        return own if own is not None else prose(v) if c.wide else esc(v)

    body = "".join("<tr>" + "".join(f"<td style='{pad};{_cell_style(c)}'>{cell(i, j, c, v)}</td>"
                                    for j, (c, v) in enumerate(zip(columns, r))) + "</tr>"
                   for i, r in enumerate(rows))
    cap = f"<caption style='text-align:left;font-weight:600'>{esc(caption)}</caption>" if caption else ""
    return (f"<table class='nbmem-table' style='max-width:100%;table-layout:auto;border-collapse:collapse'>{cap}"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def text_table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: text columns left-aligned, numbers right-aligned."""
    widths = [max([len(c.title), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if c.numeric else v.ljust(w)
                         for c, v, w in zip(columns, values, widths)).rstrip()

    return "\n".join([line([c.title for c in columns]), *(line(r) for r in rows)])


def spans(numbers: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1–3, 7`` (the first and last few runs when there are many)."""
    runs: list[list[int]] = []
    for c in numbers:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    text = [f"{a}–{b}" if b > a else str(a) for a, b in runs]
    return ", ".join(text if len(text) <= 6 else [*text[:3], "…", *text[-2:]])
