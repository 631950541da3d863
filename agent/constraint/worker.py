"""Where llguidance compiles: one worker thread with a big stack (its compiler recurses; see
`agent.constraint.limits`), one compile at a time, and a deadline for whoever waits on it. A
compile still running at the deadline finishes on the worker and its result is dropped.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from agent.base.errors import InvalidRequest, Overloaded

log = logging.getLogger(__name__)

T = TypeVar("T")

STACK_BYTES = 64 << 20  # the worker's stack: see the module docstring
COMPILE_TIMEOUT_S = 10.0  # a caller's wait, queueing included
QUEUE_MAX = 8  # compiles waiting beyond this: Overloaded (429 / RESOURCE_EXHAUSTED)
GATE_ENV = "EDGE_AGENT_COMPILE_GATE"  # tests only (with EDGE_AGENT_FAULT_INJECTION=1): a FIFO


@dataclass(eq=False)
class _Job(Generic[T]):
    fn: Callable[[], T]
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None
    error: BaseException | None = None
    abandoned: bool = False


def rss_bytes() -> int:
    """The process's resident set now (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class CompileWorker:
    """Runs functions on one long-lived thread with a `STACK_BYTES` stack, in order."""

    def __init__(self, name: str = "edge-agent-constraints", queue_max: int = QUEUE_MAX) -> None:
        self._jobs: queue.Queue[_Job[Any]] = queue.Queue(queue_max)
        old = threading.stack_size(STACK_BYTES)
        try:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
        finally:
            threading.stack_size(old)

    def run(self, fn: Callable[[], T], timeout: float = COMPILE_TIMEOUT_S, what: str = "") -> T:
        """`fn()` as run on the worker; its exception re-raised here. Overloaded when
        `queue_max` compiles already wait, InvalidRequest when `timeout` passes first."""
        job: _Job[T] = _Job(fn)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise Overloaded(
                f"{self._jobs.maxsize} constraints are waiting to be compiled; try again later"
            ) from None
        if not job.done.wait(timeout):
            job.abandoned = True
            log.warning("constraint compile abandoned after %.1f s: %s", timeout, what)
            raise InvalidRequest(
                f"{what or 'the constraint'} did not compile within {timeout:g} s; "
                "simplify it (fewer alternatives, smaller repetitions)"
            )
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            _test_gate()
            try:
                job.result = job.fn()
            except BaseException as exc:  # handed to the waiting caller
                job.error = exc
            if job.abandoned:
                job.result = None
                log.info("constraint compile finished after its caller gave up; dropped")
            job.done.set()
            self._jobs.task_done()

    def drain(self) -> None:
        """Until every job queued so far has run (abandoned ones too)."""
        self._jobs.join()


def _test_gate() -> None:
    """Fault injection for tests: wait until the FIFO named by `GATE_ENV` is written to, so a
    test can hold a compile in progress while it checks that the daemon still answers."""
    path = os.environ.get(GATE_ENV)
    if not path or os.environ.get("EDGE_AGENT_FAULT_INJECTION") != "1":
        return
    log.warning("constraint compile waiting at the test gate %s", path)
    with open(path, "rb") as f:
        f.read(1)
