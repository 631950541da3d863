"""`model import` takes every token fact from what the folder holds, says where each came
from, and refuses a model that could never stop: a folder with only ``tokenizer.model`` (the
SentencePiece model defines BOS and EOS itself) once imported as no BOS and no stop token, so
the model got another input than its exporter's reference loop and never ended."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from agent.model.directory import load_model_dir
from tests.unit.cli.test_cli import cli
from tests.unit.model.test_litertlm import KV, PROMPT, greedy, reference_greedy


@pytest.fixture(scope="module")
def sp_folder(
    tiny_model_factory: Any, tiny_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A folder with a `.tflite` export and a bare SentencePiece ``tokenizer.model``."""
    d = tmp_path_factory.mktemp("sp") / "Tiny-SP"
    d.mkdir()
    int8 = Path(tiny_model_factory(prefill_lens=(8, 32), kv_max=KV, quantization="int8"))
    shutil.copyfile(int8, d / f"tiny_q8_ekv{KV}.tflite")
    shutil.copyfile(tiny_tokenizer, d / "tokenizer.model")
    return d


def _sp(path: Path) -> Any:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(path))


def test_a_sentencepiece_folder_gets_the_models_own_bos_and_eos(
    sp_folder: Path, tmp_path: Path, make_profile: Any
) -> None:
    sp = _sp(sp_folder / "tokenizer.model")
    bos, eos = sp.bos_id(), sp.eos_id()
    assert bos >= 0 and eos >= 0  # the fixture's model defines both
    out = tmp_path / "m"
    r = cli("model", "import", str(sp_folder), "-o", str(out))
    assert r.returncode == 0, r.stderr
    meta = load_model_dir(out)
    assert (meta.bos_id, meta.eos_id, list(meta.stop_token_ids), meta.add_bos) == (
        bos,
        eos,
        [eos],
        True,
    )
    # what it decided, and from where, one line each
    said = [line for line in r.stdout.splitlines() if line.startswith("import: ")]
    assert f"import: bos_id {bos} {sp.id_to_piece(bos)!r} from tokenizer.model" in said
    assert f"import: eos_id {eos} {sp.id_to_piece(eos)!r} from tokenizer.model" in said
    assert any(line.startswith("import: add_bos true from tokenizer.model") for line in said)
    # the imported model is fed what the exporter's reference loop feeds: BOS first
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "xnnpack")})
    model = next(sp_folder.glob("*.tflite"))
    want = reference_greedy(model, [bos, *sp.encode(PROMPT)], 12, {eos}, sp.get_piece_size())
    assert greedy(profile, out, 12) == want


def test_side_files_win_over_the_tokenizers_own_ids(sp_folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(sp_folder, src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    (src / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    out = tmp_path / "m"
    r = cli("model", "import", str(src), "-o", str(out))
    assert r.returncode == 0, r.stderr
    meta = load_model_dir(out)
    assert (meta.eos_id, list(meta.stop_token_ids), meta.add_bos) == (3, [3, 4], False)
    assert "from generation_config.json" in r.stdout
    assert "add_bos false from tokenizer_config.json (add_bos_token)" in r.stdout


def test_no_stop_token_is_refused_unless_allowed(
    sp_folder: Path, tiny_model_factory: Any, tmp_path: Path
) -> None:
    """A tokenizer.json names no roles: with no side file there is no EOS anywhere."""
    from tests.unit.modelimport.test_model_import import make_hf_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    shutil.copyfile(next(sp_folder.glob("*.tflite")), src / "m.tflite")
    make_hf_tokenizer(src / "tokenizer.json")
    out = tmp_path / "m"
    r = cli("model", "import", str(src), "-o", str(out))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no stop token" in r.stderr and "--allow-no-stop" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]
    r = cli("model", "import", str(src), "-o", str(out), "--allow-no-stop")
    assert r.returncode == 0, r.stderr
    assert list(load_model_dir(out).stop_token_ids) == []
    assert "import: stop_token_ids none" in r.stdout
