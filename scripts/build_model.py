#!/usr/bin/env python3
"""Build an edge-agent model directory: convert a decoder to `.tflite` variants + metadata.

The decoder comes from a training checkpoint (``--checkpoint``, written by
``scripts/train_demo.py``) or has random weights (``--random``; architecture from ``--tiny``
or the ``--layers/--dim/...`` options). It is converted once to float with litert-torch and
every requested quantization is derived from that file. The directory gets
``model_<quant>.tflite`` files, ``tokenizer.model`` and ``metadata.json``.

Examples:

  # the demo model's shippable variants from its checkpoint
  python scripts/build_model.py --checkpoint build/demo/checkpoint.pt \\
      --tokenizer build/demo/tokenizer.model --out /tmp/demo \\
      --quant int8 --quant int4_block32 --name edge-demo-pystdlib --version 1.0.0

  # the benchmarks' larger model: SmolLM-135M's shape, random weights, the demo tokenizer
  python scripts/build_model.py --random --preset smollm-135m --kv-max 1280 \\
      --tokenizer agent/models/demo/tokenizer.model --quant int8 --out .cache/models/smollm

  # a tiny random model, default KV layout, mask as input, two prefill lengths
  python scripts/build_model.py --random --tiny --layout default --mask-as-input \\
      --prefill 8 --prefill 32 --kv-max 128 --quant fp32 --quant int8 --out /tmp/tiny
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.model.directory import QUANTIZATIONS, load_model_dir, write_model_dir_metadata  # noqa: E402
from agent.toolchain import tokenizer as tk  # noqa: E402
from agent.toolchain.config import PRESETS, TINY_SPEC, DecoderSpec  # noqa: E402


def default_prefill(windows: bool) -> tuple[int, ...]:
    """Prefill lengths when none are given. With KV windows also 8: near the end of a window no
    32-token call fits, and a turn there would run token by token (docs/PERFORMANCE.md)."""
    return (8, 32, 128, 512) if windows else (32, 128, 512)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="checkpoint from scripts/train_demo.py")
    src.add_argument("--random", action="store_true", help="random weights")
    arch = ap.add_argument_group("architecture (with --random)")
    arch.add_argument("--tiny", action="store_true", help="the tiny test architecture")
    arch.add_argument(
        "--preset", choices=sorted(PRESETS), help="a named architecture (default: demo)"
    )
    arch.add_argument("--vocab", type=int, default=None)
    arch.add_argument("--layers", type=int, default=None)
    arch.add_argument("--dim", type=int, default=None)
    arch.add_argument("--heads", type=int, default=None)
    arch.add_argument("--kv-groups", type=int, default=None)
    arch.add_argument("--ffn", type=int, default=None)
    arch.add_argument("--seed", type=int, default=0)
    conv = ap.add_argument_group("conversion")
    conv.add_argument("--layout", choices=("default", "transposed"), default="transposed")
    conv.add_argument(
        "--prefill",
        type=int,
        action="append",
        help="prefill length (repeatable; default 32, 128, 512, and 8 too with --window)",
    )
    conv.add_argument("--kv-max", type=int, default=1024)
    conv.add_argument("--mask-as-input", action="store_true")
    conv.add_argument(
        "--window",
        type=int,
        action="append",
        help="an extra, shorter KV length with its own decode/prefill signatures (repeatable)",
    )
    conv.add_argument("--no-composites", action="store_true", help="enable_hlfb=False")
    conv.add_argument(
        "--quant", action="append", choices=QUANTIZATIONS, help="quantization (repeatable)"
    )
    conv.add_argument(
        "--verify",
        type=int,
        action="append",
        metavar="N",
        help="add a verify_<N> signature (N tokens in, logits for each out) for speculative "
        "decoding; repeatable",
    )
    conv.add_argument(
        "--batch",
        type=int,
        action="append",
        metavar="B",
        help="add a decode_batch_<B> signature (B sequences decoded in one call, each at its "
        "own position over its own KV); repeatable",
    )
    conv.add_argument("--keep-fp32", action="store_true", help="keep the float file")
    out = ap.add_argument_group("model directory")
    out.add_argument("--out", type=Path, required=True)
    out.add_argument(
        "--tokenizer",
        type=Path,
        help="SentencePiece model (default: a tiny one "
        "is trained when the vocabulary has <= 256 entries)",
    )
    out.add_argument(
        "--pad-tokenizer",
        action="store_true",
        help="pad --tokenizer with placeholder pieces up to the model's vocabulary",
    )
    out.add_argument("--name", default="edge-model")
    out.add_argument("--version", default="0.0.0")
    out.add_argument("--context-length", type=int, default=None, help="default: --kv-max")
    out.add_argument("--chat-template", default="# {system}\n{user}")
    out.add_argument("--bos-id", type=int, default=tk.BOS_ID)
    out.add_argument("--eos-id", type=int, default=tk.EOS_ID)
    return ap.parse_args(argv)


def spec_from_args(args: argparse.Namespace) -> DecoderSpec:
    base = TINY_SPEC if args.tiny else PRESETS[args.preset or "demo"]
    raw = base.to_dict()
    for key, attr in (
        ("vocab_size", "vocab"),
        ("num_layers", "layers"),
        ("embedding_dim", "dim"),
        ("num_heads", "heads"),
        ("num_query_groups", "kv_groups"),
        ("intermediate_size", "ffn"),
    ):
        if getattr(args, attr) is not None:
            raw[key] = getattr(args, attr)
    raw["max_seq_len"] = max(raw["max_seq_len"], args.kv_max)
    return DecoderSpec.from_dict(raw)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from agent.toolchain.export import ExportOptions, export_variants, variant_file_name

    state = None
    if args.checkpoint:
        from agent.toolchain.train import load_checkpoint

        spec, state, _ = load_checkpoint(args.checkpoint)
    else:
        spec = spec_from_args(args)
    opts = ExportOptions(
        layout=args.layout,
        prefill_lens=tuple(args.prefill or default_prefill(bool(args.window))),
        kv_max=args.kv_max,
        mask_as_input=args.mask_as_input,
        enable_hlfb=not args.no_composites,
        decode_windows=tuple(args.window or ()),
        verify_lens=tuple(args.verify or ()),
        batch_sizes=tuple(args.batch or ()),
    )
    quants = list(dict.fromkeys(args.quant or ["int8"]))
    print(f"[build_model] {spec.param_count():,} parameters, {spec.to_dict()}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    paths = export_variants(
        spec,
        args.out,
        opts=opts,
        quantizations=quants,
        state_dict=state,
        seed=args.seed,
        keep_fp32=args.keep_fp32,
    )
    tok_dst = args.out / "tokenizer.model"
    if args.tokenizer and args.pad_tokenizer:
        tk.pad_tokenizer(args.tokenizer, spec.vocab_size, tok_dst)
    elif args.tokenizer:
        shutil.copyfile(args.tokenizer, tok_dst)
    elif spec.vocab_size <= 256:
        tk.train_tokenizer(
            [tk.TINY_TEXT * 3], tok_dst, vocab_size=spec.vocab_size, byte_fallback=False, tiny=True
        )
    else:
        print("error: --tokenizer is required for vocabularies above 256", file=sys.stderr)
        return 2
    variants = [(p.name, q) for q, p in paths.items()]
    if args.keep_fp32 and "fp32" not in paths:
        variants.insert(0, (variant_file_name("fp32"), "fp32"))
    write_model_dir_metadata(
        args.out,
        name=args.name,
        version=args.version,
        context_length=args.context_length or args.kv_max,
        bos_id=args.bos_id,
        eos_id=args.eos_id,
        stop_token_ids=[args.eos_id],
        chat_template=args.chat_template,
        variants=variants,
    )
    meta = load_model_dir(args.out)
    for v in meta.variants:
        print(f"[build_model] {v.file}: {v.quantization}, {v.size / 1e6:.2f} MB, sha256 {v.sha256}")
    print(f"[build_model] wrote {args.out} in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
