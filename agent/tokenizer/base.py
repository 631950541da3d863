"""The tokenizer interface both kinds implement (SentencePiece, Hugging Face ``tokenizers``) and
the ``tokenizer_config.json`` keys read beside them. Text is plain unless ``special=True``
(typed ``<|im_end|>`` is never a special id); a stream never splits a character (`Tokenizer`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent.base.errors import ModelFormatError

CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """What edge-agent reads from ``tokenizer_config.json`` (all optional)."""

    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    bos_token: str | None = None
    eos_token: str | None = None


class DetokenizeStream(Protocol):
    """Ids in, text deltas out."""

    def push(self, token_id: int) -> str:
        """Add one id; returns the text it completes (maybe "")."""
        ...

    def push_many(self, ids: Sequence[int]) -> str: ...

    def flush(self) -> str:
        """End of stream: what is still held back (an incomplete tail as U+FFFD)."""
        ...


class Tokenizer(Protocol):
    """What the engine, the RPCs and the benchmarks need from a tokenizer.

    Both kinds honour the same contract: ``encode(text)`` treats the text as plain text (a user who
    types ``<|im_end|>`` gets the pieces of those characters, never the special id) unless
    ``special=True``; ``decode`` and ``stream`` render special tokens as nothing; a stream never
    emits half a character and never drops one (an incomplete tail becomes U+FFFD at ``flush``).
    """

    kind: str  # "sentencepiece" | "huggingface"
    path: Path
    vocab_size: int
    config: TokenizerConfig
    special_ids: frozenset[int]  # decode to nothing; what `special=True` may produce
    unk_id: int | None  # a piece standing for text the vocabulary lacks: never grammar text

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Text → ids, nothing added; special-token text becomes special ids only if `special`."""
        ...

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """A rendered chat: ``(text, is_template)`` runs; only template runs may produce
        special ids."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Ids → text; special tokens render as nothing."""
        ...

    def stream(self) -> DetokenizeStream: ...

    def token_text(self, token_id: int) -> str:
        """The token's own text (``<|im_end|>``, ``<bos>``)."""
        ...

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled `text`, None when the vocabulary has none."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes the token adds to the output (b"" for a special token): what a
        constrained-decoding library matches a grammar against."""
        ...


def _token_string(value: Any, key: str, where: Path) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...} (AddedToken)
        value = value.get("content")
    if not isinstance(value, str):
        raise ModelFormatError(f"{where}: {key} = {value!r} should be a string or null")
    return value


def read_tokenizer_config(directory: Path) -> TokenizerConfig:
    """``tokenizer_config.json`` in `directory`, or an empty config when there is none.

    Beside either one, a ``tokenizer_config.json`` as Hugging Face ships it may say
    ``add_bos_token`` / ``add_eos_token`` and name ``bos_token`` / ``eos_token`` (the strings a chat
    template writes); `read_tokenizer_config` reads those keys and ignores the rest.
    """
    where = directory / CONFIG_FILE
    try:
        raw = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return TokenizerConfig()
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{where}: cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{where}: expected a JSON object")
    flags: dict[str, bool | None] = {}
    for key in ("add_bos_token", "add_eos_token"):
        value = raw.get(key)
        if value is not None and not isinstance(value, bool):
            raise ModelFormatError(f"{where}: {key} = {value!r} should be true, false or null")
        flags[key] = value
    return TokenizerConfig(
        add_bos_token=flags["add_bos_token"],
        add_eos_token=flags["add_eos_token"],
        bos_token=_token_string(raw.get("bos_token"), "bos_token", where),
        eos_token=_token_string(raw.get("eos_token"), "eos_token", where),
    )
