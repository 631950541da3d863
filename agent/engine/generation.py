"""One request's state and its unit of work: a prefill chunk or one decoded token.

`Generation.step()` does exactly one unit so that a scheduler can interleave many requests;
`Engine.generate` simply steps one request to the end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from agent.engine.sampler import Sampler
from agent.engine.types import RequestStats, TokenEvent
from agent.runtime.runner import KVCache, Runner
from agent.runtime.tokenizer import DetokenizeStream


class StopMatcher:
    """Finds stop strings in streamed text, holding back only what could still start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was reached)."""
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
            return [self._finish("cancelled", error="deadline exceeded")]
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
        return self._decode_one()

    def _decode_one(self) -> list[TokenEvent]:
        logits = self._runner.decode(self._kv, self._next_input, self._pos)
        self._pos += 1
        token = self._sampler(logits[: self._vocab])
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
        )
