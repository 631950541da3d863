"""SentencePiece tokenizer (``tokenizer.model``) with streaming-safe UTF-8 detokenization.

Every id maps to the exact bytes it stands for (byte-fallback pieces ``<0xNN>`` to that byte,
``▁`` to a space, control tokens to nothing). A stream of ids is turned into text through an
incremental UTF-8 decoder, so a character split over several tokens is emitted only once it is
complete, and nothing is ever dropped.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from agent.base.errors import InvalidRequest, ModelFormatError
from agent.tokenizer.base import TokenizerConfig, read_tokenizer_config

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_TAG = re.compile(r"<[^<>\s]+>")  # a user-defined piece spelled like this is a special token
_USER_DEFINED = 4  # ModelProto.SentencePiece.Type.USER_DEFINED
_MODEL_PB: Any = sentencepiece_model_pb2  # generated protobuf code: no types to check against
_SPACE = "\u2581"


class SentencePieceTokenizer:
    """Encode text to ids and decode ids to text (whole or streamed).

    Special tokens are the control pieces (``<bos>``) and the user-defined pieces spelled as a
    tag, ``<...>`` without spaces (Gemma's ``<start_of_turn>``/``<end_of_turn>`` are
    user-defined; transformers' converter makes them special too); other user-defined pieces,
    such as the demo model's ``\n``, are ordinary text. SentencePiece never matches control
    pieces in text and always matches user-defined ones, so: `special=True` (a chat template's
    own text) turns the text of either kind into its id; `special=False` breaks a tag's text
    before SentencePiece sees it (its first character on its own), so user text never becomes
    a special id. Special tokens decode to nothing.
    """

    kind = "sentencepiece"

    def __init__(self, path: Path, config: TokenizerConfig | None = None) -> None:
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            raise ModelFormatError(f"{path}: not a SentencePiece model: {exc}") from exc
        self.path = path
        self.config = config if config is not None else read_tokenizer_config(path.parent)
        self.vocab_size: int = self._sp.get_piece_size()
        sp = self._sp
        proto = _MODEL_PB.ModelProto.FromString(sp.serialized_model_proto())
        tags = {
            i
            for i, p in enumerate(proto.pieces)
            if p.type == _USER_DEFINED and _TAG.fullmatch(p.piece)
        }
        self.special_ids = frozenset({i for i in range(self.vocab_size) if sp.is_control(i)} | tags)
        self._bytes = [self._piece_bytes(i) for i in range(self.vocab_size)]
        unk = int(sp.unk_id())
        self.unk_id: int | None = unk if 0 <= unk < self.vocab_size and sp.is_unknown(unk) else None
        # Tag-like pieces are found by `_TAG` and a set, not by one alternation of their texts:
        # a tokenizer padded with 45,056 `<unused_N>` pieces took 2.5 s to compile two such
        # alternations at every load (docs/PERFORMANCE.md). The same matches: a `_TAG` match
        # ends at the first ">" after its "<" and holds no "<", so a tag starting anywhere is
        # exactly the `_TAG` match starting there, and none starts inside another match.
        self._tag_texts = frozenset(str(sp.id_to_piece(i)) for i in tags)
        others = sorted(
            {str(sp.id_to_piece(i)) for i in self.special_ids} - self._tag_texts,
            key=len,
            reverse=True,
        )
        self._others = re.compile("|".join(re.escape(t) for t in others if t)) if others else None
        self._any_special = bool(self._tag_texts) or self._others is not None
        # Models trained with a dummy prefix start every text with "▁"; decode() drops it once.
        first = self._sp.encode("a")
        self._strip_leading_space = bool(first) and self._sp.id_to_piece(first[0]).startswith(
            _SPACE
        )

    def _piece_bytes(self, i: int) -> bytes:
        sp = self._sp
        if i in self.special_ids:
            return b""
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            m = _BYTE_PIECE.match(piece)
            return bytes([int(m.group(1), 16)]) if m else b""
        if sp.is_unknown(i):
            return " \u2047 ".encode()  # what sentencepiece's own decode renders for unk
        return piece.replace(_SPACE, " ").encode("utf-8")

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Text → ids (no bos/eos added); `special`: control-piece text becomes their ids."""
        try:
            if not special or not self._any_special:
                return self._plain(text)
            ids: list[int] = []
            pos = 0
            for start, end in self._specials(text):
                if start > pos:
                    ids += self._plain(text[pos:start])
                ids.append(int(self._sp.piece_to_id(text[start:end])))
                pos = end
            if pos < len(text):
                ids += self._plain(text[pos:])
            return ids
        except (TypeError, RuntimeError) as exc:
            raise InvalidRequest(f"cannot tokenize: {exc}") from exc

    def _tags_in(self, text: str, pos: int = 0) -> Iterator[re.Match[str]]:
        """The tag-like pieces' texts in `text` from `pos`, left to right."""
        for m in _TAG.finditer(text, pos):
            if m.group() in self._tag_texts:
                yield m

    def _specials(self, text: str) -> Iterator[tuple[int, int]]:
        """(start, end) of every special piece's text in `text`, left to right, the longest
        where several start at the same place (as one alternation, longest first, finds)."""
        pos = 0
        while True:
            tag = next(self._tags_in(text, pos), None) if self._tag_texts else None
            other = self._others.search(text, pos) if self._others is not None else None
            if tag is None and other is None:
                return
            if other is None or (
                tag is not None and (tag.start(), -tag.end()) < (other.start(), -other.end())
            ):
                assert tag is not None
                start, end = tag.span()
            else:
                start, end = other.span()
            yield start, end
            pos = end

    def _plain(self, text: str) -> list[int]:
        """SentencePiece on `text`, with every tag-like user-defined piece's text broken after
        its first character so that SentencePiece cannot match it."""
        if not self._tag_texts:
            return list(self._sp.encode(text))
        ids: list[int] = []
        pos = 0
        for m in self._tags_in(text):
            for part in (text[pos : m.start() + 1], text[m.start() + 1 : m.end()]):
                if part:
                    ids += self._sp.encode(part)
            pos = m.end()
        if pos < len(text):
            ids += self._sp.encode(text[pos:])
        return ids

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """Control-piece text in template runs becomes those ids; all the text between them
        (template and content alike) is encoded in one call, as the whole text would be:
        SentencePiece never matches control pieces in text, so content stays text."""
        ids: list[int] = []
        text = ""
        for run, template in pieces:
            pos = 0
            if template and self._any_special:
                for start, end in self._specials(run):
                    text += run[pos:start]
                    if text:
                        ids += self.encode(text)
                    text = ""
                    ids.append(int(self._sp.piece_to_id(run[start:end])))
                    pos = end
            text += run[pos:]
        if text:
            ids += self.encode(text)
        return ids

    def token_text(self, token_id: int) -> str:
        """The piece's own text (``<bos>``, ``<start_of_turn>``): what a template writes."""
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequest(f"token id {token_id} is out of range [0, {self.vocab_size})")
        return str(self._sp.id_to_piece(token_id))

    def token_id(self, text: str) -> int | None:
        """The id of a piece given by its text, None when there is no such piece."""
        i = int(self._sp.piece_to_id(text))
        return None if i == self._sp.unk_id() and text != self._sp.id_to_piece(i) else i

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequest(f"token id {token_id} is out of range [0, {self.vocab_size})")
        return self._bytes[token_id]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids → text, as one piece."""
        stream = self.stream()
        return stream.push_many(ids) + stream.flush()

    def stream(self) -> SentencePieceStream:
        """A fresh incremental detokenizer."""
        return SentencePieceStream(self)


class SentencePieceStream:
    """Turns ids into text deltas; never emits half a character and never drops one."""

    def __init__(self, tokenizer: SentencePieceTokenizer) -> None:
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
