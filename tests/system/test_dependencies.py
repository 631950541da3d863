"""What the daemon's dependencies pull in and what it really imports.

`tokenizers` (tokenizer.json models) requires `huggingface-hub`, which brings hf-xet, fsspec,
httpx2, tqdm, PyYAML, click and filelock (~27 MB here; README "Two commands"). edge-agent only
calls `Tokenizer.from_file` and never reaches a model hub: this proves the hub client is never
imported, so a board may leave it out (`pip uninstall huggingface-hub hf-xet`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.unit.modelimport.test_model_import import make_hf_tokenizer


def test_a_tokenizer_json_model_never_imports_the_hub_client(tmp_path: Path) -> None:
    tok = make_hf_tokenizer(tmp_path / "tokenizer.json")
    probe = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from agent.tokenizer.load import load_tokenizer\n"
        f"t = load_tokenizer(Path({str(tok)!r}))\n"
        "ids = t.encode('def main():')\n"
        "print(json.dumps({'ids': list(ids), 'hub': 'huggingface_hub' in sys.modules,\n"
        "                  'tokenizers': 'tokenizers' in sys.modules}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tokenizers"] and got["ids"]  # the library did the work
    assert got["hub"] is False
