"""On a GPU machine: two notebooks' kernels hold known CUDA memory; nbmem's server extension must name
them by notebook, with the bytes NVML itself gives for their PIDs.

    python scripts/gpu_server_check.py [--gib 1 3]

Starts a real jupyter server (the extension, the real pynvml; isolated config and runtime folders, a free
loopback port) with one kernel per size, each holding ``torch.empty(size, device="cuda")``. Prints one
JSON document: per kernel its notebook, PID, what ``/api/nbmem/gpu`` reports, what
``nvmlDeviceGetComputeRunningProcesses`` reports for that PID, and its ``/metrics`` lines.
Exit status 1 when they differ or a kernel is not named by its notebook; 0 when they agree, and 0
(saying so) on a machine without NVML, where there is nothing to check.

The interpreter running this needs torch, ipykernel, jupyter_server and nbmem (installed, or this
checkout on PYTHONPATH, which the kernels inherit). ``JupyterServer`` is also what the CPU tests use.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from tempfile import TemporaryDirectory, mkdtemp
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "nbmem-check"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class JupyterServer:
    """A real jupyter server in a subprocess, isolated in ``root``, with nbmem's extension enabled the way
    the wheel enables it (``jupyter-config/`` of this checkout on JUPYTER_CONFIG_PATH).

    ``config`` becomes its ``jupyter_server_config.json``; ``env`` is added to its environment (and so to
    its kernels'). Kernels use a kernelspec for this interpreter, whatever other ``python3`` the machine has.
    """

    def __init__(self, root: Path, config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 startup_s: float = 30) -> None:
        self.root = root
        self.runtime = root / "runtime"  # made short on start: kernels' IPC socket paths must fit in 107 bytes
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{free_port()}"
        self._config = dict(config or {})
        self._env = dict(env or {})
        self._startup_s = startup_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy

    # -- lifecycle ----------------------------------------------------------------------------------------
    def __enter__(self) -> JupyterServer:
        self.runtime = Path(mkdtemp(prefix="nbmem-rt-"))
        for sub in ("config", "ipython", "data/kernels/" + KERNEL):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "config/jupyter_server_config.json").write_text(json.dumps(self._config))
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        (self.root / "data/kernels" / KERNEL / "kernel.json").write_text(
            json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
        env = {**os.environ, "JUPYTER_CONFIG_DIR": str(self.root / "config"),
               "JUPYTER_CONFIG_PATH": str(ROOT / "jupyter-config"), "JUPYTER_RUNTIME_DIR": str(self.runtime),
               "JUPYTER_DATA_DIR": str(self.root / "data"), "IPYTHONDIR": str(self.root / "ipython"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **self._env}
        argv = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ip=127.0.0.1",
                f"--port={self.base.rsplit(':', 1)[1]}", f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root}", "--KernelManager.transport=ipc",
                *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])]
        with (self.root / "server.log").open("wb") as log:
            self._proc = subprocess.Popen(argv, env=env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_until_up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_up(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self._startup_s
        while True:
            try:
                self.request("GET", "/api/status")
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the jupyter server did not start:\n" + self.log()[-4000:]) from None
                time.sleep(0.1)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._proc is None:
            return
        self._proc.terminate()  # the server shuts its kernels down
        try:
            self._proc.wait(20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        shutil.rmtree(self.runtime, ignore_errors=True)

    def log(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")

    # -- HTTP ---------------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, token: bool = True,
                headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        """(status, body); HTTP errors are answers too. ``token=False`` sends no credentials."""
        head = {"Content-Type": "application/json", **(headers or {})}
        if token:
            head["Authorization"] = f"token {self.token}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=head)
        try:
            with self._opener.open(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def json(self, path: str) -> Any:
        status, body = self.request("GET", path)
        assert status == 200, f"GET {path}: {status} {body[:500]!r}"
        return json.loads(body)

    def metrics(self, prefix: str = "nbmem_") -> list[str]:
        """The sample lines of ``/metrics`` whose metric name starts with ``prefix``."""
        status, body = self.request("GET", "/metrics")
        assert status == 200, f"GET /metrics: {status}"
        return [line for line in body.decode().splitlines() if line.startswith(prefix)]

    # -- notebooks and kernels ----------------------------------------------------------------------------
    def open_notebook(self, path: str) -> tuple[str, str]:
        """A session for ``path`` (as the front end makes one), with a kernel; (session id, kernel id)."""
        # As JupyterLab asks: the name is the file's, the path says where it is.
        model = {"path": path, "name": Path(path).name, "type": "notebook", "kernel": {"name": KERNEL}}
        status, body = self.request("POST", "/api/sessions", model)
        assert status == 201, f"POST /api/sessions: {status} {body[:500]!r}\n{self.log()[-3000:]}"
        session = json.loads(body)
        return str(session["id"]), str(session["kernel"]["id"])

    def close_notebook(self, session_id: str) -> None:
        status, _ = self.request("DELETE", f"/api/sessions/{session_id}")
        assert status == 204, f"DELETE /api/sessions/{session_id}: {status}"

    def execute(self, kernel_id: str, code: str, timeout_s: float = 60) -> str:
        """Run ``code`` in the kernel (through its connection file); what it printed. Raises if it failed."""
        from jupyter_client.blocking import BlockingKernelClient

        client = BlockingKernelClient(connection_file=str(self.runtime / f"kernel-{kernel_id}.json"))
        client.load_connection_file()
        client.start_channels()
        out: list[str] = []

        def keep(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        try:
            client.wait_for_ready(timeout=timeout_s)
            reply = client.execute_interactive(code, output_hook=keep, timeout=timeout_s)
        finally:
            client.stop_channels()
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"kernel {kernel_id} failed to run {code!r}:\n" + "".join(out))
        return "".join(out)


# -- the GPU check --------------------------------------------------------------------------------------------
def nvml_missing() -> str | None:
    """Why NVML cannot be read here, or None when it can."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as e:
        return f"NVML is not available ({type(e).__name__}: {e})"
    return None if count else "NVML sees no GPU"


def nvml_bytes_by_pid() -> dict[int, int | None]:
    """Every compute process on every GPU as NVML lists it: bytes summed over GPUs, None where NVML has none."""
    import pynvml

    sizes: dict[int, list[int | None]] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
            used = p.usedGpuMemory  # pynvml turns NVML's "not available" into None
            sizes.setdefault(int(p.pid), []).append(None if used is None else int(used))
    return {pid: None if None in v else sum(x or 0 for x in v) for pid, v in sizes.items()}


HOLD = """
import os, torch
held = torch.empty({size}, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(os.getpid(), torch.cuda.memory_reserved())
"""


def kernel_report(server_json: dict[str, Any], metrics: list[str], nvml: dict[int, int | None], kernel_id: str,
                  notebook: str, pid: int, size: int, reserved: int) -> dict[str, Any]:
    """One kernel: what the endpoint, NVML and /metrics say, and whether they agree."""
    entries = [k for g in server_json["gpus"] for k in g["kernels"] if k["kernel_id"] == kernel_id]
    sizes = [k["bytes"] for k in entries]
    endpoint = None if not sizes or None in sizes else sum(sizes)
    named = sorted({k["notebook"] for k in entries})
    lines = [m for m in metrics if f'kernel_id="{kernel_id}"' in m]
    ok = endpoint is not None and endpoint == nvml.get(pid) and named == [notebook] and bool(lines)
    return {"notebook": notebook, "kernel_id": kernel_id, "pid": pid, "requested_bytes": size,
            "torch_reserved_bytes": reserved, "endpoint_bytes": endpoint, "nvml_bytes": nvml.get(pid),
            "endpoint_notebooks": named, "metrics": lines, "ok": ok}


def check(sizes_gib: list[float]) -> dict[str, Any]:
    with TemporaryDirectory(prefix="nbmem-gpu-server-") as tmp, JupyterServer(Path(tmp)) as server:
        opened = []
        for i, gib in enumerate(sizes_gib):
            notebook = f"gpu_check_{i}.ipynb"
            _, kernel_id = server.open_notebook(notebook)
            size = int(gib * 2**30)
            pid, reserved = map(int, server.execute(kernel_id, HOLD.format(size=size)).split())
            opened.append((kernel_id, notebook, pid, size, reserved))
        time.sleep(1.1)  # the extension's reading may be up to a second old
        server_json, metrics, nvml = server.json("/api/nbmem/gpu"), server.metrics(), nvml_bytes_by_pid()
        kernels = [kernel_report(server_json, metrics, nvml, *k) for k in opened]
        gpus = [{k: g[k] for k in ("index", "name", "used_bytes", "total_bytes")} for g in server_json["gpus"]]
        return {"gpus": gpus,
                "reason": server_json["reason"], "kernels": kernels, "metrics": metrics,
                "ok": all(k["ok"] for k in kernels)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 3.0], help="GiB each kernel holds")
    args = parser.parse_args(argv)
    why = nvml_missing()
    if why:
        print(json.dumps({"skipped": f"{why}: nothing to check on this machine", "ok": True}))
        return 0
    result = check(args.gib)
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
