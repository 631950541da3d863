"""The timing rounds: under the bench lock, every (quant, threads) cell and the read bandwidth,
alternating the order between rounds and retrying a measurement other processes contended."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.gemv.measure import CpuMeter, measure

LOCK = Path("/tmp/bench.lock")
RETRY_PAUSE_S = 10.0


@contextlib.contextmanager
def bench_lock(path: Path = LOCK) -> Iterator[None]:
    """Exclusive flock (the one `flock /tmp/bench.lock ...` takes) while timing."""
    with open(path, "a") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = time.monotonic() - t0
        if waited > 1:
            print(f"[gemv] waited {waited:.0f}s for {path}", flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _quiet(
    run: Callable[[], dict[str, Any]], max_foreign: float, retries: int, label: str
) -> dict[str, Any]:
    """`run()` again (after a pause) while other processes used more than `max_foreign` cores
    during it, at most `retries` more times; the last result, with its attempt count."""
    for attempt in range(retries + 1):
        res = run()
        res["attempts"] = attempt + 1
        if res["foreign_cores"] <= max_foreign:
            break
        if attempt < retries:
            print(f"  ({label}: other processes used {res['foreign_cores']:.2f} cores; again)")
            time.sleep(RETRY_PAUSE_S)
    return res


def _bandwidth(threads: int) -> dict[str, Any]:
    from benchmarks.peer.roofline import read_bandwidth

    with CpuMeter() as meter:
        gbps = read_bandwidth(threads)
    return {"gbps": gbps, "foreign_cores": meter.foreign_cores}


def run_rounds(
    paths: dict[str, Path], threads: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """`args.rounds` rounds; in each, every (quant, threads) cell and the read bandwidth per
    thread count, the order alternating between rounds; contended measurements are retried."""
    cells: dict[str, list[dict[str, Any]]] = {}
    bandwidth: dict[str, list[dict[str, Any]]] = {}
    order = [(q, t) for q in paths for t in threads]
    for r in range(args.rounds):
        print(f"[gemv] round {r + 1}/{args.rounds}", flush=True)
        for q, t in order if r % 2 == 0 else order[::-1]:
            res = _quiet(
                functools.partial(measure, paths[q], t, args.repeats),
                args.max_foreign,
                args.retries,
                f"{q} {t}t",
            )
            cells.setdefault(f"{q}/{t}", []).append(res)
            print(
                f"  {q} {t}t: {res['ms']:.2f} ms, {res['gbps']:.2f} GB/s "
                f"(other processes: {res['foreign_cores']:.2f} cores)",
                flush=True,
            )
        for t in threads if r % 2 == 0 else threads[::-1]:
            bw = _quiet(
                functools.partial(_bandwidth, t), args.max_foreign, args.retries, f"bandwidth {t}t"
            )
            bandwidth.setdefault(str(t), []).append(bw)
            print(
                f"  read bandwidth {t}t: {bw['gbps']:.2f} GB/s "
                f"(other processes: {bw['foreign_cores']:.2f} cores)",
                flush=True,
            )
    return {"cells": cells, "bandwidth": bandwidth}
