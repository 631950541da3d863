"""A model that cannot stop early: the tests' way to make a generation outlast a deadline, a
Ctrl-C or a SIGTERM without betting on what a sampler draws.

The demo model ends an answer when it samples its EOS token; an unseeded, sampled request
may do so after 40 tokens or after 1,000, and a seeded one after whatever its seed gives. A copy
of the model directory with no stop token (`eos_id` null, `stop_token_ids` empty: the same
weights, tokenizer and template) generates exactly `max_tokens` tokens every time, so "still
running after its first token" holds for as long as the remaining tokens take to decode
(~1 ms each here: about a second for 1,000) whatever the sampler does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from agent.model.directory import demo_model_dir, load_model_dir


def endless_model_dir(dest: Path, source: Path | None = None) -> Path:
    """`source` (the demo model by default) copied into `dest`, without any stop token."""
    src = demo_model_dir() if source is None else source
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "metadata.json":
            shutil.copyfile(f, dest / f.name)
    meta = json.loads((src / "metadata.json").read_text())
    meta["eos_id"] = None
    meta["stop_token_ids"] = []
    (dest / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    assert not load_model_dir(dest).stop_ids, "the copy still has a stop token"
    return dest
