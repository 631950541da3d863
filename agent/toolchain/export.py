"""Build litert-torch decoders and convert them to edge-agent's `.tflite` format.

The output is what litert-torch's generative converter writes: one file with
``prefill_<N>`` signatures (one per prefill length) and a ``decode`` signature; inputs
``tokens`` [1,N] int32, ``input_pos`` [N] int32, optionally ``mask`` [1,1,N,kv_max] float32,
and the externalized KV cache ``kv_cache_k_<i>`` / ``kv_cache_v_<i>`` (float32, in and out).
``decode`` also outputs ``logits`` [1,1,vocab].

Verify signatures (``verify_lens``): ``verify_<N>`` is a prefill-shaped signature of N tokens
that also outputs ``logits`` [1, N, vocab], one row per position (litert-torch's
``output_logits_on_prefill`` switch, on that signature only), with the KV rows written in place
as prefill writes them: what speculative decoding checks N-1 drafted tokens with in one pass
over the weights (the shape LiteRT-LM's multi-token-prediction path asks of a base model).
With KV windows each window gets ``kv<L>_verify_<N>`` too.

Batched decode (``batch_sizes``, off by default so existing files stay byte-identical):
``decode_batch_<B>`` runs one decode step for B sequences, each at its own position over its
own KV tensors (`agent.toolchain.batch` says why that shape); ``kv<L>_decode_batch_<B>`` in
each KV window.

KV layouts: ``default`` gives K and V [1, kv_max, kv_heads, head_dim]; ``transposed`` gives
K [1, kv_heads, kv_max, head_dim] and V [1, kv_heads, head_dim, kv_max] (the layout
LiteRT-LM expects, and faster).

KV windows (``decode_windows``): the same signatures again for shorter KV lengths L, named
``kv<L>_decode`` and ``kv<L>_prefill_<N>`` (prefill lengths below L), sharing the one set of
weights. Attention costs what the KV length is, so a short session decoded in a small window
reads far fewer KV bytes per token; the engine moves a session's rows up when it outgrows its
window. Readers that only know ``decode``/``prefill_<N>`` see an ordinary file.

One float conversion is done per call; quantized variants are produced from its bytes with
`agent.toolchain.quantize` (the same path litert-torch takes internally).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent import toolchain  # noqa: F401  (installs the tensorflow shim)
from agent.toolchain.batch import add_batch_signatures
from agent.toolchain.config import TINY_SPEC, DecoderSpec, to_model_config
from agent.toolchain.quantize import QUANTIZATIONS, check_block_divides, quantize_file

LAYOUTS = ("default", "transposed")


@dataclass(frozen=True)
class ExportOptions:
    """How to convert a decoder (not what it is: that is `DecoderSpec`)."""

    layout: str = "transposed"
    prefill_lens: tuple[int, ...] = (32, 128, 512)
    kv_max: int = 1024
    mask_as_input: bool = False
    enable_hlfb: bool = True
    output_logits_on_prefill: bool = False
    decode_windows: tuple[int, ...] = ()  # shorter KV lengths exported beside kv_max
    verify_lens: tuple[int, ...] = ()  # verify_<N> signatures: N tokens in, N logits rows out
    batch_sizes: tuple[int, ...] = ()  # decode_batch_<B>: B sequences decoded in one call

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}; allowed: {LAYOUTS}")
        if not self.prefill_lens:
            raise ValueError("at least one prefill length is needed")
        if any(n <= 0 or n > self.kv_max for n in self.prefill_lens):
            raise ValueError(
                f"prefill lengths {self.prefill_lens} must be in 1..kv_max ({self.kv_max})"
            )
        object.__setattr__(self, "prefill_lens", tuple(sorted(set(self.prefill_lens))))
        windows = tuple(sorted(set(self.decode_windows)))
        if any(w < 2 or w >= self.kv_max for w in windows):
            raise ValueError(f"decode windows {windows} must be in 2..kv_max-1 ({self.kv_max - 1})")
        object.__setattr__(self, "decode_windows", windows)
        verify = tuple(sorted(set(self.verify_lens)))
        # no longer than the shortest prefill: a verify call is a short prefill with logits
        if any(n < 2 or n > self.prefill_lens[0] for n in verify):
            raise ValueError(
                f"verify lengths {verify} must be in 2..{self.prefill_lens[0]} (at most the "
                "shortest prefill length)"
            )
        object.__setattr__(self, "verify_lens", verify)
        batch = tuple(sorted(set(self.batch_sizes)))
        if any(b < 2 or b > 16 for b in batch):
            raise ValueError(f"batch sizes {batch} must be in 2..16")
        object.__setattr__(self, "batch_sizes", batch)

    def window_prefill_lens(self, window: int) -> tuple[int, ...]:
        """The prefill lengths exported for one KV window: those shorter than it."""
        return tuple(n for n in self.prefill_lens if n < window)

    def tag(self) -> str:
        """A short, file-name-safe description (used by caches)."""
        p = "-".join(str(n) for n in self.prefill_lens)
        w = "".join(f"_w{n}" for n in self.decode_windows)
        v = "".join(f"_v{n}" for n in self.verify_lens)
        b = "".join(f"_b{n}" for n in self.batch_sizes)
        return (
            f"{self.layout[0]}_p{p}_kv{self.kv_max}_m{int(self.mask_as_input)}"
            f"_h{int(self.enable_hlfb)}_l{int(self.output_logits_on_prefill)}{w}{v}{b}"
        )


def _seed_everything(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _decoder_class():
    """`DecoderOnlyModel` with the causal mask computed in the graph.

    litert-torch's `DecoderOnlyModel` gathers the mask rows from a float32 [kv_max, kv_max]
    constant (``mask_cache``): 4 MiB at kv_max 1024, as much as all int8 weights of the demo
    model. Computing ``mask[t, j] = 0 if j <= input_pos[t] else -inf`` from ``input_pos``
    gives the same mask with a few elementwise ops and no constant. With ``mask_as_input``
    the caller's mask is used as before. Same parameters, same state dict.
    """
    import torch
    from litert_torch.generative.utilities import model_builder

    class EdgeDecoder(model_builder.DecoderOnlyModel):
        def forward(self, tokens, input_pos, kv_cache, mask=None, lora=None, export_config=None):
            if mask is None:
                kv_len = kv_cache.get_max_seq_len()
                cols = torch.arange(kv_len, dtype=input_pos.dtype)
                allowed = cols.unsqueeze(0) <= input_pos.unsqueeze(1)  # [T, kv_len]
                zero = torch.zeros((), dtype=torch.float32)
                blocked = torch.full((), self.config.causal_mask_value, dtype=torch.float32)
                mask = torch.where(allowed, zero, blocked).unsqueeze(0).unsqueeze(0)
            return super().forward(
                tokens, input_pos, kv_cache, mask=mask, lora=lora, export_config=export_config
            )

    return EdgeDecoder


def build_torch_model(
    spec: DecoderSpec,
    *,
    enable_hlfb: bool = True,
    kv_max: int = 1024,
    mask_as_input: bool = False,
    state_dict: Mapping[str, object] | None = None,
    seed: int | None = 0,
):
    """A litert-torch `DecoderOnlyModel` for `spec` (random weights unless `state_dict`).

    With ``mask_as_input=False`` the model computes its causal mask from ``input_pos``
    (see `_decoder_class`); with ``True`` the caller passes ``mask``.
    """
    import torch

    # Config and class first: their first use imports litert-torch modules, and an import
    # that draws from torch's RNG after the seed would make a fresh process build other
    # weights than one that had imported them already (seen: a process pool's first model).
    mcfg = to_model_config(spec, enable_hlfb=enable_hlfb, kv_max=kv_max)
    decoder = _decoder_class()
    if seed is not None:
        _seed_everything(seed)
    model = decoder(mcfg, mask_cache_size=0)
    if state_dict is None:
        # nn.Linear's default init gives near-uniform logits; a scaled normal init makes
        # random models produce distinguishable outputs (useful in tests).
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02 if "tok_embedding" in name else p.shape[1] ** -0.5)
    else:
        missing, unexpected = model.load_state_dict(dict(state_dict), strict=False)
        missing = [k for k in missing if "mask_cache" not in k]
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    return model.eval()


def _export_config(opts: ExportOptions):
    from litert_torch.generative.layers import kv_cache as kv_utils
    from litert_torch.generative.utilities import export_config as export_config_lib

    ec = export_config_lib.ExportConfig()
    ec.kvcache_layout = (
        kv_utils.KV_LAYOUT_TRANSPOSED if opts.layout == "transposed" else kv_utils.KV_LAYOUT_DEFAULT
    )
    ec.mask_as_input = opts.mask_as_input
    ec.output_logits_on_prefill = opts.output_logits_on_prefill
    return ec


def convert_fp32(model, spec: DecoderSpec, opts: ExportOptions, out_path: Path) -> Path:
    """Convert a torch decoder to a float32 `.tflite` at `out_path`."""
    from litert_torch.generative.utilities import converter

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(
        f"[toolchain] converting {spec.num_layers}x{spec.embedding_dim} decoder "
        f"({opts.layout} KV, kv_max {opts.kv_max}, prefill {list(opts.prefill_lens)}, "
        f"mask_as_input={opts.mask_as_input}, composites={opts.enable_hlfb}, "
        f"KV windows {list(opts.decode_windows)}, verify {list(opts.verify_lens)}, "
        f"batch {list(opts.batch_sizes)}) ...",
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".convert-") as tmp:
        if opts.decode_windows or opts.verify_lens or opts.batch_sizes:
            written = _convert_sets(model, opts, tmp)
        else:
            written = converter.convert_to_tflite(
                model,
                output_path=tmp,
                output_name_prefix="model",
                prefill_seq_len=list(opts.prefill_lens),
                kv_cache_max_len=opts.kv_max,
                quantize="none",
                config=model.config,
                export_config=_export_config(opts),
            )
        os.replace(written, out_path)
    print(
        f"[toolchain] converted {out_path.name}: {out_path.stat().st_size / 1e6:.2f} MB "
        f"in {time.monotonic() - t0:.1f}s",
        flush=True,
    )
    return out_path


def add_verify_signatures(
    conv, model, export_config, lengths: Sequence[int], kv_len: int, prefix: str = ""
) -> None:
    """Add ``<prefix>verify_<N>`` for each N in `lengths` to litert-torch converter `conv`:
    `model` traced like a prefill of N tokens over a KV cache of `kv_len` rows, with
    ``output_logits_on_prefill`` on for these signatures only (logits [1, N, vocab])."""
    import dataclasses

    import torch
    from litert_torch.generative.layers import kv_cache as kv_utils
    from litert_torch.generative.utilities import converter

    ec = dataclasses.replace(export_config, output_logits_on_prefill=True)
    mod = converter.ExportableModule(model, export_config=ec).eval()
    kv = kv_utils.KVCache.from_model_config(kv_len, model.config, kv_layout=ec.kvcache_layout)
    for n in lengths:
        sample = {
            "tokens": torch.zeros((1, n), dtype=torch.int),
            "input_pos": torch.arange(0, n, dtype=torch.int),
            "kv_cache": kv,
        }
        if ec.mask_as_input:
            # a private helper of the pinned litert-torch, as the prefill signatures use it
            sample["mask"] = converter._build_mask(n, kv_len, model.config.causal_mask_value)
        conv.add_signature(f"{prefix}verify_{n}", mod, sample_kwargs=sample)


def _convert_sets(model, opts: ExportOptions, tmp: str) -> str:
    """`converter.convert_to_tflite` with one more set of signatures per KV window, and the
    verify and batched decode signatures of each set.

    One converter, one module: the signatures share the weights in the written file.
    """
    import torch
    from litert_torch._convert import interface as converter_utils
    from litert_torch.generative.utilities import converter

    torch._dynamo.config.cache_size_limit = 64  # as convert_to_tflite sets it
    conv = converter_utils.Converter()
    ec = _export_config(opts)
    sets = [("", opts.prefill_lens, opts.kv_max)]
    sets += [(f"kv{w}_", opts.window_prefill_lens(w), w) for w in opts.decode_windows]
    for prefix, lens, kv_len in sets:
        # a private helper of the pinned litert-torch: it has no public per-set API
        converter._add_signatures(
            conv,
            model,
            list(lens),
            kv_len,
            None,
            0,
            model.config,
            [None],
            ec,
            signature_prefix=prefix,
        )
        add_verify_signatures(conv, model, ec, opts.verify_lens, kv_len, prefix)
        add_batch_signatures(conv, model, ec, opts.batch_sizes, kv_len, prefix)
    out = os.path.join(tmp, "model_sets.tflite")
    conv.convert(quant_config=converter.get_quant_recipe_from_flag("none", model.config)).export(
        out
    )
    return out


def variant_file_name(quantization: str, prefix: str = "model") -> str:
    return f"{prefix}_{quantization}.tflite"


def export_variants(
    spec: DecoderSpec,
    out_dir: Path,
    *,
    opts: ExportOptions,
    quantizations: Iterable[str] = ("int8",),
    state_dict: Mapping[str, object] | None = None,
    seed: int = 0,
    prefix: str = "model",
    keep_fp32: bool = True,
) -> dict[str, Path]:
    """Convert once to float and write every requested variant into `out_dir`.

    Returns ``{quantization: path}``. The float file is ``<prefix>_fp32.tflite``; it is
    removed at the end unless `keep_fp32` or ``"fp32"`` is among `quantizations`.
    """
    quants = list(dict.fromkeys(quantizations))
    for q in quants:
        if q not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {q!r}; allowed: {QUANTIZATIONS}")
        check_block_divides(spec, q)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_torch_model(
        spec,
        enable_hlfb=opts.enable_hlfb,
        kv_max=opts.kv_max,
        mask_as_input=opts.mask_as_input,
        state_dict=state_dict,
        seed=seed,
    )
    fp32 = convert_fp32(model, spec, opts, out_dir / variant_file_name("fp32", prefix))
    result: dict[str, Path] = {}
    for q in quants:
        if q == "fp32":
            result[q] = fp32
        else:
            result[q] = quantize_file(fp32, out_dir / variant_file_name(q, prefix), q, spec)
    if "fp32" not in quants and not keep_fp32:
        fp32.unlink()
    return result


def export_tiny(
    out_dir: Path,
    *,
    layout: str = "transposed",
    prefill_lens: Sequence[int] = (8,),
    kv_max: int = 64,
    mask_as_input: bool = False,
    quantization: str = "fp32",
    seed: int = 0,
    enable_hlfb: bool = True,
    spec: DecoderSpec = TINY_SPEC,
    decode_windows: Sequence[int] = (),
    verify_lens: Sequence[int] = (),
    batch_sizes: Sequence[int] = (),
) -> Path:
    """Convert a tiny random-weight decoder (`TINY_SPEC`: 2 layers, dim 128, vocab 256).

    Returns the path of ``out_dir/tiny_<options>_<quantization>.tflite``. Deterministic
    for given arguments (same seed, same weights).
    """
    opts = ExportOptions(
        layout=layout,
        prefill_lens=tuple(prefill_lens),
        kv_max=kv_max,
        mask_as_input=mask_as_input,
        enable_hlfb=enable_hlfb,
        decode_windows=tuple(decode_windows),
        verify_lens=tuple(verify_lens),
        batch_sizes=tuple(batch_sizes),
    )
    out_dir = Path(out_dir)
    prefix = f"tiny_{opts.tag()}_s{seed}"
    paths = export_variants(
        spec,
        out_dir,
        opts=opts,
        quantizations=[quantization],
        seed=seed,
        prefix=prefix,
        keep_fp32=False,
    )
    return paths[quantization]


def copy_into(src: Path, dst_dir: Path, name: str | None = None) -> Path:
    dst = Path(dst_dir) / (name or Path(src).name)
    shutil.copyfile(src, dst)
    return dst


__all__ = [
    "LAYOUTS",
    "ExportOptions",
    "add_verify_signatures",
    "build_torch_model",
    "convert_fp32",
    "export_tiny",
    "export_variants",
    "variant_file_name",
]
