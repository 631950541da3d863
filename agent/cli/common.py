"""What the command groups share: the profile flags, the sampling flags, durations, and the
usage failure (a message and exit 2)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import TypedDict

PROFILE_ENV = "EDGE_AGENT_PROFILE"
EXIT_USAGE = 2
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def _fail(message: str) -> int:
    print(f"edge-agent: {message}", file=sys.stderr)
    return EXIT_USAGE


def parse_duration(text: str) -> float:
    """Seconds in "90", "90s", "15m", "12h", "7d" or "2w" (ValueError otherwise)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration like 3600, 45m, 12h, 7d or 2w")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _profile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile", dest="sub_profile", help="profile name or path to a .toml (default: detect)"
    )


def _resolve(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from agent.profile import resolve_profile

    root = Path(getattr(args, "root", None) or "/")
    return resolve_profile(_profile_name(args), root)


def _profile_name(args: argparse.Namespace) -> str | None:
    """--profile after the command, before it, or EDGE_AGENT_PROFILE (set by the drop-in)."""
    return getattr(args, "sub_profile", None) or args.profile or os.environ.get(PROFILE_ENV)


def _bias(text: str) -> tuple[int, float]:
    """--logit-bias ID=BIAS (ranges are the engine's to check, as for every client)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ID=BIAS (e.g. 42=-100)") from None


class PenaltyFields(TypedDict):
    logit_bias: tuple[tuple[int, float], ...]
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    repeat_last_n: int | None


def penalty_fields(args: argparse.Namespace) -> PenaltyFields:
    """The penalty flags as `SamplingParams.with_defaults` / `build_request` keywords."""
    return {
        "logit_bias": tuple(args.logit_bias),
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "repetition_penalty": args.repeat_penalty,
        "repeat_last_n": args.repeat_last_n,
    }


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        type=_bias,
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable; docs/API.md)",
    )
    p.add_argument("--presence-penalty", type=float, help="OpenAI's, -2..2 (default 0)")
    p.add_argument("--frequency-penalty", type=float, help="OpenAI's, -2..2 (default 0)")
    p.add_argument("--repeat-penalty", type=float, help="llama.cpp's, (0, 10]; 1 is off")
    p.add_argument(
        "--repeat-last-n", type=int, help="tokens the repeat penalty looks back over (default 64)"
    )
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument(
        "--speculation",
        choices=("off", "ngram", "draft"),
        help="speculative decoding: off, or ngram (drafts from the prompt and the text so far;"
        " the output is the same); default: the profile's generation.speculation. draft (a"
        " second model) is not available yet",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
