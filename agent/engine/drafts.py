"""Prompt lookup: draft tokens for speculative decoding from the request's own token history.

The history is the prompt (with a session's earlier turns, the whole conversation) and the
text generated so far. For the last n tokens (n from `MAX_NGRAM` = 3 down to `min_ngram`) the
most recent earlier occurrence is found and the tokens that followed it are proposed. Strongest
where local apps use LLMs: editing code the prompt holds, summarising, answering from a given
document, where the answer copies runs of the input.

The index is one dict per n from each n-gram (packed into one int) to the end of its latest
occurrence, updated as tokens are appended: three dict writes per token, no rescans (this runs
on every decode step, so it is kept to a few hundred nanoseconds). An n-gram enters the index
only once a token follows it, so a lookup never finds the suffix itself and a found occurrence
always has a continuation. A continuation that runs into the suffix is read on through the
draft being built: a repeating pattern is extrapolated (``a b a b a`` → ``b a b a``). Token ids
above 2^21 (no public vocabulary is that large) could make two n-grams share a key: that only
makes a draft fail its verification, never a wrong token.

`min_ngram` defaults to 1: a single-token match is the weakest evidence, but on short or
repetitive text it is often the only one, and the policy (`agent.engine.speculation`) measures
acceptance per match length, so unigram drafts that do not pay are simply not used while
longer matches still are.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_NGRAM = 3
MIN_NGRAM = 1
_BITS = 21  # bits per token id in a packed n-gram key


class PromptLookup:
    """An incremental n-gram index over one request's tokens."""

    __slots__ = ("_min", "_one", "_three", "_tokens", "_two")

    def __init__(self, tokens: Iterable[int] = (), *, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= MAX_NGRAM:
            raise ValueError(f"min_ngram = {min_ngram}: need 1 <= min_ngram <= {MAX_NGRAM}")
        self._min = min_ngram
        self._tokens: list[int] = []
        # n-gram key → index of its last token, for its latest occurrence with a successor
        self._one: dict[int, int] = {}
        self._two: dict[int, int] = {}
        self._three: dict[int, int] = {}
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
            a = toks[end]
            self._one[a] = end
            if end >= 1:
                ab = toks[end - 1] << _BITS | a
                self._two[ab] = end
                if end >= 2:
                    self._three[toks[end - 2] << 2 * _BITS | ab] = end
        toks.append(token)

    def draft(self, k: int) -> tuple[int, tuple[int, ...]]:
        """Up to `k` proposed next tokens and the length n of the match that found them
        (0 and () when no suffix of `min_ngram`..3 tokens occurred before)."""
        toks = self._tokens
        last = len(toks)
        if k <= 0 or last == 0:
            return 0, ()
        a = toks[-1]
        end = None
        order = 0
        if last >= 3:
            ab = toks[-2] << _BITS | a
            end = self._three.get(toks[-3] << 2 * _BITS | ab)
            order = 3
            if end is None and self._min <= 2:
                end, order = self._two.get(ab), 2
        elif last == 2 and self._min <= 2:
            end, order = self._two.get(toks[-2] << _BITS | a), 2
        if end is None and self._min <= 1:
            end, order = self._one.get(a), 1
        if end is None:
            return 0, ()
        out = toks[end + 1 : end + 1 + k]
        while len(out) < k:  # the continuation reached the end: it repeats with its period
            out += out[: k - len(out)]
        return order, tuple(out)
