"""`edge-agent generate`: one completion from the model in this process, without a daemon."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from agent.base import exitcodes
from agent.cli.client_text import text_arg
from agent.cli.common import (
    _profile_arg,
    _profile_name,
    _resolve,
    _sampling_args,
    penalty_fields,
)


def _open_engine(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from agent.engine.engine import Engine
    from agent.model.directory import demo_model_dir
    from agent.profile import log_reasons
    from agent.profile.oneshot import one_shot_profile

    profile, reasons = _resolve(args)
    log_reasons(profile.name, reasons, detected=_profile_name(args) is None)
    profile = one_shot_profile(profile)  # never the daemon's /var/cache
    model_dir = Path(args.model) if args.model else (profile.model.path or demo_model_dir())
    return Engine.load(profile, model_dir, quantization=args.quantization)


def cmd_generate(args: argparse.Namespace) -> int:
    from agent.engine.sampler import SamplingParams
    from agent.engine.types import GenerateRequest

    engine = _open_engine(args)
    gen = engine.profile.generation
    sampling = SamplingParams.with_defaults(
        gen,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        **penalty_fields(args),
    )
    request = GenerateRequest(
        prompt=text_arg(args.prompt),
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop=tuple(args.stop),
        speculation=args.speculation,  # None: the profile's generation.speculation
    )
    cancel = threading.Event()
    text: list[str] = []
    tokens: list[int] = []
    try:
        for event in engine.generate(request, cancel):
            text.append(event.text)
            tokens.extend(event.token_ids)
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if event.finish_reason is not None:
                last = event
    except KeyboardInterrupt:
        cancel.set()
        if args.json:
            partial = {"text": "".join(text), "tokens": tokens, "finish_reason": "cancelled"}
            print(json.dumps({**partial, "error": "interrupted"}, ensure_ascii=False))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
        print(f"edge-agent: interrupted after {len(tokens)} tokens", file=sys.stderr)
        return exitcodes.INTERRUPTED
    stats = last.stats
    assert stats is not None
    if args.json:
        doc = {
            "text": "".join(text),
            "tokens": tokens,
            "finish_reason": last.finish_reason,
            "model": {"name": engine.info.name, "quantization": engine.info.quantization},
            "profile": engine.profile.name,
            "stats": {
                "ttft_ms": round(stats.ttft_ms, 2),
                "prefill_tok_s": round(stats.prefill_tok_s, 1),
                "decode_tok_s": round(stats.decode_tok_s, 1),
                "accelerator": stats.accelerator,
                "prompt_tokens": stats.prompt_tokens,
                "generated_tokens": stats.generated_tokens,
                # speculative decoding: drafts checked, accepted, and the verify calls
                "drafted_tokens": stats.drafted_tokens,
                "accepted_tokens": stats.accepted_tokens,
                "acceptance": round(stats.acceptance, 3),
                "verify_calls": stats.verify_calls,
            },
        }
        if last.error:
            doc["error"] = last.error
        print(json.dumps(doc, ensure_ascii=False))
    else:
        spec = (
            f", {stats.accepted_tokens}/{stats.drafted_tokens} drafts accepted"
            if stats.drafted_tokens
            else ""
        )
        print()
        print(
            f"[{stats.generated_tokens} tokens, {last.finish_reason}; ttft {stats.ttft_ms:.1f} ms, "
            f"prefill {stats.prefill_tok_s:.0f} tok/s, decode {stats.decode_tok_s:.0f} tok/s, "
            f"{stats.accelerator}, {engine.info.name} {engine.info.quantization}, "
            f"profile {engine.profile.name}{spec}]",
            file=sys.stderr,
        )
    engine.close()
    if last.finish_reason in ("stop", "length"):
        return exitcodes.OK
    print(f"edge-agent: the request failed: {last.error or last.finish_reason}", file=sys.stderr)
    return exitcodes.FAILED


def add_generate_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``generate`` to the CLI's subparsers (sets `func`)."""
    p = subparsers.add_parser("generate", help="stream a completion from the model")
    p.add_argument("prompt", help="the prompt; - reads it from stdin")
    _profile_arg(p)
    p.add_argument("--root", default="/", help=argparse.SUPPRESS)
    p.add_argument(
        "--model",
        help="model directory or .litertlm bundle (default: the profile's, else the demo model)",
    )
    p.add_argument("--quantization", help="pick this variant instead of the profile's choice")
    _sampling_args(p)
    p.set_defaults(func=cmd_generate)
