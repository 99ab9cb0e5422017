"""Library code or the user's own: the one rule, asked of a file name.

A file is a library's when it lies in this interpreter's standard library or site-packages, in a
folder on ``sys.path`` that packages were installed into (``pip install --target``, a ``PYTHONPATH``
library folder: it holds ``*.dist-info``), under any ``site-packages`` or ``dist-packages``, in nbmem
itself, or is frozen (``<frozen importlib._bootstrap>``); so is the code torch.compile writes (Inductor's
``<cache>/dj/cdjuw….py``, named by the hash of each graph's code: its names change with every graph).
Python code anywhere else is the user's: a notebook cell (``<ipython-input-3-…>``, ipykernel's
``/tmp/ipykernel_…/….py``), a script, a module beside the notebook. The line clock (measurement), the
holder scan and the trace replay (analysis) and the IPython glue all ask here, so they agree at the edges.

Only the standard library, and no nbmem module: every layer may import it.
"""

from __future__ import annotations

import functools
import os
import re
import sys

_NBMEM_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")  # the package, not measure/
#: Folders named so are installed code wherever they are (another interpreter's, a conda env's).
_INSTALLED_PARTS = ("site-packages", "dist-packages")


@functools.cache
def python_library_dirs() -> tuple[str, ...]:
    """This interpreter's standard library and site-packages (``sysconfig``), each ending in a separator."""
    import sysconfig

    paths = sysconfig.get_paths()
    found = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(sorted(os.path.join(p, "") for p in found if p))


_install_dirs: tuple[list[object], tuple[str, ...]] = ([None], ())


def install_dirs() -> tuple[str, ...]:
    """The ``sys.path`` entries packages were installed into (they hold ``*.dist-info`` folders).

    Looked at again only when ``sys.path`` changes: compared with a copy of it as it was, in C (a fit's analysis
    asks this of every frame of every allocation's stack: 5.3 million times in a 7B fit).
    """
    global _install_dirs
    if _install_dirs[0] != sys.path:
        seen: list[object] = list(sys.path)
        key = [p for p in seen if type(p) is str]
        found = []
        for p in key:
            try:
                if p and os.path.isdir(p) and any(e.endswith(".dist-info") for e in os.listdir(p)):
                    found.append(os.path.join(os.path.abspath(p), ""))
            except OSError:
                continue
        _install_dirs = (seen, tuple(found))
        _verdicts.clear()
    return _install_dirs[1]


#: Inductor's name for the code it writes: "c" and the base32 digest of the code (51 characters of a-z, 2-7).
_INDUCTOR_NAME = re.compile(r"c[a-z2-7]{51}\.py")


def _generated(filename: str) -> bool:
    """Code torch.compile wrote: each graph's Python, in a file named by the hash of its content, in a folder of
    Inductor's cache named by the hash's 2nd and 3rd characters (``<cache>/dj/cdjuw….py``). Told by that name
    alone: the cache may be any folder (``TORCHINDUCTOR_CACHE_DIR``, a temporary one), and no user names a file so."""
    folder, name = os.path.split(filename)
    return _INDUCTOR_NAME.fullmatch(name) is not None and os.path.basename(folder) == name[1:3]


_verdicts: dict[str, bool] = {}
_VERDICTS_KEPT = 65_536


def is_library_file(filename: str) -> bool:
    """Whether code from ``filename`` is a library's (or the interpreter's, or nbmem's), not the user's."""
    dirs = install_dirs()  # first: a changed sys.path clears the verdicts
    got = _verdicts.get(filename)
    if got is None:
        got = (filename.startswith("<frozen") or filename.startswith(_NBMEM_DIR)
               or filename.startswith(python_library_dirs()) or (bool(dirs) and filename.startswith(dirs))
               or any(part in filename for part in _INSTALLED_PARTS) or _generated(filename))
        if len(_verdicts) >= _VERDICTS_KEPT:
            _verdicts.clear()
        _verdicts[filename] = got
    return got


def is_user_file(filename: str) -> bool:
    """Python code of the user's: a cell or a ``.py`` file outside the libraries.

    Never a C++ frame (``??``, ``…/Module.cpp``) of a recording with C++ stacks, nor code made from a
    string (``<string>``).
    """
    python = filename.endswith(".py") or filename.startswith("<ipython-input")
    return python and not is_library_file(filename)


def package_of(module_name: object) -> str:
    """The top-level package of a module name (``torch.nn.modules`` → ``torch``), or "" when it has none."""
    return module_name.partition(".")[0] if type(module_name) is str else ""


def library_of(filename: str, module_name: object) -> str:
    """The library a piece of code belongs to (``torch``), "a library" when its module has no name, or ""
    when it is the user's."""
    if not is_library_file(filename):
        return ""
    return package_of(module_name) or "a library"
