"""`edge-agent model inspect|import|diff|patch`: model files by hand.

``inspect`` shows a model's signatures, KV layout, quantization and hashes; ``import`` makes a
model directory from a .litertlm bundle or an export folder. ``diff`` and ``patch`` take two
files or two model directories: ``diff`` prints what the update delta holds (``--json`` for a
machine-readable line); ``patch`` rebuilds and verifies the target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.cli.common import _profile_arg
from agent.ota.delta.files import (
    DEFAULT_LEVEL,
    DeltaError,
    diff_dirs,
    diff_file,
    patch_dirs,
    patch_file,
    read_header,
)


def cmd_model_inspect(args: argparse.Namespace) -> int:
    from agent.cli.inspect_report import inspect_report

    check = None
    if args.check:  # load it as `generate` would: the profile, a one-shot weight cache
        from agent.cli.common import _resolve
        from agent.profile.oneshot import one_shot_profile

        check = one_shot_profile(_resolve(args)[0])
    report = inspect_report(Path(args.path), check)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from agent.cli.inspect_report import format_report

        print(format_report(report))
    return 0


def _import_progress() -> Callable[[str, int, int], None]:
    """Progress of copying and hashing files of 16 MiB or more: a line per 10% on stderr."""
    shown: dict[str, int] = {}

    def show(name: str, done: int, total: int) -> None:
        if total < 16 << 20:
            return
        step = done * 10 // total
        if shown.get(name, -1) < step:
            shown[name] = step
            print(
                f"import: {name}: {done >> 20}/{total >> 20} MiB hashed ({step * 10}%)",
                file=sys.stderr,
                flush=True,
            )

    return show


def cmd_model_import(args: argparse.Namespace) -> int:
    from agent.modelimport import import_model

    decided: list[str] = []
    meta = import_model(
        Path(args.src),
        Path(args.output),
        name=args.name,
        version=args.version,
        files=args.file,
        progress=_import_progress(),
        allow_no_stop=args.allow_no_stop,
        decided=decided,
    )
    for line in decided:
        print(f"import: {line}")
    variants = ", ".join(f"{v.file} ({v.quantization})" for v in meta.variants)
    print(
        f"{meta.directory}: {meta.name} {meta.version}, context {meta.context_length}, "
        f"{meta.tokenizer}, {variants}"
    )
    return 0


# ----------------------------------------------------------------------------- deltas


def _kind(a: Path, b: Path, what: str) -> str:
    if a.is_dir() and b.is_dir():
        return "dir"
    if a.is_file() and b.is_file():
        return "file"
    raise DeltaError(f"{what}: {a} and {b} must both be files or both be model directories")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def cmd_model_diff(args: argparse.Namespace) -> int:
    base, new, out = Path(args.base), Path(args.new), Path(args.output)
    diff = diff_dirs if _kind(base, new, "model diff") == "dir" else diff_file
    start = time.perf_counter()
    stats = diff(base, new, out, level=args.level)
    seconds = time.perf_counter() - start
    share = stats.delta_bytes / max(stats.target_bytes, 1)
    if args.json:
        doc: dict[str, Any] = dataclasses.asdict(stats)
        doc.update(delta=str(out), ratio=round(share, 6), seconds=round(seconds, 3))
        print(json.dumps(doc))
        return 0
    print(
        f"{out}: {stats.delta_bytes} bytes ({_mib(stats.delta_bytes)}), {share:.2%} of the "
        f"{stats.files} target file(s) ({_mib(stats.target_bytes)}) in {seconds:.1f} s"
    )
    print(
        f"  copied {_mib(stats.copied_bytes)}, carried {_mib(stats.data_bytes)}, "
        f"patched {_mib(stats.patched_bytes)} in {stats.ops} ops"
    )
    for e in read_header(out):
        base_note = f"from {e.base_name}" if e.base_name else "carried whole"
        print(f"  {e.name:32} {e.size:>12} bytes  {e.method:8} {base_note}")
    return 0


def cmd_model_patch(args: argparse.Namespace) -> int:
    base, delta, out = Path(args.base), Path(args.delta), Path(args.output)
    start = time.perf_counter()
    if base.is_dir():
        files = patch_dirs(base, delta, out)
    else:
        patch_file(base, delta, out)
        e = read_header(delta)[0]
        files = [(out.name, e.sha256, e.size)]
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"files": [list(f) for f in files], "seconds": round(seconds, 3)}))
        return 0
    for name, sha, size in files:
        print(f"{name:32} {size:>12} bytes  sha256 {sha}")
    print(f"{out}: {len(files)} file(s) rebuilt and verified in {seconds:.1f} s")
    return 0


def add_model_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``model inspect|import|diff|patch`` to the CLI's subparsers (each sets `func`)."""
    model = subparsers.add_parser("model", help="model files")
    msub = model.add_subparsers(dest="model_command", required=True)
    p = msub.add_parser("inspect", help="signatures, KV layout, quantization, fused ops, sha256")
    p.add_argument("path", help="a .tflite file, a model directory or a .litertlm bundle")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--check",
        action="store_true",
        help="load it under the profile: does the first-load check allow speculation?",
    )
    _profile_arg(p)
    p.set_defaults(func=cmd_model_inspect)
    p = msub.add_parser(
        "import", help="a model directory from a .litertlm or a downloaded export folder"
    )
    p.add_argument("src", help="a .litertlm bundle, or a folder with .tflite files and a tokenizer")
    p.add_argument("-o", "--output", required=True, help="the model directory to write (new)")
    p.add_argument("--name", help="model name (default: the bundle's or folder's name)")
    p.add_argument("--version", help="model version (default: the bundle's, else 0)")
    p.add_argument(
        "--file", action="append", default=[], help="import only this .tflite (repeatable)"
    )
    p.add_argument(
        "--allow-no-stop",
        action="store_true",
        help="import a model that names no stop token (its generations end only at the limit)",
    )
    p.set_defaults(func=cmd_model_import)
    add_delta_commands(msub)


def add_delta_commands(
    model_subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Add ``diff`` and ``patch`` to the ``model`` command's subparsers."""
    p = model_subparsers.add_parser(
        "diff", help="write an update delta that rebuilds NEW from BASE (files or model dirs)"
    )
    p.add_argument("base", help="the model file or directory devices have")
    p.add_argument("new", help="the model file or directory to ship")
    p.add_argument("-o", "--output", required=True, help="the delta file to write")
    p.add_argument(
        "--level", type=int, default=DEFAULT_LEVEL, help=f"zstd level (default {DEFAULT_LEVEL})"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_model_diff)

    p = model_subparsers.add_parser(
        "patch", help="rebuild a model file or directory from BASE and a delta, verified"
    )
    p.add_argument("base", help="the model file or directory the delta was made against")
    p.add_argument("delta", help="the delta file")
    p.add_argument(
        "-o", "--output", required=True, help="the file to write (a new or empty dir for dirs)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_model_patch)
