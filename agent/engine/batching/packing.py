"""Packed decode: running requests at a plain decode step share one batched runtime call.

When the request whose turn it is would decode one token, the requests whose turns come
right after it (`Scheduler.follow`) and that would also decode one token join it, up to the
model's largest batch signature: one `Runner.decode_batch` call, then each row goes to its own
request's `Generation.take_logits`. The runtime gives each row decode's logits bit for bit (it
checks that at the first load and offers no batch sizes otherwise), and each request keeps
its own sampler RNG, grammar and penalties, so a request's tokens are exactly those it gets
alone. Prefill chunks and speculative requests' steps are never packed: they stay steps of
their own, interleaved as before. Rows are bound per call, so a cancelled or finished request
is simply not in the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from agent.engine.generation import Generation
from agent.engine.request import Prepared
from agent.engine.scheduler import Scheduler
from agent.engine.types import TokenEvent
from agent.runtime.runner import KVCache, Runner, RunnerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Row:
    """One request's place in a packed call: its cache, input token and position."""

    request: Prepared
    kv: KVCache
    token: int
    pos: int


def _row(p: Prepared) -> Row | None:
    gen = p.generation
    step = gen.decode_input() if gen is not None else None
    return None if step is None else Row(p, *step)


class Packing:
    """Whether and how wide this engine packs decode steps; counts what it packed."""

    def __init__(self, runner: Runner, enabled: bool) -> None:
        # a runner that is not the runtime's own (a scripted one) has no batched decode
        self._runner = runner if isinstance(runner, RunnerBase) else None
        sizes = self._runner.batch_sizes if self._runner is not None else ()
        self.rows = max(sizes) if enabled and sizes else 1  # requests per packed step
        if not enabled:
            self.problem = "turned off (EngineLimits.batch_decode)"
        elif self._runner is None:
            self.problem = "this runner does not batch"
        else:
            self.problem = "" if sizes else (self._runner.batch_problem or "no batch signatures")
        self.sizes = sizes if self.rows > 1 else ()
        self.steps = 0  # packed steps run
        self.packed_rows = 0  # request-steps they ran
        if self.rows > 1:
            log.info("packed decode on: up to %d requests per step %s", self.rows, sizes)
        else:
            log.info("packed decode off: %s", self.problem)

    def group(
        self, sched: Scheduler[Prepared], first: Prepared, ready: Callable[[Prepared], bool]
    ) -> list[Row]:
        """The rows of `first`'s step, `first` first, when it is a plain decode step that
        others join (call under the scheduler's lock, right after `sched.next`); [] otherwise:
        `first` steps alone."""
        if self.rows < 2:
            return []
        head = _row(first)
        if head is None:
            return []
        rows: list[Row] = [head]

        def joins(p: Prepared) -> bool:
            row = _row(p)
            if row is not None:
                rows.append(row)
            return row is not None

        if not sched.follow(ready, joins, self.rows - 1):
            return []  # alone: its own step (a request alone decodes on until an event)
        return rows

    def info(self) -> dict[str, Any]:
        """ModelInfo's fields saying whether and how this engine packs."""
        return {"batch_sizes": self.sizes, "batch_problem": self.problem}

    def step(self, rows: list[Row], run: Callable[[Prepared, Work], object]) -> None:
        """One decode step of every row in one runtime call; row i's logits go to its own
        request's `take_logits`, in row order, through `run` (the engine's unit of work: error
        handling, retiring, events). A runtime failure fails every request in the call."""
        assert self._runner is not None  # rows only when it batches
        try:
            logits = self._runner.decode_batch(
                [r.kv for r in rows], [r.token for r in rows], [r.pos for r in rows]
            )
        except Exception as exc:  # the runtime failed under all of them
            log.exception("packed decode of %d requests failed", len(rows))
            error = f"{type(exc).__name__}: {exc}"
            for r in rows:
                run(r.request, partial(_fail, r.request, error))
            return
        self.steps += 1
        self.packed_rows += len(rows)
        for i, r in enumerate(rows):
            run(r.request, partial(_take, r.request, logits[i]))


Work = Callable[[], list[TokenEvent]]


def _gen(p: Prepared) -> Generation:
    assert p.generation is not None
    return p.generation


def _take(p: Prepared, logits: np.ndarray) -> list[TokenEvent]:
    return _gen(p).take_logits(logits)


def _fail(p: Prepared, error: str) -> list[TokenEvent]:
    return [_gen(p).fail(error)]
