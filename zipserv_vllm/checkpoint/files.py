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
from dataclasses import dataclass, field
from pathlib import Path

from .reader import CheckpointError

# What a Hub download leaves out: copies of the main weights in other formats (safetensors
# and PyTorch .bin are what the compressor reads; .bin only where no safetensors exist).
HUB_IGNORE_PATTERNS = ("*.h5", "*.msgpack", "*.gguf", "*.onnx", "*.onnx_data", "*.ot", "*.ckpt*",
                       "consolidated*", "original/consolidated*", "openvino/*")
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

        local = snapshot_download(repo_id=text, ignore_patterns=list(HUB_IGNORE_PATTERNS))
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


# Copies of the main weights in other formats or layouts: left out of an output (they would
# carry every weight uncompressed), each named in the summary. Paths are relative to the
# checkpoint; a pattern without "/" matches top-level files only.
DUPLICATE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("pytorch_model*.bin", "PyTorch copy of the main weights"),
    ("pytorch_model.bin.index.json", "index of the PyTorch copy"),
    ("tf_model*.h5", "TensorFlow copy of the main weights"),
    ("tf_model.h5.index.json", "index of the TensorFlow copy"),
    ("flax_model*.msgpack", "Flax copy of the main weights"),
    ("flax_model.msgpack.index.json", "index of the Flax copy"),
    ("model.ckpt*", "TensorFlow checkpoint of the main weights"),
    ("rust_model.ot", "Rust (tch) copy of the main weights"),
    ("*.gguf", "GGUF copy of the main weights"),
    ("consolidated*.safetensors", "Mistral-format copy of the main weights"),
    ("consolidated*.pth", "original-format copy of the main weights"),
    ("original/consolidated*.pth", "original-format copy of the main weights"),
    ("original/consolidated*.safetensors", "original-format copy of the main weights"),
    ("onnx/*.onnx", "ONNX export of the main weights"),
    ("onnx/*.onnx_data", "ONNX export of the main weights"),
    ("onnx/*.onnx.data", "ONNX export of the main weights"),
    ("openvino/*.bin", "OpenVINO export of the main weights"),
    ("openvino/*.xml", "OpenVINO export of the main weights"),
)
# Not part of a model: version-control and download-cache folders.
NOT_MODEL_DIRS = (".git", ".cache", ".huggingface", "__pycache__")


@dataclass
class SideFiles:
    """How every file of a source checkpoint (other than its main weights) reaches an output."""

    copied: list[str] = field(default_factory=list)  # relative paths, copied byte for byte
    empty_dirs: list[str] = field(default_factory=list)  # folders with nothing in them (e.g. 3_Normalize/)
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (path, why) left out
    ignored: list[str] = field(default_factory=list)  # folders that are not model files (.git, .cache)


def _duplicate_reason(rel: str) -> str | None:
    from fnmatch import fnmatchcase

    for pattern, why in DUPLICATE_PATTERNS:
        if ("/" in pattern) == ("/" in rel) and fnmatchcase(rel, pattern):
            return why
    return None


def plan_side_files(src: Path, main: set[str], skip: set[str] = frozenset(),
                    duplicates: bool = True) -> SideFiles:
    """Classify every file under ``src``: ``main`` (the main weight files and their index,
    which the caller rewrites) and ``skip`` (e.g. config.json) are not listed; known
    copies of the main weights in other formats are ``duplicates`` (when
    ``duplicates``); every other file, whatever it holds, is copied."""
    out = SideFiles()
    for root, dirs, files in os.walk(src):
        rel_root = Path(root).relative_to(src)
        for d in sorted(dirs):
            if d in NOT_MODEL_DIRS:
                out.ignored.append(str(rel_root / d) + "/")
        dirs[:] = sorted(d for d in dirs if d not in NOT_MODEL_DIRS)
        if rel_root != Path(".") and not dirs and not files:
            out.empty_dirs.append(rel_root.as_posix())
        for name in sorted(files):
            rel = (rel_root / name).as_posix()
            if rel in main or rel in skip:
                continue
            why = _duplicate_reason(rel) if duplicates else None
            if why is not None:
                out.duplicates.append((rel, why))
            else:
                out.copied.append(rel)
    return out


def copy_side_files(src: Path, dst: Path, plan: SideFiles) -> None:
    """Copy ``plan.copied`` from ``src`` to ``dst`` (folders created, metadata kept)."""
    for rel in plan.empty_dirs:
        (dst / rel).mkdir(parents=True, exist_ok=True)
    for rel in plan.copied:
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, target)
