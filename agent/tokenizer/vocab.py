"""A tokenizer file's vocabulary as the tokenizer's own library reads it: the id of a token
given as text (``"<eos>"``, ``"<|im_end|>"``) and whether plain encoding adds BOS.

This is what `model import` and the `.litertlm` reader need to turn the token *strings* that
``tokenizer_config.json`` and LiteRT-LM metadata carry into the ids ``metadata.json`` records.
It asks SentencePiece or Hugging Face ``tokenizers`` directly, never our own tokenizer code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.base.errors import ModelFormatError


class Vocab:
    """Token lookups in a ``tokenizer.model`` (SentencePiece) or ``tokenizer.json`` file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.kind = "hf" if path.name.endswith(".json") else "sentencepiece"
        self._hf: Any = None
        self._sp: Any = None
        try:
            if self.kind == "hf":
                from tokenizers import Tokenizer

                self._hf = Tokenizer.from_file(str(path))
                self.size: int = self._hf.get_vocab_size(with_added_tokens=True)
            else:
                import sentencepiece as spm

                self._sp = spm.SentencePieceProcessor(model_file=str(path))
                self.size = self._sp.get_piece_size()
        except Exception as exc:  # both libraries raise plain Exception/RuntimeError subclasses
            what = "tokenizer.json" if self.kind == "hf" else "SentencePiece model"
            raise ModelFormatError(f"{path}: not a readable {what}: {exc}") from exc

    def id(self, token: str) -> int | None:
        """The id of the token spelled `token`, or None when the vocabulary has none."""
        if self._hf is not None:
            found = self._hf.token_to_id(token)
            return None if found is None else int(found)
        i = int(self._sp.piece_to_id(token))
        if i == self._sp.unk_id() and self._sp.id_to_piece(i) != token:
            return None
        return i

    def own_ids(self) -> tuple[int | None, int | None]:
        """(BOS, EOS) as the tokenizer file itself defines them: a SentencePiece model carries
        both ids (-1 when it has none); a ``tokenizer.json`` names no such roles."""
        if self._sp is None:
            return None, None
        bos, eos = int(self._sp.bos_id()), int(self._sp.eos_id())
        return (bos if bos >= 0 else None), (eos if eos >= 0 else None)

    def piece(self, i: int) -> str:
        """The token `i` as text (for messages)."""
        if self._hf is not None:
            return str(self._hf.id_to_token(i))
        return str(self._sp.id_to_piece(i))

    def require(self, token: str, where: str) -> int:
        """`id(token)`, or an error naming `where` the token came from."""
        found = self.id(token)
        if found is None:
            raise ModelFormatError(
                f"{where}: token {token!r} is not in the vocabulary of {self.path}"
            )
        return found

    def adds_bos(self, bos_id: int) -> bool:
        """Whether encoding a plain text with the tokenizer's own special-token rule puts
        `bos_id` first (Hugging Face: the post-processor; SentencePiece: always, by convention
        of the models that ship one with a BOS)."""
        if self._hf is None:
            return True
        ids = self._hf.encode("a", add_special_tokens=True).ids
        return bool(ids) and int(ids[0]) == bos_id
