"""Human formatting of numbers, in one place (mirrored by js/format.js)."""

from __future__ import annotations

import html
import math

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def is_na(value: object) -> bool:
    """True for the values nbmem uses to mean "unknown": None and NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


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


def html_table(headers: list[str], rows: list[list[str]], *, caption: str = "") -> str:
    """A small HTML table; cells are escaped here so callers pass plain text."""
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td style='padding:2px 8px'>{esc(c)}</td>" for c in r) + "</tr>"
        for r in rows
    )
    cap = f"<caption style='text-align:left;font-weight:600'>{esc(caption)}</caption>" if caption else ""
    return f"<table class='nbmem-table'>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table with columns padded to fit."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)
