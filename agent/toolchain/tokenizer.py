"""SentencePiece tokenizers for source code.

Code needs settings that differ from SentencePiece's defaults, or indentation is lost:
identity normalization (no NFKC), no dummy prefix, no collapsing of whitespace, whitespace-only
pieces allowed (so runs of indentation become single pieces), ``\\n`` as a user-defined symbol
(training reads one line per sentence, so newlines would otherwise never be seen), and byte
fallback so that any UTF-8 text round-trips.

Token ids (written into the model's metadata.json): ``pad=0, bos=1, eos=2, unk=3``.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from pathlib import Path

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def trainer_options(vocab_size: int, *, byte_fallback: bool = True, tiny: bool = False) -> dict:
    """The SentencePiece trainer options used for code (see the module docstring)."""
    opts = dict(
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=["\n"],
        byte_fallback=byte_fallback,
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        max_sentence_length=8192,
        num_threads=2,
        minloglevel=2,
    )
    if tiny:
        opts["hard_vocab_limit"] = False
    return opts


def _lines(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


def train_tokenizer(
    texts: Iterable[str],
    out_path: Path,
    *,
    vocab_size: int = 4096,
    byte_fallback: bool = True,
    tiny: bool = False,
    max_lines: int | None = None,
) -> Path:
    """Train a SentencePiece model on `texts` and write it to `out_path` (``.model``)."""
    import sentencepiece as spm

    lines = list(_lines(texts))
    if max_lines is not None:
        lines = lines[:max_lines]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        **trainer_options(vocab_size, byte_fallback=byte_fallback, tiny=tiny),
    )
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(buf.getvalue())
    return out_path


def pad_tokenizer(src: Path, vocab_size: int, dst: Path) -> Path:
    """Copy a SentencePiece model, padded to `vocab_size` pieces with placeholders.

    For a model whose vocabulary is larger than its tokenizer's (a random-weight model of a
    real LLM's shape): engines that sample over every logit (LiteRT-LM) must be able to
    detokenize any id. The placeholders are user-defined pieces ``<unused_N>``: they decode to
    their own text and never match ordinary input.
    """
    from sentencepiece import sentencepiece_model_pb2 as spm_pb

    proto = spm_pb.ModelProto()
    proto.ParseFromString(Path(src).read_bytes())
    have = len(proto.pieces)
    if vocab_size < have:
        raise ValueError(f"{src} has {have} pieces, more than the vocabulary {vocab_size}")
    for i in range(have, vocab_size):
        piece = proto.pieces.add()
        piece.piece = f"<unused_{i}>"
        piece.score = 0.0
        piece.type = spm_pb.ModelProto.SentencePiece.USER_DEFINED
    Path(dst).write_bytes(proto.SerializeToString())
    return Path(dst)


def load(path: Path):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(path))


def encode_document(sp, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
    ids = list(sp.encode(text))
    if bos:
        ids.insert(0, BOS_ID)
    if eos:
        ids.append(EOS_ID)
    return ids


#: A few KB of permissively licensed text for tiny test tokenizers (written for this project).
TINY_TEXT = '''\
def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self, start=0):
        self.value = start

    def step(self, n=1):
        self.value += n
        return self.value


for i in range(10):
    if i % 2 == 0:
        print("even", i)
    else:
        print("odd", i)

The quick brown fox jumps over the lazy dog. Hello world! Edge devices run small models.
A daemon keeps the model loaded, serves local apps, and reports its health to the fleet.
'''
