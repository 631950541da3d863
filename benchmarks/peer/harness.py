"""The parent's side of a run: the prompt texts handed to the workers, one worker in a fresh
process, the medians of its results."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._report import ROOT, med
from benchmarks.peer.spec import HISTORY, PROMPTS, TURN

# The worker's command line: the entry point's `--worker` mode.
ENTRY = ROOT / "scripts" / "bench_peer.py"


@functools.cache
def prompts_file(model: str, lengths: tuple[int, ...]) -> Path:
    """The prompt texts of `lengths` tokens for `model`'s tokenizer, written once by the parent.

    A worker that built them would count the tokenizer's work on the whole source tree (a
    ~30 MiB list of ids, and the heap it leaves behind) in its engine's peak RSS, and LiteRT-LM's
    worker would load a tokenizer it does not use.
    """
    from agent.model.directory import load_model_dir
    from agent.tokenizer.load import load_tokenizer

    tok = load_tokenizer(load_model_dir(Path(model)).tokenizer_path)
    ids = tok.encode("".join(p.read_text() for p in sorted((ROOT / "agent").rglob("*.py"))))
    texts = {str(n): str(tok.decode(ids[: n - 1])) for n in lengths}
    # The timed prompts of the main section share no start with each other or with the
    # warm-up: edge-agent's free caches keep their rows, and a prompt that began like an
    # earlier one would be prefilled only after it (LiteRT-LM prefills every one whole).
    for i, n in enumerate(PROMPTS):
        start = 20_000 * (i + 1)
        texts[f"fresh{n}"] = str(tok.decode(ids[start : start + n - 1]))
    fd, name = tempfile.mkstemp(prefix="bench-prompts-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(texts, f)
    return Path(name)


def spawn(engine: str, **kw: Any) -> dict[str, Any]:
    """Run one worker in a fresh process; its RESULT line."""
    extra = (int(kw.get("history") or HISTORY), int(kw.get("prompt") or 64))
    lengths = {64, *PROMPTS, TURN + 1, *extra}
    if "prompts" not in kw:  # a section with prompts of its own passes their file
        kw["prompts"] = prompts_file(str(kw["model"]), tuple(sorted(lengths)))
    cmd = [sys.executable, str(ENTRY), "--worker", engine]
    for k, v in kw.items():
        if v is True:
            cmd.append(f"--{k.replace('_', '-')}")
        elif v not in (None, False):
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"{engine} worker failed ({r.returncode}):\n{r.stderr[-4000:]}")


def collect(rows: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    xs = [r[key] for r in rows if key in r]
    return med(xs) if xs else None
