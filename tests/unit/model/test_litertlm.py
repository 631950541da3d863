"""`.litertlm` bundles built with Google's litert-lm-builder: run as given, equal to what the
builder's own `unpack` gives, unused sections listed and ignored, broken bundles refused."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.base.errors import ModelFormatError
from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.model.directory import write_model_dir_metadata
from agent.model.open import open_model
from tests.unit.cli.test_cli import cli

PROMPT = "def main():\n    return 1\n"
KV = 128
BOS, EOS = 1, 2  # the tiny SentencePiece tokenizer's (tests/support/tiny_models.py)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_bundle(
    out: Path,
    tflite: Path,
    *,
    sp_tokenizer: Path | None = None,
    hf_tokenizer: Path | None = None,
    metadata: Callable[[Any], None] | None = None,
    extra: Callable[[Any], None] | None = None,
    backend: str | None = None,
) -> Path:
    """A `.litertlm` made by litert-lm-builder: LlmMetadata (start/stop tokens, max tokens, and
    whatever `metadata(md)` sets), one tokenizer, the model as PREFILL_DECODE, and whatever
    `extra(builder)` adds."""
    from litert_lm_builder.litertlm_builder import (
        DType,
        LitertLmFileBuilder,
        Metadata,
        TfLiteModelType,
    )
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    md = llm_metadata_pb2.LlmMetadata()
    md.start_token.token_ids.ids.append(BOS)
    md.stop_tokens.add().token_ids.ids.append(EOS)
    md.max_num_tokens = KV
    if metadata is not None:
        metadata(md)
    md_path = out.with_suffix(".pb")
    md_path.write_bytes(md.SerializeToString())
    b = LitertLmFileBuilder()
    b.add_system_metadata(Metadata(key="Authors", value="edge-agent tests", dtype=DType.STRING))
    b.add_llm_metadata(str(md_path))
    if sp_tokenizer is not None:
        b.add_sentencepiece_tokenizer(str(sp_tokenizer))
    if hf_tokenizer is not None:
        b.add_hf_tokenizer(str(hf_tokenizer))
    b.add_tflite_model(str(tflite), TfLiteModelType.PREFILL_DECODE, backend_constraint=backend)
    if extra is not None:
        extra(b)
    with open(out, "wb") as f:
        b.build(f)
    return out


def unpack(bundle: Path, out: Path) -> Path:
    """Google's own unpacker (a reference outside edge-agent)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "litert_lm_builder.litertlm_builder_cli",
            "unpack",
            "--input",
            str(bundle),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def reference_greedy(
    model: Path, prompt_ids: Sequence[int], n: int, stops: set[int], vocab: int | None = None
) -> list[int]:
    """Greedy tokens from a plain ai_edge_litert Interpreter loop over the `decode` signature
    (KV fed back by hand): nothing of edge-agent runs. `vocab`: the tokenizer's size, when the
    model has logit rows past it (padding: the engine never samples them either)."""
    from ai_edge_litert.interpreter import Interpreter

    run = Interpreter(model_path=str(model)).get_signature_runner("decode")
    kv = {
        name: np.zeros(d["shape"], d["dtype"])
        for name, d in run.get_input_details().items()
        if name.startswith("kv_cache_")
    }
    ids, out = list(prompt_ids), []
    for pos in range(len(ids) + n - 1):
        token = ids[pos] if pos < len(ids) else out[-1]
        res = run(tokens=np.array([[token]], np.int32), input_pos=np.array([pos], np.int32), **kv)
        kv = {k: res[k] for k in kv}
        if pos >= len(ids) - 1:
            nxt = int(np.argmax(res["logits"].reshape(-1)[:vocab]))
            if nxt in stops:
                break
            out.append(nxt)
    return out


def greedy(profile: Any, model: Path, n: int = 16, **kw: Any) -> list[int]:
    engine = Engine.load(profile, model, **kw)
    try:
        done = engine.complete(
            GenerateRequest(prompt=PROMPT, max_tokens=n, sampling=SamplingParams(temperature=0.0))
        )
        return list(done.token_ids)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tiny_int8(tiny_model_factory: Any) -> Path:
    return Path(tiny_model_factory(prefill_lens=(8, 32), kv_max=KV, quantization="int8"))


@pytest.fixture
def bundle(tmp_path: Path, tiny_int8: Path, tiny_tokenizer: Path) -> Path:
    from litert_lm_builder.litertlm_builder import DType, Metadata, TfLiteModelType

    def extra(b: Any) -> None:  # sections a text LLM does not use
        b.add_tflite_model(str(tiny_int8), TfLiteModelType.EMBEDDER)
        b.add_tflite_model(str(tiny_int8), TfLiteModelType.PREFILL_DECODE, backend_constraint="npu")
        b.add_generic_binary_data(str(tiny_tokenizer), [Metadata("note", "x", DType.STRING)])

    return build_bundle(
        tmp_path / "tiny-int8.litertlm", tiny_int8, sp_tokenizer=tiny_tokenizer, extra=extra
    )


def test_a_bundle_generates_the_tokens_of_its_unpacked_tflite(
    bundle: Path, tiny_tokenizer: Path, tmp_path: Path, make_profile: Any
) -> None:
    import sentencepiece as spm

    unpacked = unpack(bundle, tmp_path / "unpacked")
    tflite = unpacked / "Section2_TFLiteModel_tf_lite_prefill_decode.tflite"
    # the unpacked model as a model directory of its own (the tokenizer the builder unpacked)
    plain = tmp_path / "plain"
    plain.mkdir()
    tflite.rename(plain / "model.tflite")
    (unpacked / "Section1_SP_Tokenizer.spiece").rename(plain / "tokenizer.model")
    write_model_dir_metadata(
        plain,
        name="plain",
        version="1",
        context_length=KV,
        bos_id=BOS,
        eos_id=EOS,
        stop_token_ids=[EOS],
        chat_template="",
        variants=[("model.tflite", "int8")],
    )
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "xnnpack")})

    from_bundle = greedy(profile, bundle)
    from_file = greedy(profile, plain)
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    reference = reference_greedy(plain / "model.tflite", [BOS, *sp.encode(PROMPT)], 16, {EOS})
    assert from_bundle == from_file == reference
    assert len(set(reference)) > 1  # a degenerate model would prove nothing

    meta = open_model(bundle, tmp_path / "litertlm")
    (variant,) = meta.variants
    assert variant.sha256 == sha256(plain / "model.tflite")  # byte for byte what unpack gives
    assert (meta.directory / variant.file).read_bytes() == (plain / "model.tflite").read_bytes()
    assert meta.tokenizer_path.read_bytes() == (plain / "tokenizer.model").read_bytes()
    assert (meta.bos_id, meta.eos_id, meta.stop_token_ids) == (BOS, EOS, (EOS,))
    assert meta.context_length == KV and variant.quantization == "int8"
    # the engine extracted beside the profile's weight cache, where open_model looks
    assert (tmp_path / "litertlm" / variant.file).exists()


def test_extraction_happens_once_and_is_reused(
    bundle: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="agent.model"):
        first = open_model(bundle, cache)
    model = first.directory / first.variants[0].file
    stamp = model.stat().st_mtime_ns
    extracting = [r for r in caplog.records if "extracting" in r.getMessage()]
    ignored = [r for r in caplog.records if "sections not used" in r.getMessage()]
    assert len(extracting) == 1 and len(ignored) == 1
    for part in ("3 TFLiteModel", "embedder", "4 TFLiteModel", "npu", "5 GenericBinaryData"):
        assert part in ignored[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agent.model"):
        again = open_model(bundle, cache)
    assert again == first
    assert model.stat().st_mtime_ns == stamp
    assert not [r for r in caplog.records if "extracting" in r.getMessage()]
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]


def test_model_inspect_lists_every_section(bundle: Path, tiny_int8: Path) -> None:
    r = cli("model", "inspect", str(bundle), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    uses = [(s["type"], s["model_type"], s["backends"], s["use"]) for s in doc["sections"]]
    assert uses == [
        ("LlmMetadataProto", None, [], "metadata"),
        ("SP_Tokenizer", None, [], "tokenizer"),
        ("TFLiteModel", "prefill_decode", [], "model"),
        ("TFLiteModel", "embedder", [], "ignored"),
        ("TFLiteModel", "prefill_decode", ["npu"], "ignored"),
        ("GenericBinaryData", None, [], "ignored"),
    ]
    assert all(s["offset"] % (16 * 1024) == 0 for s in doc["sections"])
    assert doc["model"]["sha256"] == sha256(tiny_int8)
    assert doc["model"]["quantization"] == "int8"
    assert doc["model"]["llm"]["context_length"] == KV
    assert doc["llm_metadata"]["start_token"] == [BOS]
    assert doc["llm_metadata"]["stop_tokens"] == [[EOS]]
    text = cli("model", "inspect", str(bundle))
    assert text.returncode == 0, text.stderr
    assert "embedder" in text.stdout and "ignored" in text.stdout


def _truncated(data: bytes) -> bytes:
    return data[: len(data) - 40_000]


def _garbled_header(data: bytes) -> bytes:
    rng = np.random.default_rng(7)
    noise = rng.integers(0, 256, 400, dtype=np.uint8).tobytes()
    return data[:40] + noise + data[440:]


def _future_version(data: bytes) -> bytes:
    return data[:8] + (9).to_bytes(4, "little") + data[12:]


def _no_magic(data: bytes) -> bytes:
    return b"NOTLITE!" + data[8:]


def _model_not_tflite(data: bytes) -> bytes:
    at = data.find(b"TFL3", 16 * 1024)  # the model section's flatbuffer identifier
    assert at > 0 and at % (16 * 1024) == 4
    return data[:at] + b"XXXX" + data[at + 4 :]


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_truncated, "truncated .litertlm: section"),
        (_garbled_header, "corrupt .litertlm header"),
        (_future_version, "format 9.7.0 is not supported"),
        (_no_magic, "not a .litertlm file"),
        (_model_not_tflite, "is not a TFLite flatbuffer"),
        (lambda d: d[:20], "not a .litertlm file"),
    ],
    ids=["truncated", "garbled-header", "future-version", "no-magic", "model-not-tflite", "stub"],
)
def test_a_broken_bundle_is_one_clear_error(
    tmp_path: Path,
    tiny_int8: Path,
    tiny_tokenizer: Path,
    damage: Callable[[bytes], bytes],
    says: str,
) -> None:
    good = build_bundle(tmp_path / "good.litertlm", tiny_int8, sp_tokenizer=tiny_tokenizer)
    bad = tmp_path / "bad.litertlm"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(ModelFormatError) as err:
        open_model(bad, tmp_path / "cache")
    assert str(bad) in str(err.value) and says in str(err.value)
    assert not list((tmp_path / "cache").glob("*.tflite"))  # nothing extracted from it
    args = ("--profile", "generic-x86_64", "--max-tokens", "2")
    r = cli("generate", "x", "--model", str(bad), *args, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and str(bad) in lines[0]


def test_missing_sections_are_named(tmp_path: Path, tiny_int8: Path, tiny_tokenizer: Path) -> None:
    no_tok = build_bundle(tmp_path / "no-tok.litertlm", tiny_int8)
    with pytest.raises(ModelFormatError, match="has no tokenizer section"):
        open_model(no_tok, tmp_path / "c")
    npu = build_bundle(
        tmp_path / "npu.litertlm", tiny_int8, sp_tokenizer=tiny_tokenizer, backend="npu"
    )
    with pytest.raises(ModelFormatError, match="no prefill_decode TFLiteModel section"):
        open_model(npu, tmp_path / "c")


def test_metadata_templates_tokens_and_sampler(
    tmp_path: Path, tiny_int8: Path, tiny_tokenizer: Path
) -> None:
    """Prefix/suffix templates render (in jinja2, as transformers configures it) to exactly
    the affixes around each message; token texts resolve through the bundle's tokenizer;
    sampler parameters become the model's generation defaults."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from litert_lm_builder.runtime.proto import sampler_params_pb2

    affixes = {
        "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
        "model": ("<start_of_turn>model\n", '<end_of_turn>\n{{ "x" }} \\ é😀'),
        "system": ("{% raw %}sys: ", "\n\n"),
    }

    def md(m: Any) -> None:
        for role, (pre, suf) in affixes.items():
            getattr(m.prompt_templates, role).prefix = pre
            getattr(m.prompt_templates, role).suffix = suf
        m.stop_tokens.add().token_str = "</s>"  # a text: the SentencePiece piece of id 2
        m.sampler_params.type = sampler_params_pb2.SamplerParameters.TOP_P
        m.sampler_params.k = 40
        m.sampler_params.p = 0.95
        m.sampler_params.temperature = 0.7

    b = build_bundle(tmp_path / "t.litertlm", tiny_int8, sp_tokenizer=tiny_tokenizer, metadata=md)
    meta = open_model(b, tmp_path / "c")
    assert meta.generation == (("temperature", 0.7), ("top_k", 40.0), ("top_p", 0.95))
    assert meta.stop_token_ids == (EOS,)  # [2] and "</s>" are the same token
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi {{ there }}"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    got = env.from_string(meta.chat_template).render(
        messages=messages, add_generation_prompt=True, bos_token="<s>"
    )
    role = {"system": "system", "user": "user", "assistant": "model"}
    want = (
        "<s>"  # LiteRT-LM starts the first turn with the start token
        + "".join(
            affixes[role[m["role"]]][0] + m["content"] + affixes[role[m["role"]]][1]
            for m in messages
        )
        + affixes["model"][0]
    )
    assert got == want

    jinja = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    b2 = build_bundle(
        tmp_path / "j.litertlm",
        tiny_int8,
        sp_tokenizer=tiny_tokenizer,
        metadata=lambda m: setattr(m, "jinja_prompt_template", jinja),
    )
    assert open_model(b2, tmp_path / "c").chat_template == jinja


def test_hf_tokenizer_bundle(tmp_path: Path, tiny_int8: Path, make_profile: Any) -> None:
    """A zlib-compressed tokenizer.json comes back byte for byte; stop tokens given as text
    resolve to the ids Hugging Face tokenizers gives them."""
    from tokenizers import Tokenizer

    from tests.unit.modelimport.test_model_import import make_hf_tokenizer

    tok = make_hf_tokenizer(tmp_path / "tokenizer.json")
    ref = Tokenizer.from_file(str(tok))

    def md(m: Any) -> None:
        del m.stop_tokens[:]
        m.start_token.token_str = "<|endoftext|>"
        m.stop_tokens.add().token_str = "<|im_end|>"
        m.stop_tokens.add().token_ids.ids.extend([5, 6])  # a sequence: cannot stop by id

    b = build_bundle(tmp_path / "hf.litertlm", tiny_int8, hf_tokenizer=tok, metadata=md)
    meta = open_model(b, tmp_path / "c")
    assert meta.tokenizer_path.name == "tokenizer.json"
    assert meta.tokenizer_path.read_bytes() == tok.read_bytes()
    assert meta.bos_id == ref.token_to_id("<|endoftext|>")
    assert meta.stop_token_ids == (ref.token_to_id("<|im_end|>"),)
    assert meta.eos_id == ref.token_to_id("<|im_end|>")
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "xnnpack")})
    ids = [meta.bos_id, *ref.encode(PROMPT).ids]
    want = reference_greedy(tiny_int8, ids, 12, set(meta.stop_ids), ref.get_vocab_size())
    assert greedy(profile, b, 12) == want and len(set(want)) > 1


def test_the_daemon_serves_a_bundle_as_given(
    bundle: Path, tiny_tokenizer: Path, tmp_path: Path
) -> None:
    """`edge-agent run --model X.litertlm`: real gRPC over a unix socket; the bundle is
    extracted beside the daemon's weight cache in its state directory."""
    import sentencepiece as spm

    from agent.api.grpc.client import build_request
    from tests.support.daemon_harness import Daemon

    d = Daemon(tmp_path, bundle)
    try:
        c = d.client()
        info = c.info()
        assert info["name"] == "tiny-int8" and info["quantization"] == "int8"
        request = build_request(
            PROMPT,
            None,
            max_tokens=12,
            temperature=0.0,
            top_k=None,
            top_p=None,
            seed=None,
            stop=[],
        )
        got = list(c.generate(request).tokens)
    finally:
        assert d.stop() == 0
    unpacked = unpack(bundle, tmp_path / "unpacked")
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    tflite = unpacked / "Section2_TFLiteModel_tf_lite_prefill_decode.tflite"
    assert got == reference_greedy(tflite, [BOS, *sp.encode(PROMPT)], 12, {EOS})
    assert (tmp_path / "state" / "cache" / "litertlm" / f"{sha256(tflite)}.tflite").exists()


def test_a_replaced_bundle_leaves_no_copy_behind(
    tmp_path: Path, tiny_int8: Path, tiny_model_factory: Any, tiny_tokenizer: Path
) -> None:
    import os

    fp32 = Path(tiny_model_factory(prefill_lens=(8, 32), kv_max=KV))
    cache = tmp_path / "cache"
    path = tmp_path / "m.litertlm"
    first = open_model(build_bundle(path, tiny_int8, sp_tokenizer=tiny_tokenizer), cache)
    old = cache / first.variants[0].file
    os.utime(old, (1, 1))  # older than the window a concurrent extraction is given
    other = open_model(
        build_bundle(tmp_path / "other.litertlm", fp32, sp_tokenizer=tiny_tokenizer), cache
    )
    assert old.exists()  # its bundle is still there, unchanged
    path.unlink()
    second = open_model(build_bundle(path, fp32, sp_tokenizer=tiny_tokenizer), cache)
    assert second.variants[0].sha256 == other.variants[0].sha256 == sha256(fp32)
    assert not old.exists()
    assert sorted(p.name for p in cache.glob("*.tflite")) == [f"{sha256(fp32)}.tflite"]
    # a changed extracted file is extracted again, not trusted
    again = cache / second.variants[0].file
    again.write_bytes(b"damaged")
    assert open_model(path, cache) == second and sha256(again) == sha256(fp32)


def test_chat_with_a_bundles_prefix_suffix_template(
    tmp_path: Path, tiny_int8: Path, tiny_tokenizer: Path, make_profile: Any
) -> None:
    """A chat on a bundle with per-role affixes is BOS + the affixed turns + the model's prefix,
    as LiteRT-LM builds it; its greedy answer is the plain Interpreter loop's on those ids."""
    import sentencepiece as spm

    from agent.chat.types import ChatMessage

    def md(m: Any) -> None:
        m.prompt_templates.user.prefix = "user: "
        m.prompt_templates.user.suffix = "\n"
        m.prompt_templates.model.prefix = "def "
        m.prompt_templates.system.prefix = "# "
        m.prompt_templates.system.suffix = "\n"

    b = build_bundle(tmp_path / "c.litertlm", tiny_int8, sp_tokenizer=tiny_tokenizer, metadata=md)
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "xnnpack")})
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    want_ids = [BOS, *sp.encode("# be short\nuser: return 1\ndef ")]
    engine = Engine.load(profile, b)
    try:
        request = GenerateRequest(
            prompt="",
            messages=(ChatMessage("system", "be short"), ChatMessage("user", "return 1")),
            max_tokens=10,
            sampling=SamplingParams(temperature=0.0),
        )
        assert engine.encode_prompt(request) == want_ids
        got = list(engine.complete(request).token_ids)
    finally:
        engine.close()
    assert got == reference_greedy(tiny_int8, want_ids, 10, {EOS})


def test_a_kv_shape_of_either_layout_is_told_by_max_tokens_or_refused(
    tmp_path: Path, tiny_model_factory: Any, tiny_tokenizer: Path, make_profile: Any
) -> None:
    """Transposed KV of length 32 with head_dim 32 is K = V = [1, 1, 32, 32], which the default
    layout with one row would also be: a bundle's max tokens tells which; a folder without a
    mask input or a hint is refused rather than guessed."""
    import sentencepiece as spm

    from agent.modelimport import import_model

    square = Path(tiny_model_factory(prefill_lens=(8,), kv_max=32))
    b = build_bundle(
        tmp_path / "sq.litertlm",
        square,
        sp_tokenizer=tiny_tokenizer,
        metadata=lambda m: setattr(m, "max_num_tokens", 32),
    )
    meta = open_model(b, tmp_path / "c")
    assert meta.context_length == 32
    profile = make_profile(runtime={"xnnpack_weight_cache_dir": str(tmp_path / "xnnpack")})
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    want = reference_greedy(square, [BOS, *sp.encode(PROMPT)], 8, {EOS})
    assert greedy(profile, b, 8) == want and len(set(want)) > 1

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "m.tflite").write_bytes(square.read_bytes())
    (folder / "tokenizer.model").write_bytes(tiny_tokenizer.read_bytes())
    with pytest.raises(ModelFormatError, match="nothing in the model tells which"):
        import_model(folder, tmp_path / "out")


def test_generate_cli_runs_a_bundle(
    bundle: Path, tiny_int8: Path, tiny_tokenizer: Path, tmp_path: Path
) -> None:
    """`edge-agent generate --model X.litertlm` (a real subprocess; a profile without a weight
    cache extracts into $XDG_CACHE_HOME/edge-agent/litertlm)."""
    import sentencepiece as spm

    args = ("--profile", "generic-x86_64", "--max-tokens", "10", "--temperature", "0", "--json")
    r = cli(
        "generate",
        PROMPT,
        "--model",
        str(bundle),
        *args,
        env={"XDG_CACHE_HOME": str(tmp_path / "xdg")},
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["model"] == {"name": "tiny-int8", "quantization": "int8"}
    sp = spm.SentencePieceProcessor(model_file=str(tiny_tokenizer))
    assert doc["tokens"] == reference_greedy(tiny_int8, [BOS, *sp.encode(PROMPT)], 10, {EOS})
    assert (tmp_path / "xdg" / "edge-agent" / "litertlm" / f"{sha256(tiny_int8)}.tflite").exists()
