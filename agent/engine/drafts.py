"""Prompt lookup: draft tokens for speculative decoding from the request's own token history.

The history is the prompt (with a session's earlier turns, the whole conversation) and the
text generated so far. For the last n tokens (n from `MAX_NGRAM` down to `MIN_NGRAM`) the most
recent earlier occurrence is found and the tokens that followed it are proposed. Strongest
where local apps use LLMs: editing code the prompt holds, summarising, answering from a given
document, where the answer copies runs of the input.

The index is a dict per n from each n-gram to the end of its latest occurrence, updated as
tokens are appended (n dict writes per token): no rescans. An n-gram enters the index only once
a token follows it, so a lookup never finds the suffix itself, and a found occurrence always
has a continuation. A continuation that runs into the suffix is read on through the draft
being built: a repeating pattern is extrapolated (``a b a b a`` → ``b a b a``).

`MIN_NGRAM` is 1: a single-token match is the weakest evidence, but on short or repetitive
text it is often the only one, and the policy (`agent.engine.speculation`) measures acceptance
per match length, so unigram drafts that do not pay are simply not used while longer matches
still are.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_NGRAM = 3
MIN_NGRAM = 1


class PromptLookup:
    """An incremental n-gram index over one request's tokens."""

    __slots__ = ("_index", "_max", "_min", "_tokens")

    def __init__(
        self, tokens: Iterable[int] = (), *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram lengths {min_ngram}..{max_ngram}: need 1 <= min <= max")
        self._max = max_ngram
        self._min = min_ngram
        self._tokens: list[int] = []
        # _index[n - 1]: n-gram → index of its last token, latest occurrence that has a successor
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        toks = self._tokens
        end = len(toks) - 1  # the n-grams ending at the old last token now have a successor
        if end >= 0:
            for n in range(1, min(self._max, end + 1) + 1):
                self._index[n - 1][tuple(toks[end - n + 1 : end + 1])] = end
        toks.append(token)

    def draft(self, k: int) -> tuple[int, tuple[int, ...]]:
        """Up to `k` proposed next tokens and the length n of the match that found them
        (0 and () when no suffix of `MIN_NGRAM`..`MAX_NGRAM` tokens occurred before)."""
        toks = self._tokens
        last = len(toks)
        if k <= 0 or last == 0:
            return 0, ()
        for n in range(min(self._max, last), self._min - 1, -1):
            end = self._index[n - 1].get(tuple(toks[last - n :]))
            if end is None:
                continue
            out: list[int] = []
            src = end + 1
            for _ in range(k):
                out.append(toks[src] if src < last else out[src - last])
                src += 1
            return n, tuple(out)
        return 0, ()
