"""Tiny random-weight models of real families, built with litert-torch's official example
builders and converted the way litert-community files are made.

Each family's own config function (``litert_torch.generative.examples.<family>``) gives the real
`ModelConfig`; `shrink` keeps everything that makes the family what it is (norms and their
zero-centred gammas, QK-norm, soft-capping, sliding-window + global layers, partial rotary,
parallel residual, biases, tied or untied heads, its RoPE function) and makes it small: 2 layers,
width 128, 4 query heads of 32, FFN 256, vocab 256 (the tests' SentencePiece tokenizer), with
`kv_heads` KV heads (``num_query_groups``). Every quantized reduction dimension is a multiple
of 32, so block-32 int4 applies to every weight.

The family's model class is instantiated with a mask cache as its ``convert_*.py`` script does
(``mask_cache_size = kv_cache_max_len``, or a ``mask`` input where the script's default is
``mask_as_input``), weights are set from a seeded generator (every parameter, so LayerNorm's
``torch.empty`` weights never leak in), and `converter.convert_to_tflite` converts it with
composites on (``enable_hlfb``, the config default) and ``quantize="none"``; the int8 and
int4-block-32 variants are derived from that float file with `agent.toolchain.quantize`
(`full_dynamic_recipe` translated to ai-edge-quantizer: what ``quantize="dynamic_int8"`` /
``"dynamic_int4_block32"`` run inside the converter).

Files are cached under ``$EDGE_AGENT_TINY_CACHE/families-<fingerprint>/`` (a per-session temp
dir without it), keyed by family, layout and KV heads; the fingerprint covers this file, the
quantize path and the toolchain versions. ``python -m tests.support.families`` builds the whole
matrix,
two processes at a time (scripts/test runs it before pytest).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import toolchain  # noqa: F401  (installs the tensorflow shim litert-torch needs)
from tests.support.paths import ROOT

EXAMPLES = "litert_torch.generative.examples"

LAYOUTS = ("default", "transposed")
KV_HEADS = (1, 2)
QUANTIZATIONS = ("int8", "int4_block32")
KV_MAX = 512  # auto_windows(512) == (256,): the prepared copy gets a KV window
PREFILL = (8,)
VOCAB = 256
WIDTH = 128
HEADS = 4
HEAD_DIM = 32
FFN = 256
SLIDING_WINDOW = 16  # gemma3's local layers: far shorter than a conversation, so it matters
SEED = 0


@dataclass(frozen=True, slots=True)
class Family:
    """One family as its official example builds it."""

    name: str
    module: str  # under litert_torch.generative.examples
    config: str  # the module's function returning the real ModelConfig
    model_class: str  # the module's nn.Module class
    mask_as_input: bool  # the default of the family's convert script
    layers: tuple[int, ...] = (0, 1)  # which of the real per-layer block configs to keep
    ffn: int = FFN
    note: str = ""

    @property
    def key(self) -> str:
        """Names this entry's files: editing one family rebuilds only that family."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:8]


FAMILIES: tuple[Family, ...] = (
    Family(
        "gemma3",
        "gemma3.decoder",
        "get_decoder_config_1b",
        "Decoder",
        True,
        layers=(0, 5),
        note="a local sliding-window layer and a global one (rope base 1e6), QK-norm",
    ),
    Family(
        "gemma2",
        "gemma.gemma2",
        "get_model_config_2b",
        "Gemma2",
        True,
        note="attention soft-cap 50, final soft-cap 30, local + global layer",
    ),
    Family("gemma1", "gemma.gemma1", "get_model_config_2b", "Gemma1", False),
    Family("qwen2.5", "qwen.qwen", "get_0_5b_model_config", "Qwen", False, note="qkv bias"),
    Family("qwen3", "qwen.qwen3", "get_0_6b_model_config", "Qwen3", False, note="QK-norm"),
    Family("llama3.2", "llama.llama", "get_1b_model_config", "Llama", False, note="llama3 rope"),
    Family("smollm2", "smollm.smollm", "get_model_config_v2", "SmolLM2", False),
    Family(
        "phi2",
        "phi.phi2",
        "get_model_config",
        "Phi2",
        False,
        note="LayerNorm, partial rotary 0.4, parallel residual, biases, untied head",
    ),
    Family(
        "phi4-mini",
        "phi.phi4",
        "get_model_config",
        "Phi4Mini",
        False,
        # its SILU_GLU FFN projects to twice the intermediate size: 2 x 256 would equal the KV
        # length, and the KV-window rewrite refuses a weight with that dimension (ambiguous)
        ffn=192,
        note="rotary 0.75, phi4 RoPE factors, fused gate/up (SILU_GLU)",
    ),
    Family("tinyllama", "tiny_llama.tiny_llama", "get_model_config", "TinyLlama", False),
    Family(
        "deepseek-r1-distill-qwen",
        "deepseek.deepseek",
        "get_model_config",
        "DeepSeekDistillQwen",
        True,
    ),
)
BY_NAME = {f.name: f for f in FAMILIES}


@dataclass(frozen=True, slots=True)
class Combo:
    """One float conversion of the matrix; its quantized variants are derived from it."""

    family: str
    layout: str
    kv_heads: int

    @property
    def stem(self) -> str:
        return f"{self.family}_{BY_NAME[self.family].key}_{self.layout[0]}_kv{self.kv_heads}"

    @property
    def id(self) -> str:
        return f"{self.family}-{self.layout}-kv{self.kv_heads}"


COMBOS: tuple[Combo, ...] = tuple(
    Combo(f.name, layout, heads) for f in FAMILIES for layout in LAYOUTS for heads in KV_HEADS
)


def _versions() -> str:
    names = ("torch", "litert-torch", "ai-edge-litert", "ai-edge-quantizer", "litert-converter")
    out = []
    for name in names:
        try:
            out.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name}=-")
    return ",".join(out)


def fingerprint() -> str:
    """What the cached files depend on beside their family's entry (`Family.key`): the
    matrix's sizes, the code that builds and quantizes them (not this module's test helpers
    or docs), the toolchain's versions."""
    import inspect

    h = hashlib.sha256()
    sizes = (KV_MAX, PREFILL, VOCAB, WIDTH, HEADS, HEAD_DIM, FFN, SLIDING_WINDOW, SEED)
    scales = (EMBEDDING_STD, LINEAR_GAIN, sorted(NORM_OFFSETS.items()))
    h.update(repr((sizes, scales, QUANTIZATIONS)).encode())  # the families: in their file names
    for fn in (shrink, init_weights, build_torch_model, export_config, convert):
        h.update(inspect.getsource(fn).encode())
    h.update(inspect.getsource(FamilyFactory).encode())
    h.update((ROOT / "agent" / "toolchain" / "quantize.py").read_bytes())
    h.update(_versions().encode())
    return h.hexdigest()[:12]


def cache_root() -> Path | None:
    cache = os.environ.get("EDGE_AGENT_TINY_CACHE")
    return Path(cache).expanduser() / f"families-{fingerprint()}" if cache else None


# ------------------------------------------------------------------------------ building


def _example(family: Family) -> Any:
    return importlib.import_module(f"{EXAMPLES}.{family.module}")


def shrink(family: Family, kv_heads: int) -> Any:
    """The family's real `ModelConfig`, made tiny (see the module docstring)."""
    module = _example(family)
    config = getattr(module, family.config)()
    config.vocab_size = VOCAB
    config.num_layers = 2
    config.max_seq_len = KV_MAX
    config.embedding_dim = WIDTH
    if config.embedding_scale is not None:  # gemma: sqrt(width), recomputed for the new width
        config.embedding_scale = WIDTH**0.5
    if isinstance(config.block_configs, list | tuple):
        config.block_configs = [config.block_configs[i] for i in family.layers]
        blocks = config.block_configs
    else:
        blocks = [config.block_configs]
    for block in blocks:
        attn = block.attn_config
        attn.num_heads = HEADS
        attn.head_dim = HEAD_DIM
        attn.num_query_groups = kv_heads
        if attn.sliding_window_size is not None and family.name == "gemma3":
            attn.sliding_window_size = SLIDING_WINDOW
        block.ff_config.intermediate_size = family.ffn
    build_rope = config.build_rope
    if isinstance(build_rope, functools.partial) and "theta_factors" in build_rope.keywords:
        # phi4's RoPE divides theta by one factor per rotary pair of the real head (48 for
        # 0.75 x 128); the tiny head has fewer pairs: keep every k-th factor, spanning the range.
        attn = blocks[0].attn_config
        pairs = int(attn.rotary_percentage * attn.head_dim) // 2
        factors = build_rope.keywords["theta_factors"]
        step = len(factors) // pairs
        config.build_rope = functools.partial(
            build_rope.func, **{**build_rope.keywords, "theta_factors": factors[::step][:pairs]}
        )
    return config


# Random weights, scaled so that a tiny random model's greedy tokens depend on its context
# (measured on the float torch models: without these, every tied-head family repeated one id
# or its input token): linear layers at twice the unit-variance scale, so the blocks outweigh
# the (tied, gemma: sqrt(width)-scaled) embedding in the residual; gemma's post-attention and
# post-FFN norms with gamma ~17 for the same reason; QK-norm gammas ~5 so that attention over
# normalised queries and keys is not a flat average.
EMBEDDING_STD = 0.25
LINEAR_GAIN = 2.0
NORM_OFFSETS = {"post_atten_norm": 16.0, "post_ff_norm": 16.0, "query_norm": 4.0, "key_norm": 4.0}


def init_weights(model: Any, seed: int) -> None:
    """Set every parameter from a seeded generator (see `LINEAR_GAIN` for the scales); norms
    are near their family's identity plus `NORM_OFFSETS`, never left as ``torch.empty``."""
    import torch
    from litert_torch.generative.layers import normalization

    g = torch.Generator().manual_seed(seed)
    done: set[int] = set()  # storage addresses: a tied head shares the embedding's

    def normal(p: torch.Tensor, mean: float, std: float) -> None:
        if p.data_ptr() in done:
            return
        with torch.no_grad():
            p.copy_(mean + std * torch.randn(p.shape, generator=g))
        done.add(p.data_ptr())

    for name, module in model.named_modules():
        offset = NORM_OFFSETS.get(name.rsplit(".", 1)[-1], 0.0)
        if isinstance(module, torch.nn.Embedding):
            normal(module.weight, 0.0, EMBEDDING_STD)
        elif isinstance(module, torch.nn.Linear):
            normal(module.weight, 0.0, LINEAR_GAIN * module.weight.shape[1] ** -0.5)
            if module.bias is not None:
                normal(module.bias, 0.0, 0.1)
        elif isinstance(module, normalization.RMSNorm):
            base = 0.0 if module.zero_centered_gamma else 1.0
            normal(module.weight, base + offset, 0.1)
            if module.with_scale:
                normal(module.scale, 0.0, 0.1)
        elif isinstance(module, normalization.LayerNorm | normalization.GroupNorm):
            normal(module.weight, 1.0 + offset, 0.1)  # torch.empty in litert-torch
            if getattr(module, "bias", None) is not None:
                normal(module.bias, 0.0, 0.1)
    left = [n for n, p in model.named_parameters() if p.data_ptr() not in done]
    if left:
        raise RuntimeError(f"parameters without an initialisation: {left}")
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"non-finite parameters: {bad}")


def build_torch_model(family: Family, kv_heads: int, seed: int = SEED) -> Any:
    """The family's model class on the shrunk config, with seeded weights, in eval mode."""
    config = shrink(family, kv_heads)
    cls = getattr(_example(family), family.model_class)
    model = cls(config, 0 if family.mask_as_input else KV_MAX)
    init_weights(model, seed)
    return model.eval()


def export_config(family: Family, layout: str) -> Any:
    from litert_torch.generative.layers import kv_cache as kv_utils
    from litert_torch.generative.utilities import export_config as export_config_lib

    ec = export_config_lib.ExportConfig()
    ec.kvcache_layout = (
        kv_utils.KV_LAYOUT_TRANSPOSED if layout == "transposed" else kv_utils.KV_LAYOUT_DEFAULT
    )
    ec.mask_as_input = family.mask_as_input
    return ec


def convert(combo: Combo, out: Path) -> float:
    """Convert `combo` to a float `.tflite` at `out`; returns the seconds it took."""
    import torch
    from litert_torch.generative.utilities import converter

    family = BY_NAME[combo.family]
    model = build_torch_model(family, combo.kv_heads)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".convert-") as tmp:
        made = converter.convert_to_tflite(
            model,
            output_path=tmp,
            output_name_prefix=combo.stem,
            prefill_seq_len=list(PREFILL),
            kv_cache_max_len=KV_MAX,
            quantize="none",
            export_config=export_config(family, combo.layout),
        )
        os.replace(made, out)
    torch._dynamo.reset()  # each conversion traces a new model; do not let the caches pile up
    return time.monotonic() - t0


# litert-torch's own quantizing conversion of one combo: the derived variants must be these
# files byte for byte (measured: they are), i.e. what the examples' convert scripts write
# with their default ``--quantize=dynamic_int8`` (or ``dynamic_int4_block32``).
CONVERTER_RECIPES = {"int8": "dynamic_int8", "int4_block32": "dynamic_int4_block32"}
CONVERTER_CHECK = Combo("qwen3", "transposed", 2)


def convert_quantized(combo: Combo, quantization: str, out: Path) -> float:
    """`combo` converted with ``quantize=CONVERTER_RECIPES[quantization]``; returns seconds."""
    import torch
    from litert_torch.generative.utilities import converter

    family = BY_NAME[combo.family]
    model = build_torch_model(family, combo.kv_heads)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".convert-") as tmp:
        made = converter.convert_to_tflite(
            model,
            output_path=tmp,
            output_name_prefix=combo.stem,
            prefill_seq_len=list(PREFILL),
            kv_cache_max_len=KV_MAX,
            quantize=CONVERTER_RECIPES[quantization],
            export_config=export_config(family, combo.layout),
        )
        os.replace(made, out)
    torch._dynamo.reset()
    return time.monotonic() - t0


class FamilyFactory:
    """Builds and caches the matrix's files and model directories under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, combo: Combo, quantization: str) -> Path:
        return self.root / f"{combo.stem}_{quantization}.tflite"

    def __call__(self, combo: Combo, quantization: str = "fp32") -> Path:
        """The combo's `.tflite` in `quantization` (fp32, int8, int4_block32), built once."""
        target = self.path(combo, quantization)
        if target.exists():
            return target
        fp32 = self.path(combo, "fp32")
        if not fp32.exists():
            seconds = convert(combo, fp32)
            print(f"[families] converted {fp32.name} in {seconds:.1f}s", flush=True)
        if quantization != "fp32":
            from agent.toolchain.quantize import quantize_file

            tmp = target.with_name(f".{target.name}.{os.getpid()}")
            quantize_file(fp32, tmp, quantization)
            os.replace(tmp, target)
        return target

    def converter_quantized(self, combo: Combo, quantization: str) -> Path:
        """`convert_quantized`'s file, built once (named after that function's source)."""
        import inspect

        key = hashlib.sha256(inspect.getsource(convert_quantized).encode()).hexdigest()[:8]
        target = self.root / f"{combo.stem}_converter-{key}_{quantization}.tflite"
        if not target.exists():
            tmp = target.with_name(f".{target.name}.{os.getpid()}")
            seconds = convert_quantized(combo, quantization, tmp)
            os.replace(tmp, target)
            print(f"[families] converted {target.name} in {seconds:.1f}s", flush=True)
        return target

    def tokenizer(self) -> Path:
        from tests.support.tiny_models import TinyModelFactory

        return TinyModelFactory(self.root / "tokenizer").tokenizer()

    def model_dir(self, combo: Combo, quantizations: Sequence[str] = QUANTIZATIONS) -> Path:
        """A model directory with the combo's variants and the tiny SentencePiece tokenizer.
        No eos or stop ids: a generation runs to its max_tokens, so every token is compared."""
        from agent.model.directory import write_model_dir_metadata
        from agent.toolchain.tokenizer import BOS_ID

        d = self.root / f"dir_{combo.stem}_{'-'.join(quantizations)}"
        if (d / "metadata.json").exists():
            return d
        files = [(f"model_{q}.tflite", q, self(combo, q)) for q in quantizations]
        tok = self.tokenizer()
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{d.name}-"))
        for name, _q, src in files:
            shutil.copyfile(src, tmp / name)
        shutil.copyfile(tok, tmp / "tokenizer.model")
        write_model_dir_metadata(
            tmp,
            name=f"tiny-{combo.family}",
            version="0.0.1",
            context_length=KV_MAX,
            bos_id=BOS_ID,
            eos_id=None,
            stop_token_ids=[],
            chat_template="{system}\n{user}\n",
            variants=[(name, q) for name, q, _ in files],
        )
        try:
            os.replace(tmp, d)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
        return d


# ------------------------------------------------------------------- verify signatures

#: speculative decoding's verify signatures (`agent.toolchain.export.add_verify_signatures`):
#: one combo per family (transposed KV, two KV heads) gets them, in a separate conversion
VERIFY = (4,)
VERIFY_COMBOS: tuple[Combo, ...] = tuple(Combo(f.name, "transposed", 2) for f in FAMILIES)


def convert_verify(combo: Combo, out: Path) -> float:
    """`convert`, plus ``verify_<N>`` for N in `VERIFY` in the same converter (the signatures
    share the weights); returns the seconds it took."""
    import torch
    from litert_torch._convert import interface as converter_utils
    from litert_torch.generative.utilities import converter

    from agent.toolchain.export import add_verify_signatures

    family = BY_NAME[combo.family]
    model = build_torch_model(family, combo.kv_heads)
    ec = export_config(family, combo.layout)
    t0 = time.monotonic()
    torch._dynamo.config.cache_size_limit = 64  # as convert_to_tflite sets it
    conv = converter_utils.Converter()
    # a private helper of the pinned litert-torch, as agent.toolchain.export uses it
    converter._add_signatures(conv, model, list(PREFILL), KV_MAX, None, 0, model.config, [None], ec)
    add_verify_signatures(conv, model, ec, VERIFY, KV_MAX)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    conv.convert(quant_config=converter.get_quant_recipe_from_flag("none", model.config)).export(
        str(tmp)
    )
    os.replace(tmp, out)
    torch._dynamo.reset()
    return time.monotonic() - t0


class VerifyFamilyFactory(FamilyFactory):
    """`FamilyFactory` for the files with verify signatures, in a directory of their own
    (under the matrix's root, named after the code that converts them)."""

    def __init__(self, root: Path) -> None:
        import inspect

        from agent.toolchain import export

        h = hashlib.sha256(inspect.getsource(convert_verify).encode())
        h.update(inspect.getsource(export.add_verify_signatures).encode())
        h.update(repr(VERIFY).encode())
        super().__init__(Path(root) / f"verify-{h.hexdigest()[:8]}")

    def __call__(self, combo: Combo, quantization: str = "fp32") -> Path:
        fp32 = self.path(combo, "fp32")
        if not fp32.exists():
            seconds = convert_verify(combo, fp32)
            print(f"[families] converted {fp32.name} (verify) in {seconds:.1f}s", flush=True)
        return super().__call__(combo, quantization)


def _build_one(root: Path, combo: Combo, verify: bool = False) -> str:
    factory = (VerifyFamilyFactory if verify else FamilyFactory)(root)
    t0 = time.monotonic()
    for q in ("fp32", *QUANTIZATIONS):
        factory(combo, q)
    return f"{combo.id}{' (verify)' if verify else ''} ready in {time.monotonic() - t0:.1f}s"


def _build_converter_check(root: Path, quantization: str) -> str:
    t0 = time.monotonic()
    FamilyFactory(root).converter_quantized(CONVERTER_CHECK, quantization)
    recipe = CONVERTER_RECIPES[quantization]
    return f"{CONVERTER_CHECK.id} quantize={recipe} ready in {time.monotonic() - t0:.1f}s"


def prebuild(
    root: Path, jobs: int, combos: Sequence[Combo] = COMBOS, converter_check: bool = True
) -> None:
    """Build `combos` (and the converter check's two files) into `root`, `jobs` processes at a
    time (spawned: torch is not fork-safe)."""
    import multiprocessing
    from concurrent.futures import Future, ProcessPoolExecutor

    factory = FamilyFactory(root)
    factory.tokenizer()
    wanted = ("fp32", *QUANTIZATIONS)
    todo = [c for c in combos if not all(factory.path(c, q).exists() for q in wanted)]
    spawn = multiprocessing.get_context("spawn")
    t0 = time.monotonic()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=spawn) as pool:
        futures: list[Future[str]] = []
        if converter_check:
            futures += [pool.submit(_build_converter_check, root, q) for q in QUANTIZATIONS]
        futures += [pool.submit(_build_one, root, c) for c in todo]
        verify = VerifyFamilyFactory(root)
        futures += [
            pool.submit(_build_one, root, c, True)
            for c in VERIFY_COMBOS
            if c in combos and not all(verify.path(c, q).exists() for q in wanted)
        ]
        for f in futures:
            print("[families]", f.result(), flush=True)
    print(f"[families] {len(futures)} builds in {time.monotonic() - t0:.0f}s", flush=True)


def _main(argv: Sequence[str]) -> None:
    target = cache_root()
    if target is None:
        raise SystemExit("set EDGE_AGENT_TINY_CACHE to the directory the tests will use")
    names = set(argv)
    combos = [c for c in COMBOS if not names or c.family in names or c.id in names]
    prebuild(target, max(1, min(len(os.sched_getaffinity(0)), 2)), combos, not names)


if __name__ == "__main__":  # python -m tests.support.families [FAMILY|COMBO-ID ...]
    _main(sys.argv[1:])


__all__: Sequence[str] = (
    "COMBOS",
    "FAMILIES",
    "VERIFY_COMBOS",
    "Combo",
    "Family",
    "FamilyFactory",
    "VerifyFamilyFactory",
    "cache_root",
)
