"""A check run in a forked child: GNU OpenMP cannot start a team in a process forked after its
threads ran, so the kernels must fall back to the calling thread there instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import pytest


def passes_in_forked_child(check, what: str, timeout_s: float = 60.0) -> None:
    """Fork; the child exits 0 only if ``check()`` returns True; fail when it does not or hangs."""
    pid = os.fork()
    if pid == 0:
        try:
            ok = bool(check())
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, f"the forked child's check failed in {what}"
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child hung in {what}")
