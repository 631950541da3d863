"""SentencePiece tokenizer with streaming-safe UTF-8 detokenization.

Every id maps to the exact bytes it stands for (byte-fallback pieces ``<0xNN>`` to that byte,
``▁`` to a space, control tokens to nothing). A stream of ids is turned into text through an
incremental UTF-8 decoder, so a character split over several tokens is emitted only once it is
complete, and nothing is ever dropped.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from agent.errors import InvalidRequest, ModelFormatError

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPACE = "\u2581"


class Tokenizer:
    """Encode text to ids and decode ids to text (whole or streamed)."""

    def __init__(self, path: Path) -> None:
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            raise ModelFormatError(f"{path}: not a SentencePiece model: {exc}") from exc
        self.path = path
        self.vocab_size: int = self._sp.get_piece_size()
        self._bytes = [self._piece_bytes(i) for i in range(self.vocab_size)]
        # Models trained with a dummy prefix start every text with "▁"; decode() drops it once.
        first = self._sp.encode("a")
        self._strip_leading_space = bool(first) and self._sp.id_to_piece(first[0]).startswith(
            _SPACE
        )

    def _piece_bytes(self, i: int) -> bytes:
        sp = self._sp
        if sp.is_control(i):
            return b""
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            m = _BYTE_PIECE.match(piece)
            return bytes([int(m.group(1), 16)]) if m else b""
        if sp.is_unknown(i):
            return " \u2047 ".encode()  # what sentencepiece's own decode renders for unk
        return piece.replace(_SPACE, " ").encode("utf-8")

    def encode(self, text: str) -> list[int]:
        """Text → ids (no bos/eos added)."""
        try:
            return list(self._sp.encode(text))
        except (TypeError, RuntimeError) as exc:
            raise InvalidRequest(f"cannot tokenize: {exc}") from exc

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequest(f"token id {token_id} is out of range [0, {self.vocab_size})")
        return self._bytes[token_id]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids → text, as one piece."""
        stream = self.stream()
        return stream.push_many(ids) + stream.flush()

    def stream(self) -> DetokenizeStream:
        """A fresh incremental detokenizer."""
        return DetokenizeStream(self)


class DetokenizeStream:
    """Turns ids into text deltas; never emits half a character and never drops one."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = tokenizer._strip_leading_space

    def push(self, token_id: int) -> str:
        data = self._tok.token_bytes(token_id)
        if self._at_start and data:
            self._at_start = False
            if data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def push_many(self, ids: Sequence[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """End of stream: an incomplete trailing sequence becomes U+FFFD, never lost silently."""
        return self._utf8.decode(b"", final=True)
