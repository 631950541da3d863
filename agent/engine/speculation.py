"""When to speculate and with how many drafted tokens: one request's policy.

A speculative step feeds the last token and k drafted ones through a verify signature of N
tokens (N >= k + 1; one pass over the weights) and keeps the drafts up to the first one the
sampler disagrees with, plus the token it sampled there (`agent.engine.generation`). With a
per-token acceptance probability a, a draft of k tokens yields on average
``E(k) = 1 + a + a^2 + ... + a^k`` tokens. A plain decode step yields 1 token at cost ``c1``
(the runner's measured mean of the decode signature the cache uses now), a verify call of N
tokens costs ``cN`` (its measured mean); the Python around either is per emitted token in both
and cancels out. So a step speculates with the N that maximises ``E(k_N) / cN`` when
``E(k_N) * c1 > MARGIN * cN``, and decodes plainly otherwise.

The acceptance is measured per request and per match length of the drafter
(`agent.engine.drafts`: a 3-token match predicts better than a 1-token one): an exponentially
weighted count of accepted and checked drafts (`DECAY` per verify call, so a document quoted
mid-answer turns speculation back on) over a prior of `PRIOR_ACCEPTED` / `PRIOR_CHECKED`. When
the policy declines (open-ended text: the drafts keep failing) it stops looking for drafts for
`PROBE_MIN` decode steps, then probes once with the cheapest verify signature that would pay if
every draft held, at the next decline, doubling the wait up to `PROBE_MAX` steps while the
probes fail, and waiting at least long enough that a failed probe's extra ``cN - c1`` is at most
`PROBE_BUDGET` of the decode time between probes: open-ended text stays within a few percent of
plain decoding. When no verify call could pay even at full acceptance (a verify of N tokens
costing more than N decode steps, as on the tiny test models) it never probes. Backing off
costs the drafter's index update alone, a small fraction of a decode step. A
signature not measured yet (its first call pays lazy initialisation and is not counted) is
assumed to cost what decode does, so it gets measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agent.base.errors import InvalidRequest
from agent.engine.drafts import MAX_NGRAM, PromptLookup
from agent.profile.schema import SPECULATION_MODES, SPECULATION_UNAVAILABLE
from agent.runtime.runner import KVCache, Runner

MARGIN = 1.05  # speculate only when expected tokens/s beats plain decode by this factor
DECAY = 0.9  # weight of the older acceptance counts at each verify call
PRIOR_ACCEPTED = 1.0  # the first request's prior: one accepted draft in two
PRIOR_CHECKED = 2.0  # the weight of a request's prior, in checked drafts
SHARED_DECAY = 0.98  # the engine-wide acceptance follows the last ~50 verify calls
PROBE_MIN = 8  # decode steps without looking for drafts after the policy first declines
PROBE_MAX = 64  # the longest wait between probes (unless PROBE_BUDGET asks for longer)
PROBE_BUDGET = 0.02  # failed probes cost at most this share of the decode steps between them


class Costs(Protocol):
    """The runner's measured call costs (`agent.runtime.runner`): seconds or None (unmeasured)."""

    def decode_s(self, kv: KVCache) -> float | None: ...
    def verify_s(self, kv: KVCache, n: int) -> float | None: ...


def speculation_mode(asked: str | None, default: str) -> str:
    """A request's speculation (its own, else the profile's), or InvalidRequest naming it."""
    mode = default if asked is None else asked
    if mode == SPECULATION_UNAVAILABLE:
        raise InvalidRequest(
            "speculation 'draft' (a second, smaller draft model) is not available in this "
            "version; use 'ngram' or 'off'"
        )
    if mode not in SPECULATION_MODES:
        raise InvalidRequest(f"speculation = {mode!r}; allowed: 'off', 'ngram'")
    return mode


def speculator_for(
    mode: str, runner: Runner, history: Sequence[int], shared: Acceptance | None = None
) -> Speculator | None:
    """The request's speculator, or None: speculation off, or the loaded model has no verify
    signature it may use (none in the file, or the load check found verify not bit-identical
    to decode: the runtime logged why once)."""
    if mode != "ngram" or not runner.verify_lengths:
        return None
    return Speculator(runner.costs, runner.verify_lengths, history, shared)


def expected_tokens(acceptance: float, k: int) -> float:
    """Mean tokens a verify call of k drafts yields: the accepted ones plus the sampled one."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def break_even(cost_ratio: float, k: int) -> float | None:
    """The per-token acceptance at which a verify call of k drafts costing `cost_ratio` decode
    steps yields tokens as fast as plain decoding (``E(k) == cost_ratio``), or None when no
    acceptance does (the call costs more than k + 1 steps). For benchmark reports."""
    if cost_ratio <= 1.0:
        return 0.0
    if cost_ratio > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost_ratio else (lo, mid)
    return hi


@dataclass(slots=True)
class _Order:
    """Acceptance of the drafts found by one match length (weighted counts over a prior)."""

    accepted: float = 0.0
    checked: float = 0.0
    prior: float = PRIOR_ACCEPTED / PRIOR_CHECKED

    def acceptance(self) -> float:
        return (self.accepted + self.prior * PRIOR_CHECKED) / (self.checked + PRIOR_CHECKED)

    def add(self, checked: int, accepted: int, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.checked = decay * self.checked + checked


class Acceptance:
    """What the engine's earlier requests saw, per match length: a new request's prior. So
    on a workload of open-ended text a new request does not try failing drafts again first,
    and on one that quotes its input it speculates from its first draft. Engine thread only."""

    def __init__(self) -> None:
        self._orders = [_Order() for _ in range(MAX_NGRAM)]

    def priors(self) -> list[float]:
        return [o.acceptance() for o in self._orders]

    def add(self, order: int, checked: int, accepted: int) -> None:
        self._orders[order - 1].add(checked, accepted, SHARED_DECAY)


class Speculator:
    """One request's drafter, policy and counters. `propose` before a decode step gives the
    drafts to verify (empty: decode plainly); `record` after the step says how many held."""

    def __init__(
        self,
        costs: Costs,
        verify_lengths: Sequence[int],
        history: Sequence[int],
        shared: Acceptance | None = None,
    ) -> None:
        self._costs = costs
        self._shared = shared
        self._lengths = tuple(sorted(n for n in verify_lengths if n >= 2))
        self._max_k = self._lengths[-1] - 1 if self._lengths else 0
        self._history = history  # indexed on the first proposal, off the admission path
        self._lookup: PromptLookup | None = None
        self._seen = 0  # generated tokens already in the index
        priors = shared.priors() if shared is not None else [PRIOR_ACCEPTED / PRIOR_CHECKED] * 3
        self._orders = [_Order(prior=p) for p in priors]
        self._order = 0  # match length of the last proposal
        self._wait = 0  # decode steps to go without looking for drafts (backing off)
        self._due = False  # the policy declined before: the next decline probes
        self._interval = PROBE_MIN
        self.drafted = 0
        self.accepted = 0
        self.verify_calls = 0

    def propose(self, kv: KVCache, generated: Sequence[int], budget: int) -> tuple[int, ...]:
        """Drafts for the next step: at most `budget` (tokens the request may still emit,
        minus the one every step emits), or () for a plain decode step. Runs before every
        decode step, so the common cases (backing off, no draft) are a few operations."""
        look = self._lookup
        if look is None:
            look = self._lookup = PromptLookup(self._history)
            self._history = ()
        seen = self._seen
        if seen < len(generated):
            if seen + 1 == len(generated):
                look.append(generated[seen])
            else:
                look.extend(generated[seen:])
            self._seen = len(generated)
        if self._wait > 0:
            self._wait -= 1
            return ()
        if budget < 1 or not self._lengths:
            return ()
        order, draft = look.draft(min(self._max_k, budget))
        if not draft:
            return ()
        c1 = self._costs.decode_s(kv)
        if c1 is None:  # nothing measured yet: decode, which measures it
            return ()
        k = self._choose(kv, c1, self._orders[order - 1].acceptance(), len(draft))
        if k == 0:
            k, ratio = self._probe(kv, c1, len(draft))
            if k == 0:  # no verify call would pay even if every draft held
                if self._probe(kv, c1, self._max_k)[0] == 0:  # nor would a longest one
                    self._wait = PROBE_MAX
                return ()
            # back off; after the wait, a decline probes, and failed probes stay a small share
            # of the time (the first wait too: a request may be short)
            due, self._due = self._due, True
            if not due:  # the first decline: probe soon (a draft right after a prompt often
                self._wait = self._interval  # fails where the text goes on quoting it later)
                return ()
            self._interval = min(2 * self._interval, PROBE_MAX)
            self._wait = max(self._interval, math.ceil((ratio - 1.0) / PROBE_BUDGET))
        else:
            self._due, self._interval = False, PROBE_MIN
        self._order = order
        return draft[:k]

    def _choose(self, kv: KVCache, c1: float, acceptance: float, available: int) -> int:
        """The number of drafts to verify (0: plain decode is expected to be faster)."""
        best_k, best = 0, 1.0 / c1 * MARGIN
        for n in self._lengths:
            k = min(n - 1, available)
            cost = self._costs.verify_s(kv, k + 1)  # the signature the call would use
            rate = expected_tokens(acceptance, k) / (c1 if cost is None else cost)
            if rate > best:
                best_k, best = k, rate
            if k == available:  # a longer signature only pads the same draft
                break
        return best_k

    def _probe(self, kv: KVCache, c1: float, available: int) -> tuple[int, float]:
        """The drafts of the cheapest verify call that would pay if all of them held, and its
        cost in decode steps; (0, 0.0) when none would."""
        for n in self._lengths:
            k = min(n - 1, available)
            cost = self._costs.verify_s(kv, k + 1)
            cost = c1 if cost is None else cost
            if (k + 1) * c1 > MARGIN * cost:
                return k, cost / c1
            if k == available:
                break
        return 0, 0.0

    def missed(self) -> None:
        """The runtime had no verify signature for the proposal (the end of the context, a KV
        window without them): look again only after the longest wait."""
        self._wait = PROBE_MAX

    def record(self, drafted: int, checked: int, accepted: int) -> None:
        """A verify call of `drafted` drafts: the sampler compared the first `checked` (it
        stops at the first mismatch, or at a stop), and the first `accepted` held."""
        self._orders[self._order - 1].add(checked, accepted, DECAY)
        if self._shared is not None:
            self._shared.add(self._order, checked, accepted)
        if accepted == drafted > 0:
            # every draft held (a probe that found the text quoting its input again): look at
            # the next step instead of sitting out the back-off the probe was sent with
            self._wait, self._due, self._interval = 0, False, PROBE_MIN
        self.drafted += drafted
        self.accepted += accepted
        self.verify_calls += 1
