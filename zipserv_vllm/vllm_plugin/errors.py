"""Load failures reach the user as one readable line, whatever vLLM wraps around them.

A checkpoint problem is found in whichever vLLM process meets it: the front-end
(the header preflight, inside vLLM's pydantic config validation, which adds its
own footer) or a worker (the tile checks while loading), whose traceback vLLM
logs and then replaces with "Engine core initialization failed" in the process
the user started. So every error the plugin raises goes through :func:`report`:

* it is logged at once as one ERROR line ``zipserv: ...`` (before the traceback
  of the process that meets it);
* it is appended to a small file named by ``ZIPSERV_ERROR_FILE``, which the
  first process to register the plugin (the one the user started) creates and
  its children inherit;
* that first process wraps ``sys.excepthook``: when it dies of an uncaught
  exception, it prints ``zipserv: error: <the first message>`` first, then the
  traceback vLLM made of it.

This module imports no vLLM.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile

ENV = "ZIPSERV_ERROR_FILE"
_installed = False


def install() -> None:
    """In the process the user started (no ``ZIPSERV_ERROR_FILE`` yet): name the file and
    wrap ``sys.excepthook``. Idempotent; a no-op in vLLM's child processes."""
    global _installed
    if _installed or os.environ.get(ENV):
        return
    _installed = True
    path = os.path.join(tempfile.gettempdir(), f"zipserv-errors-{os.getpid()}.txt")
    os.environ[ENV] = path
    atexit.register(_remove, path)
    previous = sys.excepthook

    def hook(kind, value, tb):
        first = first_error()
        if first is None and isinstance(value, Exception) and str(value).startswith("zipserv"):
            first = str(value).strip().splitlines()[0]
        if first:
            text = first.split("zipserv: ", 1)[1] if first.startswith("zipserv: ") else first
            print(f"zipserv: error: {text}", file=sys.stderr, flush=True)
            print("(vLLM's report of it follows)", file=sys.stderr, flush=True)
        previous(kind, value, tb)

    sys.excepthook = hook


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def report(exc: BaseException) -> BaseException:
    """Log ``exc`` as one ERROR line and record it for the first process; returns it (to raise)."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if not getattr(exc, "_zs_reported", False):
        try:
            exc._zs_reported = True  # type: ignore[attr-defined]
        except AttributeError:
            pass
        from .log import logger

        logger.error("%s", msg)
        path = os.environ.get(ENV)
        if path:
            try:
                with open(path, "a") as f:
                    f.write(msg.replace("\n", " ") + "\n")
            except OSError:
                pass
    return exc


def first_error() -> str | None:
    """The first message any process of this run reported, or None."""
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            line = f.readline().strip()
    except OSError:
        return None
    return line or None
