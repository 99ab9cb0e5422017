"""What a ``%cudamem`` line says about itself: which cells are nbmem's own commands, and what a mistyped
command or option is told (the closest match, and the ones it takes).

Plain text over the magic's own tables, below IPython: the adapter raises it as a ``UsageError``
(``magics.py``) and decides from it which cells to measure (``root.py``'s cell hooks).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Collection

from nbmem.formatting import did_you_mean

_MAGIC = re.compile(r"%cudamem(?=\s|\?|$)")


def words(line: str) -> list[str]:
    """The line split as the shell would; a line with an unclosed quote as plain words."""
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def own_command(raw_cell: str) -> str | None:
    """The command of a cell that is only ``%cudamem`` lines (and comments): ``clean`` if one of them cleans,
    else the first one's word ("" for none); None for a cell with anything else in it: the user's code."""
    lines = [ln.strip() for ln in raw_cell.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not lines or not all(_MAGIC.match(ln) for ln in lines):
        return None
    commands = [next((w for w in words(ln[len("%cudamem"):]) if not w.startswith("-")), "") for ln in lines]
    return "clean" if "clean" in commands else commands[0]


def unknown_options(line: str, known: Collection[str]) -> list[str]:
    """The ``-x``/``--xyz`` words of ``line`` that are none of the ``known`` option strings (nor a prefix
    of exactly one long option, which argparse accepts)."""
    out = []
    for w in words(line):
        flag = w.split("=", 1)[0]
        if not flag.startswith("-") or flag == "-" or _is_number(flag) or flag in known:
            continue
        if flag.startswith("--") and len([k for k in known if k.startswith(flag)]) == 1:
            continue
        out.append(flag)
    return out


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def command_refusal(command: str, commands: Collection[str]) -> str:
    """An unknown command, refused with the closest one named and the list of them all."""
    return (f"%cudamem: unknown command {command!r}{did_you_mean(command, commands)}; the commands are "
            f"{', '.join(commands)}; `%cudamem?` says what each one does. Nothing was run.")


def option_refusal(what: str, unknown: list[str], takes: list[str]) -> str:
    """``%cudamem on does not take --bogus; it takes --lines, ...``, with the closest option named."""
    shown = ", ".join(f"{u}{did_you_mean(u, takes)}" for u in unknown)
    return (f"{what} does not take {shown}; it takes {', '.join(takes) or 'no options'}. "
            "`%cudamem?` says what each option does. Nothing was run.")
