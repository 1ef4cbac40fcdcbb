"""Load failures reach the user as one readable line, whatever vLLM wraps around them.

A checkpoint problem is found in whichever vLLM process meets it: the front-end
(the header preflight, inside vLLM's pydantic config validation, which adds its
own footer) or a worker (the tile checks while loading), whose traceback vLLM
logs and then replaces with "Engine core initialization failed" in the process
the user started. So every error the plugin raises goes through :func:`report`:

* it is logged at once as one ERROR line ``zipserv: ...`` (before the traceback
  of the process that meets it);
* it is appended, as ``<pid><TAB><message>``, to a small file named by
  ``ZIPSERV_ERROR_FILE``, which the first process to register the plugin (the
  one the user started) creates with ``mkstemp`` (a fresh, unpredictable name,
  mode 0600) and its children inherit;
* a process whose load then succeeds (:func:`clear_mine`, called once the memory
  summary is logged) drops the lines it wrote itself, so a later failure never
  shows a message about a load that went well;
* that first process wraps ``sys.excepthook``: when it dies of an uncaught
  exception, it prints ``zipserv: error: <the newest message of this run>``
  first, then the traceback vLLM made of it.

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
    try:
        fd, path = tempfile.mkstemp(prefix="zipserv-errors-", suffix=".txt")  # 0600, O_EXCL: no symlink, no reuse
    except OSError:
        return  # no writable temp directory: errors are still logged, only not repeated at the end
    os.close(fd)
    os.environ[ENV] = path
    atexit.register(_remove, path)
    previous = sys.excepthook

    def hook(kind, value, tb):
        first = last_error()
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
                with open(path, "a") as f:  # under the lock clear_mine holds while it rewrites the file
                    _lock(f)
                    f.write(f"{os.getpid()}\t{msg.replace(chr(10), ' ')}\n")
            except OSError:
                pass
    return exc


def _lock(f) -> None:
    """An exclusive lock on the open error file until it is closed (a no-op where fcntl is missing)."""
    try:
        import fcntl

        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass


def _records(path: str) -> list[tuple[str, str]]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        pid, sep, msg = line.partition("\t")
        if sep and msg.strip():
            out.append((pid, msg.strip()))
    return out


def last_error() -> str | None:
    """The newest message any process of this run reported (and did not clear), or None."""
    path = os.environ.get(ENV)
    recs = _records(path) if path else []
    return recs[-1][1] if recs else None


def clear_mine() -> None:
    """After a successful load: drop the lines this process wrote (other processes' stay)."""
    path = os.environ.get(ENV)
    if not path:
        return
    me = str(os.getpid())
    recs = _records(path)
    if not any(pid == me for pid, _ in recs):
        return
    try:
        with open(path, "r+") as f:
            _lock(f)  # another rank's report cannot land between the read and the rewrite
            keep = [f"{pid}\t{msg}\n" for pid, msg in _records(path) if pid != me]
            f.seek(0)
            f.write("".join(keep))
            f.truncate()
    except OSError:
        pass
