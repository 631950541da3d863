"""Hugging Face ``tokenizer.json`` through the ``tokenizers`` library, with the `Tokenizer`
contract: special tokens only where asked for (`HFTokenizer`), and streams of whole characters
whose deltas joined equal ``decode`` (`HFStream`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from agent.base.errors import InvalidRequest, ModelFormatError
from agent.tokenizer.base import TokenizerConfig, read_tokenizer_config

_REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable character → byte table, which ByteLevel pre-tokenizes bytes into."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


def _decoders(node: Any) -> list[dict[str, Any]]:
    """The decoder steps of a tokenizer.json, a Sequence flattened."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [d for sub in node.get("decoders", []) for d in _decoders(sub)]
    return [node]


class HFTokenizer:
    """A ``tokenizer.json`` tokenizer (byte-level BPE, Metaspace/byte-fallback, ...).

    Encoding: ``add_special_tokens=False`` always (BOS/EOS are the engine's and the chat template's
    business, never the post-processor's), and the library's ``encode_special_tokens`` switch on for
    plain text, so text spelling a special token (``<|im_end|>``) is split into ordinary pieces like
    any other text. Added tokens that are not special (Qwen's ``<think>``) are matched either way,
    as the library and transformers do.
    """

    kind = "huggingface"

    def __init__(self, path: Path, config: TokenizerConfig | None = None) -> None:
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise ModelFormatError(f"{path}: not a Hugging Face tokenizer.json: {exc}") from exc
        self.path = path
        self.config = config if config is not None else read_tokenizer_config(path.parent)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1 if vocab else 0
        self.special_ids = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )
        # BPE and WordPiece name their unknown token, Unigram gives its id
        unk_name = getattr(self._tok.model, "unk_token", None)
        unk = self._tok.token_to_id(unk_name) if isinstance(unk_name, str) else None
        if unk is None and isinstance(getattr(self._tok.model, "unk_id", None), int):
            unk = int(self._tok.model.unk_id)
        self.unk_id: int | None = unk
        self._lock = threading.Lock()  # encode_special_tokens is the object's state
        self._bytes: list[bytes] | None = None  # token_bytes, built on first use

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Text → ids; special-token text gives special ids only with `special=True`."""
        try:
            with self._lock:
                self._tok.encode_special_tokens = not special
                return list(self._tok.encode(text, add_special_tokens=False).ids)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"cannot tokenize: {exc}") from exc

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """The whole text encoded at once with special tokens on (exactly the ids
        transformers' ``apply_chat_template(tokenize=True)`` gives), unless a special token
        would come out of a content run: then each run on its own, content runs with special
        tokens off (the ids may then differ at the runs' edges, never in what they say)."""
        text = "".join(t for t, _ in pieces)
        spans: list[tuple[int, int]] = []
        pos = 0
        for t, template in pieces:
            if not template and t:
                spans.append((pos, pos + len(t)))
            pos += len(t)
        try:
            with self._lock:
                self._tok.encode_special_tokens = False
                enc = self._tok.encode(text, add_special_tokens=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"cannot tokenize: {exc}") from exc
        for i, (a, b) in zip(enc.ids, enc.offsets, strict=True):
            if i in self.special_ids and any(a < e and s < b for s, e in spans):
                ids: list[int] = []
                for t, template in pieces:
                    ids += self.encode(t, special=template)
                return ids
        return list(enc.ids)

    def _check(self, ids: Sequence[int]) -> None:
        for i in ids:
            if not 0 <= i < self.vocab_size or self._tok.id_to_token(i) is None:
                raise InvalidRequest(f"token id {i} is out of range [0, {self.vocab_size})")

    def decode(self, ids: Sequence[int]) -> str:
        """Ids → text (special tokens render as nothing)."""
        self._check(ids)
        return self._decode(ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        self._check((token_id,))
        return str(self._tok.id_to_token(token_id))

    def token_id(self, text: str) -> int | None:
        i = self._tok.token_to_id(text)
        return None if i is None else int(i)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's bytes: ByteLevel's alphabet undone, or ``<0xNN>`` byte-fallback pieces
        as their byte and the decoder's replacements (Metaspace's ``▁``) applied; b"" for a
        special token. Built for the whole vocabulary on first use."""
        self._check((token_id,))
        if self._bytes is None:
            self._bytes = self._all_bytes()
        return self._bytes[token_id]

    def _all_bytes(self) -> list[bytes]:
        steps = _decoders(json.loads(self._tok.to_str()).get("decoder"))
        kinds = {d.get("type") for d in steps}
        table = _byte_level_table() if "ByteLevel" in kinds else None
        replace: list[tuple[str, str]] = []
        for d in steps:
            if d.get("type") == "Replace" and isinstance(d.get("pattern"), dict):
                pattern = d["pattern"].get("String")
                if isinstance(pattern, str):
                    replace.append((pattern, str(d.get("content", ""))))
            elif d.get("type") == "Metaspace":
                replace.append((str(d.get("replacement", "\u2581")), " "))
        out: list[bytes] = []
        for i in range(self.vocab_size):
            piece = self._tok.id_to_token(i)
            if piece is None or i in self.special_ids:
                out.append(b"")
            elif table is not None:
                out.append(b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece))
            elif "ByteFallback" in kinds and (m := _BYTE_PIECE.match(piece)):
                out.append(bytes([int(m.group(1), 16)]))
            else:
                for a, b in replace:
                    piece = piece.replace(a, b)
                out.append(piece.encode("utf-8"))
        return out

    def stream(self) -> HFStream:
        """A fresh incremental detokenizer."""
        return HFStream(self)


class HFStream:
    """Text deltas from ids by re-decoding a short window; whole characters only.

    Decoding is the library's own ``decode(..., skip_special_tokens=True)``. Streaming uses the
    prefix/read-offset technique (as text-generation-inference and vLLM do): each new id decodes a
    short window of the latest ids, and the text past the window's earlier part is emitted once it
    does not end in U+FFFD (an incomplete UTF-8 sequence from byte-level or byte-fallback pieces).
    Every delta therefore holds whole characters, and the deltas joined equal ``decode`` of all ids:
    decoding the window twice from the same start makes decoders that treat the first token
    specially (Metaspace's leading space, ``Strip``) agree with themselves.
    """

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        self._tok._check((token_id,))
        self._ids.append(token_id)
        before = self._tok._decode(self._ids[self._prefix : self._read])
        text = self._tok._decode(self._ids[self._prefix :])
        if len(text) > len(before) and not text.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before) :]
        return ""

    def push_many(self, ids: Sequence[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """End of stream: an incomplete trailing sequence becomes U+FFFD, never lost silently."""
        before = self._tok._decode(self._ids[self._prefix : self._read])
        text = self._tok._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(before) :]
