"""``zipserv``: compress, verify, inspect and decompress Hugging Face checkpoints.

    zipserv compress SRC DST [--overwrite] [--max-shard-size 5GB] [--threads N]
    zipserv verify DIR [--against SRC]
    zipserv inspect DIR [--json]
    zipserv decompress DIR OUT [--overwrite]

This module only parses arguments, calls ``zipserv_vllm.checkpoint`` and
formats results. A problem with the input prints one line
``zipserv: error: ...`` on stderr and exits with 2; ``verify`` exits with 1
when the data does not match (CRC or ``--against``). See docs/CLI.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from safetensors import SafetensorError

from . import __version__
from .format import FormatError

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


def _size_arg(text: str) -> int:
    from .checkpoint import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{int(n)} B"


def _summary_table(summary) -> list[str]:
    lines = [f"{'kind':<14}{'tensors':>8}{'before':>14}{'after':>14}{'ratio':>8}{'bits/weight':>13}"]
    for kind, s in summary.rows():
        if kind in ("compressed", "total"):
            lines.append("-" * 71)
        lines.append(f"{kind:<14}{s.tensors:>8}{_fmt_bytes(s.before):>14}{_fmt_bytes(s.after):>14}"
                     f"{s.ratio:>8.3f}{s.bits_per_weight:>13.3f}")
    return lines


# ----------------------------------------------------------------------------- commands
def _cmd_compress(a) -> int:
    from .checkpoint import compress_checkpoint

    r = compress_checkpoint(a.src, a.dst, overwrite=a.overwrite, max_shard_bytes=a.max_shard_size,
                            threads=a.threads, mode=a.mode, progress=a.progress, check=a.check, dtype=a.dtype)
    t = r.summary.total
    print(f"compressed {r.src} -> {r.dst}: {len(r.compressed_modules)} of {t.tensors} tensors, "
          f"{r.shards} shard{'s' * (r.shards != 1)}, {r.seconds:.2f} s ({r.gb_per_s:.3f} GB/s)")
    print("\n".join(_summary_table(r.summary)))
    for line in compress_notes(r):
        print(line)
    return EXIT_OK


def _group(pairs) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item, why in pairs:
        out.setdefault(why, []).append(item)
    return out


def _names(items: list[str], limit: int = 4) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def compress_notes(r) -> list[str]:
    """What a compress report says beyond the table: weights kept BF16 (and why), Conv1D
    weights stored transposed, files copied, and files left out (and why)."""
    lines = []
    for why, items in _group(r.kept_bf16).items():
        lines.append(f"kept BF16 ({len(items)}): {why}: {_names(items)}")
    if r.transposed:
        lines.append(f"stored transposed ({len(r.transposed)} Conv1D weights, as [out, in]; decompress restores "
                     f"them): {_names(r.transposed)}")
    if r.side.copied:
        lines.append(f"copied as is ({len(r.side.copied)} files): {_names(r.side.copied, 8)}")
    for why, items in _group(r.side.duplicates).items():
        lines.append(f"left out ({why}): {_names(items, 8)}")
    if r.side.ignored:
        lines.append(f"not model files, not copied: {_names(r.side.ignored)}")
    return lines


def _cmd_decompress(a) -> int:
    from .checkpoint import decompress_checkpoint

    r = decompress_checkpoint(a.dir, a.out, overwrite=a.overwrite, threads=a.threads, progress=a.progress)
    c = r.summary.compressed
    print(f"decompressed {r.src} -> {r.dst}: {c.tensors} tensors decoded (CRC-32 checked), "
          f"{r.summary.kinds['uncompressed'].tensors} copied, {r.shards} shard{'s' * (r.shards != 1)}, "
          f"{_fmt_bytes(r.summary.total.before)}, {r.seconds:.2f} s")
    return EXIT_OK


def _cmd_verify(a) -> int:
    from .checkpoint import verify_checkpoint

    r = verify_checkpoint(a.dir, a.against, threads=a.threads, progress=a.progress)
    if not r.ok:
        for p in r.problems:
            print(f"zipserv: verify: {p}", file=sys.stderr)
        print(f"zipserv: error: verification of {r.path} failed: {len(r.problems)} "
              f"mismatch{'es' * (len(r.problems) != 1)} (first: {r.problems[0]})", file=sys.stderr)
        return EXIT_MISMATCH
    if r.no_crc:
        n = len(r.no_crc)
        tiles = ("its tiles checked against zs_crc" if n == 1 else "their tiles checked against zs_crc") \
            if r.no_crc_tiles == n else f"{r.no_crc_tiles} of them with their tiles checked against zs_crc"
        crc = (f"{r.compressed - n} with matching CRC-32, {n} with no CRC stored ({_names(r.no_crc, 3)}; "
               f"{tiles}; NOT compared with a CRC-32)")
        line = f"OK {r.path}: {r.compressed} compressed tensors decoded, {crc}, "
    else:
        line = f"OK {r.path}: {r.compressed} compressed tensors decoded with matching CRC-32, "
    line += f"{r.copied} copied tensors read, index and shards complete"
    if r.against is not None:
        cast = f" (its {r.source_dtype} weights cast to BF16 as vLLM casts them)" if r.source_dtype else ""
        line += (f"; all {r.compressed + r.copied} tensors bit-identical to {r.against}{cast}, and its "
                 f"{r.files_checked} other files byte-identical")
        if r.duplicates:
            line += f" ({len(r.duplicates)} copies of the main weights left out: {_names([d[0] for d in r.duplicates])})"
    print(f"{line} ({_fmt_bytes(r.bytes_checked)} in {r.seconds:.2f} s)")
    return EXIT_OK


def _cmd_inspect(a) -> int:
    from .checkpoint import inspect_checkpoint

    info = inspect_checkpoint(a.dir)
    if a.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    kind = f"zipserv format v{info['format_version']}, mode {info['mode']}" if info["compressed"] else "not compressed"
    print(f"{info['path']}: {kind}, {len(info['shards'])} shard{'s' * (len(info['shards']) != 1)}")
    width = max([len(r["name"]) for r in info["tensors"]] + [6])
    print(f"{'tensor':<{width}}  {'dtype':<5} {'shape':>13} {'bytes':>12} {'bits/w':>7} {'coverage':>9}")
    for r in info["tensors"]:
        shape = "x".join(map(str, r["shape"])) or "scalar"
        cov = f"{100 * r['coverage']:8.2f}%" if r["coverage"] is not None else f"{'-':>9}"
        print(f"{r['name']:<{width}}  {r['dtype']:<5} {shape:>13} {r['bytes']:>12} {r['bits_per_weight']:>7.3f} {cov}")
    print()
    lines = [f"{'kind':<14}{'tensors':>8}{'before':>14}{'after':>14}{'ratio':>8}{'bits/weight':>13}"]
    for k, s in info["by_kind"].items():
        if k in ("compressed", "total"):
            lines.append("-" * 71)
        lines.append(f"{k:<14}{s['tensors']:>8}{_fmt_bytes(s['bytes_before']):>14}{_fmt_bytes(s['bytes_after']):>14}"
                     f"{s['ratio']:>8.3f}{s['bits_per_weight']:>13.3f}")
    print("\n".join(lines))
    if info["totals"]["coverage"] is not None:
        print(f"window coverage of compressed weights: {100 * info['totals']['coverage']:.2f}% of elements "
              f"in the 7-exponent window (the rest are BF16 fallbacks)")
    return EXIT_OK


# ------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zipserv", description="Lossless TCA-TBE compression of BF16 checkpoints.")
    p.add_argument("--version", action="version", version=f"zipserv-vllm {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def progress_opt(sp):
        sp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="show a progress bar (default: only on a terminal)")
        sp.add_argument("--threads", metavar="N", type=_positive_int, default=None,
                        help="codec threads (default: ZIPSERV_THREADS or torch's thread count)")

    c = sub.add_parser("compress", help="write a zipserv checkpoint of a BF16 checkpoint",
                       description="Compress every linear, embedding and lm_head weight of a BF16 safetensors "
                                   "checkpoint; copy everything else.")
    c.add_argument("src", metavar="SRC", help="checkpoint directory, or a Hugging Face Hub id when no such path exists")
    c.add_argument("dst", metavar="DST", help="output directory (must not exist unless --overwrite)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing DST (only once DST is complete)")
    c.add_argument("--max-shard-size", metavar="SIZE", type=_size_arg, default="5GB", help="largest shard, e.g. 5GB, 500MB (default 5GB)")
    c.add_argument("--mode", choices=("fast", "exact"), default="fast",
                   help="GEMM mode recorded in quantization_config (default fast)")
    c.add_argument("--dtype", choices=("bfloat16",), default=None,
                   help="take an FP32 / FP16 checkpoint: cast each compressed weight to BF16 as vLLM's loader does "
                        "with --dtype bfloat16 (default: refuse anything but BF16)")
    c.add_argument("--no-check", dest="check", action="store_false",
                   help="skip decoding each weight again before writing it")
    progress_opt(c)
    c.set_defaults(func=_cmd_compress)

    v = sub.add_parser("verify", help="decode every tensor and check CRCs (and equality with --against)")
    v.add_argument("dir", metavar="DIR", help="zipserv checkpoint directory")
    v.add_argument("--against", metavar="SRC", default=None, help="original checkpoint: require bit equality")
    progress_opt(v)
    v.set_defaults(func=_cmd_verify)

    i = sub.add_parser("inspect", help="per-tensor sizes, bits per weight and window coverage")
    i.add_argument("dir", metavar="DIR", help="checkpoint directory (compressed or not)")
    i.add_argument("--json", action="store_true", help="print machine-readable JSON")
    i.set_defaults(func=_cmd_inspect)

    d = sub.add_parser("decompress", help="rebuild the plain BF16 checkpoint")
    d.add_argument("dir", metavar="DIR", help="zipserv checkpoint directory")
    d.add_argument("out", metavar="OUT", help="output directory (must not exist unless --overwrite)")
    d.add_argument("--overwrite", action="store_true", help="replace an existing OUT (only once OUT is complete)")
    progress_opt(d)
    d.set_defaults(func=_cmd_decompress)
    return p


def _error_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line[len("zipserv: "):] if line.startswith("zipserv: ") else line


def main(argv: list[str] | None = None) -> int:
    """Run the ``zipserv`` command; return the exit status (0 ok, 1 verify mismatch, 2 error)."""
    from .checkpoint import CheckpointError
    from .settings import SettingError

    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = lambda msg, *_a, **_k: print(f"zipserv: warning: {msg}", file=sys.stderr)
        try:
            return args.func(args)
        except BrokenPipeError:  # e.g. `zipserv inspect DIR | head`: stop quietly, as other tools do
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return EXIT_MISMATCH
        except (CheckpointError, FormatError, SafetensorError, OSError, SettingError) as exc:
            print(f"zipserv: error: {_error_line(exc)}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            print("zipserv: interrupted (no partial output was left behind)", file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
