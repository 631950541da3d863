"""What the peer benchmark's parts share: its models, engines, prompt lengths and sections."""

from __future__ import annotations

import importlib.util

from benchmarks._report import ROOT

CACHE = ROOT / ".cache" / "bench"
MODELS = ROOT / ".cache" / "models"
TOKENIZER = ROOT / "agent" / "models" / "demo" / "tokenizer.model"
SMOLLM = ["--random", "--preset", "smollm-135m", "--tokenizer", str(TOKENIZER), "--pad-tokenizer"]
MAIN_MODEL = (
    MODELS / "smollm-kv1024",
    [*SMOLLM, "--kv-max", "1024", "--quant", "int8", "--quant", "int4_block32"],
)
# Prefill 8 besides the usual 32/128/512: near the end of a window no 32-token call fits, and
# a turn there would otherwise run up to 31 tokens one by one (measured: a 16-token turn at
# row 1,000 of the 1024-row window took 291 ms as 16 decode calls; moving up to the 4096-row
# window first cost more: the move 85-350 ms plus 208 ms for a 32-token call over 4096 rows).
WINDOW_MODEL = (
    MODELS / "smollm-kv4096w8",
    [
        *SMOLLM,
        *("--kv-max", "4096", "--window", "256", "--window", "1024", "--quant", "int8"),
        *("--prefill", "8", "--prefill", "32", "--prefill", "128", "--prefill", "512"),
    ],
)
# The main model exported with KV windows 256 and 512 as well (prefill 8/32/128/512 by
# build_model's default with windows): the same weights, and for LiteRT-LM the same
# `decode`/`prefill_<N>` signatures over 1024 rows; edge-agent runs a 64-token prompt and its
# 128 tokens in the 256-row window and a 448-token prompt in the 512-row one.
MAIN_WINDOWS_MODEL = (
    MODELS / "smollm-kv1024w",
    [
        *SMOLLM,
        *("--kv-max", "1024", "--window", "256", "--window", "512"),
        *("--quant", "int8", "--quant", "int4_block32"),
    ],
)
QUANTS = ("int8", "int4_block32")
ENGINES = ("edge", "grpc", "litertlm")
PROMPTS = (64, 448)
# Tokens of conversation before the continued turn, and of the turn. History + turn stays 32
# rows below the 1024-row cache: LiteRT-LM 0.18.1 pads its last prefill group to a signature
# length and refuses to run past the cache ("Chosen prefill work group size exceeds available
# state entries"), where edge-agent finishes with shorter signatures and decode (measured).
HISTORY = 976
TURN = 16
# On the KV-4096 model (windows 256/1024) the conversation is exactly 1,000 tokens: 999 of
# prompt plus the answer's one; LiteRT-LM runs that file's full-length signatures.
HISTORY_4096 = 999
SECTIONS = ("main", "main-windows", "windows", "continue", "continue4096", "spec", "verify-cost")
WINDOW_USED = (128, 1000, 3000)  # used context (prompt + decoded) for the windows section
WINDOW_DECODE = 64
NAMES = {"edge": "edge-agent in-process", "grpc": "edge-agent via gRPC", "litertlm": "LiteRT-LM"}


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
