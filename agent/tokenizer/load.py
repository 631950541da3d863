"""`load_tokenizer`: the tokenizer kind a file is, by its name: ``tokenizer.model`` is
SentencePiece, ``tokenizer.json`` Hugging Face ``tokenizers``. Each kind is imported only when
a file of its kind is loaded; the interface: `agent.tokenizer.base`.
"""

from __future__ import annotations

from pathlib import Path

from agent.tokenizer.base import Tokenizer, read_tokenizer_config


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer in `path`, by its name: ``*.json`` is Hugging Face, else SentencePiece."""
    config = read_tokenizer_config(path.parent)
    if path.suffix == ".json":
        from agent.tokenizer.hf import HFTokenizer

        return HFTokenizer(path, config)
    from agent.tokenizer.sentencepiece import SentencePieceTokenizer

    return SentencePieceTokenizer(path, config)
