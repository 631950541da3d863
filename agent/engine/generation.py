"""One request's state and its unit of work: a prefill chunk or one decoded token.

`Generation.step()` does exactly one unit so that a scheduler can interleave many requests;
`Engine.generate` simply steps one request to the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from agent.base.errors import NonFiniteLogits
from agent.engine.sampler import Sampler
from agent.engine.speculation import Speculator
from agent.engine.stats import DEADLINE_EXCEEDED
from agent.engine.types import RequestStats, TokenEvent
from agent.runtime.runner import KVCache, Runner
from agent.tokenizer.base import DetokenizeStream


class StopMatcher:
    """Finds stop strings in streamed text, holding back only what could still start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was reached)."""
        if not self._stops:
            return text, False
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class Generation:
    """Prefill a prompt in chunks, then decode token by token, emitting `TokenEvent`s."""

    def __init__(
        self,
        runner: Runner,
        kv: KVCache,
        detok: DetokenizeStream,
        prompt_ids: Sequence[int],
        *,
        start_pos: int,
        max_tokens: int,
        sampler: Sampler,
        stop: Sequence[str],
        stop_ids: frozenset[int],
        prefill_chunk: int,
        vocab: int | None = None,
        cached_tokens: int = 0,
        prefix_tokens: int = 0,
        truncated_tokens: int = 0,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
        queued_at: float | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self._runner = runner
        self._kv = kv
        self._detok = detok
        self._prompt = list(prompt_ids)
        self._pos = start_pos  # next cache row to write
        self._prefilled = 0  # prompt tokens written (all but the last go through prefill)
        self._max_tokens = max_tokens
        self._sampler = sampler
        self._stop = StopMatcher(stop)
        self._stop_ids = stop_ids
        self._chunk = prefill_chunk
        self.cancel = cancel or threading.Event()
        self._deadline = deadline  # time.monotonic() value
        self._queued_at = queued_at  # time.perf_counter() value
        self.generated: list[int] = []
        self.done = False
        self._next_input = self._prompt[-1]
        self._t0: float | None = None
        self._t_first: float | None = None
        self._t_end: float | None = None
        self._context = runner.layout.context_length
        # Rows past the tokenizer's vocabulary are padding (models round their embedding up):
        # never sample them.
        self._vocab = vocab if vocab is not None else runner.layout.vocab_size
        self._cached = cached_tokens
        self._prefix_tokens = prefix_tokens  # prompt tokens already in the KV (prefix cache)
        self._truncated = truncated_tokens
        self._logits_of: object = None  # the last decode's logits array, and its vocab rows
        self._logits_view = np.zeros(0, dtype=np.float32)
        self._spec = speculator  # None: plain decoding only

    @property
    def kv_rows(self) -> int:
        """Cache rows holding this conversation so far (the next row to write)."""
        return self._pos

    @property
    def prefilling(self) -> bool:
        return self._prefilled < len(self._prompt) - 1

    def step(self) -> list[TokenEvent]:
        """Do one unit of work; returns the events it produced (possibly none)."""
        if self.done:
            return []
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if self.cancel.is_set():
            return [self._finish("cancelled")]
        if self._deadline is not None and time.monotonic() > self._deadline:
            return [self._finish("cancelled", error=DEADLINE_EXCEEDED)]
        if self.prefilling:
            if self._prefilled == 0:
                # the whole prompt and the first generated row, in the smallest KV window
                self._runner.reserve(self._kv, self._pos + len(self._prompt), self._pos)
            n = min(self._chunk, len(self._prompt) - 1 - self._prefilled)
            chunk = self._prompt[self._prefilled : self._prefilled + n]
            self._runner.prefill(self._kv, chunk, self._pos)
            self._prefilled += n
            self._pos += n
            return []
        if self._spec is not None and self.generated:  # the first token as soon as it can be
            events = self._speculate(self._spec)
            if events is not None:
                return events
        return self._decode_one()

    def _speculate(self, spec: Speculator) -> list[TokenEvent] | None:
        """One verify call of the last token and the drafted ones; None: decode plainly (no
        draft, the policy declined, or no verify signature fits here).

        Each row is sampled in order with the request's own sampler, exactly as plain decoding
        samples that position (same RNG draws, the grammar and the penalties' counts advancing
        on each emitted token: row i sees the drafts accepted before it); a draft holds while
        it equals the sampled token, and the first that does not ends the block with the
        sampled token. Stops, max_tokens and the context end are checked after
        every token as plain decoding checks them: nothing after them is emitted, and the next
        row to write is the position after the last emitted token (rows past it are junk the
        next call overwrites). Non-finite logits in a later row end the block before it, so
        the tokens before it are emitted and the next step raises at that row, as plain
        decoding does."""
        budget = min(self._max_tokens - len(self.generated), self._context - self._pos) - 1
        drafts = spec.propose(self._kv, self.generated, budget)
        if not drafts:
            return None
        logits = self._runner.verify(self._kv, [self._next_input, *drafts], self._pos)
        if logits is None:
            spec.missed()
            return None
        ids: list[int] = []
        text = ""
        accepted = checked = 0
        end: tuple[str, bool] | None = None  # finish reason, and whether to flush held text
        for i in range(len(drafts) + 1):
            try:
                token = self._sampler(logits[i, : self._vocab])
            except NonFiniteLogits:
                if i == 0:
                    raise
                break  # emit what came before, as plain decoding would; the next step raises
            if self._t_first is None:
                self._t_first = time.perf_counter()
            self._pos += 1
            hit = False
            if i < len(drafts):
                checked += 1
                hit = token == drafts[i]
                accepted += hit
            if token in self._stop_ids:
                end = ("stop", True)
                break
            self.generated.append(token)
            self._next_input = token
            ids.append(token)
            piece, stopped = self._stop.feed(self._detok.push(token))
            text += piece
            if stopped:
                end = ("stop", False)
                break
            if len(self.generated) >= self._max_tokens or self._pos >= self._context:
                end = ("length", True)
                break
            if not hit:
                break
        spec.record(len(drafts), checked, accepted)
        if end is not None:
            return [self._finish(end[0], text, tuple(ids), flush=end[1])]
        return [TokenEvent(text, tuple(ids))]

    def decode_input(self) -> tuple[KVCache, int, int] | None:
        """(cache, input token, position) of this request's next step when it is a plain
        decode step another caller may run (`Runner.decode_batch`, then `take_logits`); None
        when it is anything else: done, cancelled, past its deadline, prefilling, or a request
        that speculates (its step may be a verify call)."""
        if self.done or self.prefilling or (self._spec is not None and self.generated):
            return None
        if self.cancel.is_set():
            return None
        if self._deadline is not None and time.monotonic() > self._deadline:
            return None
        if self._t0 is None:
            self._t0 = time.perf_counter()
        return self._kv, self._next_input, self._pos

    def _decode_one(self) -> list[TokenEvent]:
        return self.take_logits(self._runner.decode(self._kv, self._next_input, self._pos))

    def take_logits(self, logits: np.ndarray) -> list[TokenEvent]:
        """Finish the decode step `decode_input` described, given its logits row: sample,
        check stops and limits, and return the events (exactly what a step alone does)."""
        self._pos += 1
        if logits is not self._logits_of:  # the runner's own array: its view is made once
            self._logits_of, self._logits_view = logits, logits[: self._vocab]
        token = self._sampler(self._logits_view)
        if self._t_first is None:
            self._t_first = time.perf_counter()
        if token in self._stop_ids:
            return [self._finish("stop")]
        self.generated.append(token)
        self._next_input = token
        text, stopped = self._stop.feed(self._detok.push(token))
        if stopped:
            return [self._finish("stop", text, (token,), flush=False)]
        if len(self.generated) >= self._max_tokens or self._pos >= self._context:
            return [self._finish("length", text, (token,))]
        return [TokenEvent(text, (token,))]

    def fail(self, message: str) -> TokenEvent:
        """End the request with an error (the runtime failed under it)."""
        return self._finish("error", error=message)

    def _finish(
        self,
        reason: str,
        text: str = "",
        ids: tuple[int, ...] = (),
        *,
        flush: bool = True,
        error: str | None = None,
    ) -> TokenEvent:
        self.done = True
        self._t_end = time.perf_counter()
        if flush:
            # What was held back for a possible stop string, plus an incomplete UTF-8 tail.
            text += self._stop.flush() + self._detok.flush()
        return TokenEvent(text, ids, finish_reason=reason, stats=self.stats(), error=error)

    def stats(self) -> RequestStats:
        t0 = self._t0 or time.perf_counter()
        end = self._t_end or time.perf_counter()
        first = self._t_first or end
        prefill_s = first - t0
        decode_s = end - first
        n = len(self.generated)
        prompt = len(self._prompt) + self._prefix_tokens
        spec = self._spec
        return RequestStats(
            prompt_tokens=prompt,
            generated_tokens=n,
            ttft_ms=prefill_s * 1e3 if self._t_first else 0.0,
            prefill_ms=prefill_s * 1e3,
            decode_ms=decode_s * 1e3,
            # what was actually prefilled, over the time it took
            prefill_tok_s=(
                len(self._prompt) / prefill_s if prefill_s > 0 and self._t_first else 0.0
            ),
            # tokens after the first, over the time after the first
            decode_tok_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            accelerator=self._runner.accelerator,
            queue_ms=(t0 - self._queued_at) * 1e3 if self._queued_at is not None else 0.0,
            cached_tokens=self._cached,
            truncated_tokens=self._truncated,
            drafted_tokens=spec.drafted if spec is not None else 0,
            accepted_tokens=spec.accepted if spec is not None else 0,
            verify_calls=spec.verify_calls if spec is not None else 0,
        )
