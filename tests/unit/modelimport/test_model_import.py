"""`edge-agent model import`, run as a real subprocess on folders laid out like a
litert-community / Hugging Face download (built here from tiny models) and on `.litertlm`
bundles: every metadata field checked against the source files, the imported directory run
by the engine against a plain LiteRT loop on the source file, and every refusal."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from agent.base.errors import ModelFormatError
from agent.model.directory import load_model_dir
from agent.modelimport import import_model
from tests.unit.cli.test_cli import cli
from tests.unit.model.test_litertlm import (
    BOS,
    EOS,
    KV,
    PROMPT,
    build_bundle,
    greedy,
    reference_greedy,
)

CORPUS = (
    "def main():\n    return 1\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\nfor i in range(10):\n    print(i * 2)\n"
    "import os, sys\nif __name__ == '__main__':\n    main()\n"
    "# 0123456789 abcdefghijklmnopqrstuvwxyz\n"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's ChatML template (the published one, written from memory)
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_hf_tokenizer(path: Path, *, bos: str | None = None) -> Path:
    """A byte-level BPE tokenizer.json trained by Hugging Face `tokenizers` (vocab ≤ 200, so
    it fits the tiny models' 256), with ChatML's special tokens; `bos`: a post-processor that
    puts that token first, as Llama 3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [CORPUS] * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS)
    )
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    tok.save(str(path))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def make_fp16(fp32: Path, out: Path) -> Path:
    """fp16 weights by ai-edge-quantizer's float casting (litert-torch's fp16 recipe)."""
    from ai_edge_quantizer import quantizer
    from litert_torch.generative.quantize import quant_recipes
    from litert_torch.quantize import translate_recipe

    import agent.toolchain  # noqa: F401  (litert-torch's tensorflow shim)

    recipe = translate_recipe.translate_to_ai_edge_recipe(
        quant_recipes.full_fp16_recipe().generative_recipe
    )
    qt = quantizer.Quantizer(bytearray(fp32.read_bytes()), list(recipe))
    out.write_bytes(bytes(qt.quantize().quantized_model))
    return out


@pytest.fixture(scope="module")
def variants(tiny_model_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Source files by the quantization they were made with."""
    fp32 = Path(tiny_model_factory(prefill_lens=(8, 32), kv_max=KV))
    int8 = Path(tiny_model_factory(prefill_lens=(8, 32), kv_max=KV, quantization="int8"))
    fp16 = make_fp16(fp32, tmp_path_factory.mktemp("fp16") / "fp16.tflite")
    return {"fp32": fp32, "int8": int8, "fp16": fp16}


@pytest.fixture(scope="module")
def download(variants: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder as litert-community ships one (names as theirs: nothing is read from them)."""
    d = tmp_path_factory.mktemp("download") / "Tiny-Chat-Instruct"
    d.mkdir()
    for quant, name in (("fp32", "f32"), ("int8", "q8"), ("fp16", "f16")):
        shutil.copyfile(variants[quant], d / f"Tiny-Chat_multi-prefill-seq_{name}_ekv{KV}.tflite")
    tok = make_hf_tokenizer(d / "tokenizer.json")
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tok))
    end, im_end = ids.token_to_id("<|endoftext|>"), ids.token_to_id("<|im_end|>")
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
                "model_max_length": 32768,
                "tokenizer_class": "Qwen2Tokenizer",
            },
            indent=2,
        )
    )
    (d / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": end,
                "eos_token_id": [im_end, end],
                "do_sample": True,
                "temperature": 0.7,
                "top_k": 20,
                "top_p": 0.8,
                "repetition_penalty": 1.05,
            }
        )
    )
    (d / "config.json").write_text(
        json.dumps({"bos_token_id": end, "eos_token_id": end, "max_position_embeddings": 32768})
    )
    (d / "README.md").write_text("a model card\n")
    return d


def test_import_a_download_folder(
    download: Path, variants: dict[str, Path], tmp_path: Path, make_profile: Any
) -> None:
    from tokenizers import Tokenizer

    before = tree_digest(download)
    out = tmp_path / "models" / "tiny-chat"
    r = cli(
        "model", "import", str(download), "-o", str(out), "--name", "tiny-chat", "--version", "2.1"
    )
    assert r.returncode == 0, r.stderr
    assert tree_digest(download) == before  # the source is only read
    ref = Tokenizer.from_file(str(download / "tokenizer.json"))
    gen = json.loads((download / "generation_config.json").read_text())
    meta = load_model_dir(out)
    assert (meta.name, meta.version, meta.context_length) == ("tiny-chat", "2.1", KV)
    assert meta.tokenizer == "tokenizer.json"
    assert meta.bos_id is None and meta.add_bos is False  # bos_token: null
    assert meta.eos_id == ref.token_to_id("<|im_end|>")
    assert list(meta.stop_token_ids) == gen["eos_token_id"]
    assert meta.chat_template == CHATML
    assert dict(meta.generation) == {"temperature": 0.7, "top_k": 20.0, "top_p": 0.8}
    by_file = {
        f"Tiny-Chat_multi-prefill-seq_{n}_ekv{KV}.tflite": q
        for q, n in (("fp32", "f32"), ("int8", "q8"), ("fp16", "f16"))
    }
    assert {v.file: v.quantization for v in meta.variants} == by_file
    for v in meta.variants:
        source = download / v.file
        assert v.sha256 == sha256(source) == sha256(variants[v.quantization])
        assert v.size == source.stat().st_size
        assert sha256(out / v.file) == v.sha256
    for side in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "config.json",
    ):
        assert (out / side).read_bytes() == (download / side).read_bytes()
    assert not (out / "README.md").exists()
    assert [p.name for p in out.parent.iterdir()] == ["tiny-chat"]  # no temp dir left

    # the imported directory runs, and gives the source file's own tokens
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "xnnpack")})
    stops = set(meta.stop_token_ids)
    prompt_ids = ref.encode(PROMPT).ids
    for v in meta.variants:
        want = reference_greedy(
            variants[v.quantization], prompt_ids, 12, stops, ref.get_vocab_size()
        )
        assert greedy(profile, out, 12, quantization=v.quantization) == want, v.quantization
        assert len(set(want)) > 1


def test_bos_from_the_post_processor_named_templates_and_config_ids(
    variants: dict[str, Path], tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    src = tmp_path / "src"
    src.mkdir()
    shutil.copyfile(variants["int8"], src / "a.tflite")
    shutil.copyfile(variants["fp32"], src / "b.tflite")
    tok = Tokenizer.from_file(str(make_hf_tokenizer(src / "tokenizer.json", bos="<|endoftext|>")))
    end, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    templates = [
        {"name": "tool_use", "template": "{{ tools }}"},
        {"name": "default", "template": CHATML},
    ]
    (src / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|endoftext|>", "lstrip": False, "special": True},
                "chat_template": templates,
            }
        )
    )
    (src / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [im_end, end]}}))
    seen: list[tuple[str, int, int]] = []
    meta = import_model(
        src, tmp_path / "out", files=["a.tflite"], progress=lambda *a: seen.append(a)
    )
    assert [v.file for v in meta.variants] == ["a.tflite"]
    assert meta.bos_id == end and meta.add_bos is True  # the post-processor adds it
    assert tok.encode("x").ids[0] == end
    assert meta.eos_id == im_end and list(meta.stop_token_ids) == [im_end, end]
    assert meta.chat_template == CHATML
    assert meta.generation == ()
    assert seen and seen[-1] == (
        "a.tflite",
        src.joinpath("a.tflite").stat().st_size,
        src.joinpath("a.tflite").stat().st_size,
    )


def test_import_a_litertlm(
    tmp_path: Path, variants: dict[str, Path], tiny_tokenizer: Path, make_profile: Any
) -> None:
    import sentencepiece as spm

    bundle = build_bundle(
        tmp_path / "Tiny-int8.litertlm", variants["int8"], sp_tokenizer=tiny_tokenizer
    )
    before = sha256(bundle)
    out = tmp_path / "imported"
    r = cli("model", "import", str(bundle), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert sha256(bundle) == before
    meta = load_model_dir(out)
    (v,) = meta.variants
    assert (v.file, v.quantization, v.sha256) == (
        "model_int8.tflite",
        "int8",
        sha256(variants["int8"]),
    )
    assert (meta.name, meta.context_length, meta.tokenizer) == ("Tiny-int8", KV, "tokenizer.model")
    assert (out / "tokenizer.model").read_bytes() == tiny_tokenizer.read_bytes()
    assert (meta.bos_id, meta.eos_id, meta.stop_token_ids, meta.add_bos) == (BOS, EOS, (EOS,), True)
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "xnnpack")})
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    want = reference_greedy(variants["int8"], [BOS, *sp.encode(PROMPT)], 12, {EOS})
    assert greedy(profile, out, 12) == want


# ----------------------------------------------------------------------------- refusals


def _not_generative(d: Path) -> str:
    from ai_edge_litert.tools import flatbuffer_utils as fu

    f = d / f"Tiny-Chat_multi-prefill-seq_q8_ekv{KV}.tflite"
    model = fu.read_model(str(f))
    model.signatureDefs = [s for s in model.signatureDefs if s.signatureKey != b"decode"]
    fu.write_model(model, str(f))
    return f.name


def _edit_json(name: str, **changes: Any) -> Any:
    def edit(d: Path) -> str:
        doc = json.loads((d / name).read_text())
        doc.update(changes)
        (d / name).write_text(json.dumps(doc))
        return name

    return edit


def _write(name: str, text: str) -> Any:
    def write(d: Path) -> str:
        (d / name).write_text(text)
        return name

    return write


def _remove(pattern: str, named: str) -> Any:
    def remove(d: Path) -> str:
        for p in d.glob(pattern):
            p.unlink()
        return named

    return remove


def _second_int8(d: Path) -> str:
    shutil.copyfile(d / f"Tiny-Chat_multi-prefill-seq_q8_ekv{KV}.tflite", d / "zz_copy.tflite")
    return "zz_copy.tflite"


REFUSALS = {
    "no-tflite": (_remove("*.tflite", ""), "no .tflite file"),
    "no-tokenizer": (_remove("tokenizer.json", ""), "no tokenizer"),
    "not-generative": (_not_generative, "not a generative LLM export"),
    "bad-json": (_write("tokenizer_config.json", '{"bos_token": '), "not valid JSON"),
    "template-not-string": (
        _edit_json("tokenizer_config.json", chat_template=42),
        "should be a string",
    ),
    "template-syntax": (
        _edit_json("tokenizer_config.json", chat_template="{% for m in messages %}{{ m }}"),
        "not valid Jinja",
    ),
    "no-default-template": (
        _edit_json("tokenizer_config.json", chat_template=[{"name": "rag", "template": "x"}]),
        "without a 'default' template",
    ),
    "eos-not-in-vocab": (
        _edit_json("tokenizer_config.json", eos_token="<|nope|>"),
        "not in the vocabulary",
    ),
    "bad-eos-id": (
        _edit_json("generation_config.json", eos_token_id="two"),
        "eos_token_id = 'two'",
    ),
    "same-quantization": (_second_int8, "a second int8 variant"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_one_line_and_leave_nothing(download: Path, tmp_path: Path, case: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(download, src)
    damage, says = REFUSALS[case]
    named = damage(src)
    before = tree_digest(src)
    out = tmp_path / "out" / "model"
    r = cli("model", "import", str(src), "-o", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert says in lines[0] and str(src / named).rstrip("/") in lines[0], lines[0]
    assert not out.exists()
    parent = tmp_path / "out"
    assert (list(parent.iterdir()) if parent.exists() else []) == []  # no temp dir left
    assert tree_digest(src) == before


def test_a_target_that_is_not_empty_is_left_alone(download: Path, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    r = cli("model", "import", str(download), "-o", str(out))
    assert r.returncode == 2 and "exists and is not empty" in r.stderr and str(out) in r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    meta = import_model(download, empty, files=[f"Tiny-Chat_multi-prefill-seq_q8_ekv{KV}.tflite"])
    assert meta.directory == empty and (empty / "metadata.json").exists()


def test_a_file_that_is_neither_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(ModelFormatError, match=r"neither a \.litertlm bundle nor a folder"):
        import_model(f, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("options", "made_as"),
    [
        ({}, "fp32"),
        ({}, "int8"),
        ({}, "int4_block32"),
        ({}, "mixed"),
        ({"enable_hlfb": False, "prefill_lens": (8, 32), "kv_max": 128}, "int8_weight_only"),
    ],
)
def test_quantization_is_read_from_the_weights(
    tiny_model_factory: Any, options: dict[str, Any], made_as: str
) -> None:
    """What the toolchain made (agent/toolchain/quantize.py recipes) is what the weights say."""
    from agent.model.facts import quantization_of
    from agent.model.tflite.file import read_model_file

    path = Path(tiny_model_factory(quantization=made_as, **options))
    assert quantization_of(read_model_file(path)) == made_as


def test_fp16_is_not_fp32(variants: dict[str, Path]) -> None:
    from agent.model.facts import quantization_of
    from agent.model.tflite.file import read_model_file

    assert quantization_of(read_model_file(variants["fp16"])) == "fp16"
    assert quantization_of(read_model_file(variants["fp32"])) == "fp32"


def test_progress_lines_for_large_files(capsys: pytest.CaptureFixture[str]) -> None:
    """What `model import` prints on stderr while it copies and hashes: a line per 10% of a
    file of 16 MiB or more, nothing for smaller ones."""
    from agent.cli.model import _import_progress

    show = _import_progress()
    mib = 1 << 20
    for done in range(0, 41 * mib, mib):
        show("big.tflite", done, 40 * mib)
    show("small.tflite", mib, 2 * mib)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 11 and all(line.startswith("import: big.tflite: ") for line in lines)
    assert lines[-1] == "import: big.tflite: 40/40 MiB hashed (100%)"


def test_templates_the_chat_code_renders_are_accepted(
    variants: dict[str, Path], tmp_path: Path
) -> None:
    """transformers' `{% generation %}` tag is Jinja the chat code takes: not refused."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copyfile(variants["int8"], src / "m.tflite")
    make_hf_tokenizer(src / "tokenizer.json")
    tagged = (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    (src / "chat_template.jinja").write_text(tagged)
    meta = import_model(src, tmp_path / "out", allow_no_stop=True)  # the template is the point
    assert meta.chat_template == tagged


def test_a_folder_with_only_a_bundle_says_so(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "Tiny.litertlm").write_bytes(b"LITERTLM")
    make_hf_tokenizer(src / "tokenizer.json")
    with pytest.raises(
        ModelFormatError, match=r"no \.tflite file .*import the bundle itself: Tiny"
    ):
        import_model(src, tmp_path / "out")


def test_a_target_that_cannot_be_made_is_one_line(download: Path, tmp_path: Path) -> None:
    """An OS error on the way (here: the target's parent is a file) is one line, exit 2."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    r = cli("model", "import", str(download), "-o", str(blocker / "m"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and str(blocker) in r.stderr
    assert blocker.read_text() == "x"
