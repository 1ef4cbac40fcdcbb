"""Where checkpoints come from and how outputs appear: source resolution and staged output.

``staged_directory`` builds an output in a temporary sibling ``DST.tmp-XXXX``
and moves it into place with ``os.replace`` only when everything was written;
on any exception (Ctrl-C included) it removes the temporary directory, so a
directory named DST is always complete.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

from .names import CONFIG_FILE, INDEX_FILE
from .reader import CheckpointError

# Weight files in other formats are never copied into an output (they would carry uncompressed weights).
WEIGHT_FILE_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.gguf",
                        "*.onnx", "*.bin.index.json", "*.safetensors.index.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]+)?$")


def resolve_source(src) -> Path:
    """A local checkpoint directory for ``src``: the path itself, or a Hub snapshot for a repo id.

    The Hub is asked only when ``src`` is not an existing path and looks like
    ``name`` or ``org/name``; without network that fails with a clear message.
    """
    path = Path(src).expanduser()
    if path.exists():
        return path
    text = str(src)
    if not _HUB_ID.match(text) or ".." in text:
        raise CheckpointError(f"{src}: no such file or directory")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id=text, ignore_patterns=[p for p in WEIGHT_FILE_PATTERNS
                                                                  if p not in ("*.safetensors", "*.safetensors.index.json")])
    except Exception as exc:  # any hub/network failure becomes one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{src}: no such directory, and fetching it from the Hugging Face Hub failed "
                              f"({type(exc).__name__}: {first})") from None
    return Path(local)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def staged_directory(dst, overwrite: bool = False):
    """Yield a fresh temporary directory next to ``dst``; on success it becomes ``dst``.

    An existing ``dst`` is refused unless ``overwrite``; it is then replaced only
    after the new one is complete.
    """
    dst = Path(dst)
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise CheckpointError(f"{dst}: already exists (use --overwrite to replace it)")
    parent = dst.parent if str(dst.parent) else Path(".")
    if not parent.is_dir():
        raise CheckpointError(f"{parent}: no such directory (the parent of {dst} must exist)")
    tmp = Path(tempfile.mkdtemp(prefix=f"{dst.name}.tmp-", dir=parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        if dst.exists() or dst.is_symlink():
            old = parent / f"{dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _is_weight_file(name: str) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(name, p) for p in WEIGHT_FILE_PATTERNS)


def copy_side_files(src: Path, dst: Path, exclude: set[str] = frozenset()) -> tuple[list[str], list[str]]:
    """Copy everything but weights, config.json and the index from ``src`` to ``dst``.

    Returns (copied, skipped) relative names. Hidden entries (``.cache``,
    ``.git``...) and weight files of any format are skipped.
    """
    copied, skipped = [], []
    for item in sorted(src.iterdir()):
        name = item.name
        if name in (CONFIG_FILE, INDEX_FILE) or name in exclude:
            continue
        if name.startswith("."):
            continue
        if item.is_dir():
            def ignore(d, names, _root=item):
                out = [n for n in names if n.startswith(".") or (_is_weight_file(n) and not Path(d, n).is_dir())]
                skipped.extend(str(Path(d, n).relative_to(src)) for n in out if not n.startswith("."))
                return out
            shutil.copytree(item, dst / name, ignore=ignore)
            copied.append(name + "/")
        elif _is_weight_file(name):
            skipped.append(name)
        else:
            shutil.copy2(item, dst / name)
            copied.append(name)
    return copied, skipped
