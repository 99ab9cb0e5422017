"""One rule for "library code or the user's": the cases each of its four former homes covered."""

from __future__ import annotations

import os
import sys
import sysconfig
import types

import pytest
import torch

from nbmem.holders import reach
from nbmem.measure import libraries
from nbmem.trace import linetrace
from nbmem.trace.lineclock import LineClock

STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "json", "decoder.py")
SITE = os.path.dirname(os.path.dirname(torch.__file__))


@pytest.mark.parametrize("filename", [
    STDLIB,                                                    # the standard library (shell frames, line clock)
    torch.nn.modules.linear.__file__,                          # this interpreter's site-packages
    "/opt/conda/lib/python3.12/site-packages/peft/tuners.py",  # another interpreter's, by its folder name
    "/usr/lib/python3/dist-packages/numpy/core.py",            # Debian's (the old replay rule)
    "<frozen importlib._bootstrap>",                           # frozen modules (line clock, replay)
    libraries.__file__,                                        # nbmem itself (line clock)
])
def test_library_files(filename: str) -> None:
    assert libraries.is_library_file(filename)
    assert not libraries.is_user_file(filename)


@pytest.mark.parametrize("filename", [
    "<ipython-input-3-4e1c6d2f1a2b>",            # a cell, terminal IPython
    "/tmp/ipykernel_4242/1234567890.py",         # a cell, ipykernel
    "/home/me/project/model.py",                 # a module beside the notebook
    "/home/me/torch/experiments.py",             # a user folder named torch is not torch (the old replay rule said so)
])
def test_user_files(filename: str) -> None:
    assert not libraries.is_library_file(filename)
    assert libraries.is_user_file(filename)


def test_the_code_torch_compile_writes_is_torchs(tmp_path, monkeypatch) -> None:
    """Inductor writes each compiled graph's Python into its cache folder, named by a hash of its content: a new
    file for every graph, so allocation sites there differ from one batch size to the next (a fit on an H200
    paired nothing across its runs and answered 1.18x the real boundary). They are torch's code, not the user's;
    the user's files in a folder they chose as Inductor's cache (``/tmp``, ``.``) stay theirs."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    name = "cdjuwxf2joks27emamaugqu7cl57nhypty75ujzgfpaygb4ve6ff.py"
    generated = os.path.join(default_cache_dir(), "dj", name)
    assert libraries.is_library_file(generated) and not libraries.is_user_file(generated)
    chosen = tmp_path / "inductor-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(chosen))
    assert libraries.is_library_file(str(chosen / "dj" / name))
    assert libraries.is_user_file(str(tmp_path / "inductor-cache-notes.py")), "a folder that only starts the same"
    assert libraries.is_library_file(str(tmp_path / "fresh" / "dj" / name)), "a temporary cache (fresh_cache())"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cache in the folder of the user's own files
    for mine in (tmp_path / "ipykernel_4242" / "1234567890.py", tmp_path / "model.py", tmp_path / "lo" / "clock.py",
                 tmp_path / "xy" / ("c" + "a" * 51 + ".py")):
        assert libraries.is_user_file(str(mine)), mine


@pytest.mark.parametrize("filename", ["??", "/pytorch/torch/csrc/autograd/engine.cpp", "<string>"])
def test_c_frames_and_strings_are_nobodys(filename: str) -> None:
    assert not libraries.is_user_file(filename)


def test_a_folder_packages_were_installed_into_is_a_library(tmp_path, monkeypatch) -> None:
    """``pip install --target DIR`` with DIR on sys.path: no site-packages in the name, but *.dist-info inside."""
    (tmp_path / "vendored-1.0.dist-info").mkdir()
    mod = tmp_path / "vendored.py"
    mod.write_text("X = 1\n")
    assert not libraries.is_library_file(str(mod))  # not on sys.path yet
    monkeypatch.syspath_prepend(str(tmp_path))
    assert libraries.is_library_file(str(mod))
    monkeypatch.undo()
    assert not libraries.is_library_file(str(mod)), "a changed sys.path is looked at again"


def test_library_of_names_the_package() -> None:
    assert libraries.library_of(torch.nn.modules.linear.__file__, "torch.nn.modules.linear") == "torch"
    assert libraries.library_of(STDLIB, None) == "a library"
    assert libraries.library_of("/tmp/ipykernel_1/2.py", "__main__") == ""


def test_modules_the_user_made_or_wrote(tmp_path) -> None:
    made = types.ModuleType("scratch")  # by hand: no file, no spec
    assert reach.is_user_module(made)
    assert not reach.is_user_module(sys.modules["json"])
    assert not reach.is_user_module(torch)
    assert not reach.is_user_module(sys.modules["__main__"])
    written = types.ModuleType("helpers")
    written.__file__ = str(tmp_path / "helpers.py")
    assert reach.is_user_module(written)
    namespace = types.ModuleType("nspkg")
    namespace.__spec__ = object()  # a namespace package or frozen module has a spec and no file
    assert not reach.is_user_module(namespace)


def test_the_replay_and_the_line_clock_ask_the_same_rule(tmp_path) -> None:
    frames = [{"filename": torch.nn.modules.linear.__file__, "line": 1, "name": "forward"},
              {"filename": "/home/me/torch/experiments.py", "line": 7, "name": "step"},
              {"filename": "<ipython-input-2-x>", "line": 3, "name": "<module>"}]
    assert linetrace.deepest_user_frame(frames) == "/home/me/torch/experiments.py:7 in step"
    if LineClock.unsupported():
        pytest.skip(LineClock.unsupported() or "")
    # The clock switches library code off at its first line and marks the user's lines only.
    path = tmp_path / "user_code.py"
    path.write_text("def f(x):\n    y = x + 1\n    return y\n")
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    clock = LineClock()
    assert clock.start()
    try:
        ns["f"](1)
        import json

        json.dumps({"a": 1})
    finally:
        marks = clock.stop()
    files = {code.co_filename for _t, code, _line in marks}
    assert str(path) in files
    assert not any(libraries.is_library_file(f) for f in files)


@pytest.mark.parametrize(("name", "library"), [
    ("re", True), ("torch._C", True), ("torch._C._nn", True), ("IPython.core.interactiveshell", True),
    ("builtins", True), ("replay_buffer", False), ("research.models", False), ("common", False),
    ("regression", False), ("sslkit", False), ("torch", False), ("abcd", False),
])
def test_a_library_is_a_package_or_its_submodule_never_a_name_that_starts_the_same(name: str, library: bool) -> None:
    assert reach.is_library_module(name) is library


def test_objects_of_a_user_module_named_like_a_library_are_walked(tmp_path, monkeypatch) -> None:
    from nbmem.holders.scanner import Scanner
    from nbmem.holders.walk import Root
    from nbmem.records import HolderKind

    (tmp_path / "replay_buffer.py").write_text("class ReplayBuffer:\n    def __init__(self, t):\n        self.t = t\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import replay_buffer

    try:
        buf = replay_buffer.ReplayBuffer(torch.empty(1024))
        s = Scanner(lambda: torch).update([Root("buf", HolderKind.NAMESPACE, buf)], cell=1, walk="all")
        assert [h.holders for h in s.storages.values()] == [("buf.t",)]
    finally:
        sys.modules.pop("replay_buffer", None)
