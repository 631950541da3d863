"""Batched decode on the runtime side: find a file's ``decode_batch_<B>`` signatures
(`agent.toolchain.batch` exports them), run several sessions' decode steps through them
(`decode_rows`), and check at the first load that each row computes what single-row ``decode``
computes, bit for bit (`check_batch`): a batch that gave a request other tokens than it gets
alone would be a silent wrong answer, so a file that fails is served one request at a time.

A batch signature binds each row's own KV tensors (``r<b>_kv_cache_k_<i>``...), so a session
keeps its buffers whichever rows it shares a call with; rows run in the same KV window.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.model.tflite.layout import ModelLayout, Window

_BATCH = re.compile(r"^(?:kv(\d+)_)?decode_batch_(\d+)$")
BATCH_CHECK_HISTORY = 2  # decode steps a check row b runs first: b * this + 1 (rows differ)


@dataclass(frozen=True, slots=True)
class BatchSignature:
    """One ``[kv<L>_]decode_batch_<B>`` signature: `rows` sessions' decode steps in one call."""

    key: str
    rows: int
    window: int  # the KV length its rows run in
    has_mask: bool
    mask_shape: tuple[int, ...]
    vocab: int


def row_kv_name(row: int, name: str) -> str:
    """Row `row`'s name of KV tensor `name` in a batch signature (``r1_kv_cache_k_0``)."""
    return f"r{row}_{name}"


Details = Callable[[str], tuple[Mapping[str, Any], Mapping[str, Any]]]


def discover_batch(
    keys: Iterable[str], details: Details, layout: ModelLayout
) -> tuple[dict[int, tuple[BatchSignature, ...]], list[str]]:
    """The well-formed batch signatures among `keys` by KV window length (sorted by rows), and
    one line per malformed one (it is not used). `details(key)` gives a signature's (inputs,
    outputs) as ``{name: {"shape": ..., "dtype": ...}}``."""
    windows = {w.length: w for w in layout.all_windows()}
    found: dict[int, list[BatchSignature]] = {}
    problems = []
    for key in sorted(keys):
        m = _BATCH.match(key)
        if not m:
            continue
        length = int(m.group(1)) if m.group(1) else layout.context_length
        window = windows.get(length)
        if window is None:
            problems.append(f"{key}: no KV window of length {length}")
            continue
        rows = int(m.group(2))
        inputs, outputs = details(key)
        problem = _malformed(rows, inputs, outputs, window, layout.vocab_size)
        if problem is not None:
            problems.append(f"{key}: {problem}")
            continue
        mask = inputs.get("mask")
        shape = tuple(int(d) for d in mask["shape"]) if mask is not None else ()
        sig = BatchSignature(key, rows, length, mask is not None, shape, layout.vocab_size)
        found.setdefault(length, []).append(sig)
    return {k: tuple(sorted(v, key=lambda s: s.rows)) for k, v in found.items()}, problems


def _shape(info: Mapping[str, Any] | None) -> tuple[int, ...] | None:
    return None if info is None else tuple(int(d) for d in info["shape"])


def _malformed(
    rows: int,
    inputs: Mapping[str, Any],
    outputs: Mapping[str, Any],
    window: Window,
    vocab: int,
) -> str | None:
    if rows < 2:
        return "fewer than 2 rows"
    want = {"tokens": (rows, 1), "input_pos": (rows,)}
    for name, shape in want.items():
        if _shape(inputs.get(name)) != shape:
            return f"{name} {list(shape)} expected, found {_shape(inputs.get(name))}"
    if _shape(outputs.get("logits")) != (rows, 1, vocab):
        return f"logits {[rows, 1, vocab]} expected, found {_shape(outputs.get('logits'))}"
    if "mask" in inputs and _shape(inputs["mask"]) != (rows, 1, 1, window.length):
        return f"mask {[rows, 1, 1, window.length]} expected, found {_shape(inputs['mask'])}"
    names = set()
    for b in range(rows):
        for name in window.kv.names():
            full = row_kv_name(b, name)
            shape = window.kv.k_shape if "_k_" in name else window.kv.v_shape
            if _shape(inputs.get(full)) != shape or _shape(outputs.get(full)) != shape:
                return f"{full} {list(shape)} in and out expected"
            names.add(full)
    extra = set(inputs) - names - {"tokens", "input_pos", "mask"}
    if extra:
        return f"unknown inputs {sorted(extra)}"
    return None


def plan_rows(sizes: Sequence[int], n: int) -> list[int]:
    """How `n` rows are split into calls: the largest batch size that fits first, single-row
    decode (1) for what no batch fits. `sizes` ascending."""
    plan = []
    while n > 0:
        size = next((s for s in reversed(sizes) if s <= n), 1)
        plan.append(size)
        n -= size
    return plan


class BatchCheck:
    """The first-load check of one runner's batch signatures (see `check_batch`)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def window(self, index: int, window: Window, sig: BatchSignature) -> str | None:
        r = self.runner
        vocab = r.layout.vocab_size
        rows = sig.rows
        lengths = [1 + BATCH_CHECK_HISTORY * b for b in range(rows)]
        if max(lengths) + 1 > window.length:
            lengths = [min(n, window.length - 1) for n in lengths]
        kvs = []
        for b, n in enumerate(lengths):
            kv = r.new_kv()
            if r._window(kv).length != window.length:
                r._switch(kv, index, 0)
            for pos in range(n):
                r._call(window.decode, kv, [(7919 * (pos + 31 * b) + 11) % vocab], pos)
            kvs.append(kv)
        saved = [r._read_rows(kv, window.length) for kv in kvs]
        nexts = [(104729 * (b + 1) + 7) % vocab for b in range(rows)]
        want, want_rows = [], []
        for b, kv in enumerate(kvs):
            r._call(window.decode, kv, [nexts[b]], lengths[b])
            want.append(r._logits(window.decode).reshape(-1).copy())
            want_rows.append(r._read_rows(kv, lengths[b] + 1))
        # Each arrangement twice: rows in order and rotated, so a row computes with other
        # companions (a kernel that quantizes the whole batch at once would show here).
        for shift in range(min(rows, 2)):
            order = [(b + shift) % rows for b in range(rows)]
            for b in order:
                r._put_rows(kvs[b], saved[b])
            r._call_batch(
                sig, [kvs[b] for b in order], [nexts[b] for b in order], [lengths[b] for b in order]
            )
            got = r._batch_logits(sig).reshape(rows, -1)
            for slot, b in enumerate(order):
                if not np.array_equal(got[slot], want[b]):
                    err = float(np.max(np.abs(got[slot].astype(np.float64) - want[b])))
                    return (
                        f"{sig.key}: row {slot} (position {lengths[b]}) logits differ from "
                        f"decode by {err:.3g}"
                    )
                for name, array in r._read_rows(kvs[b], lengths[b] + 1).items():
                    if not np.array_equal(array, want_rows[b][name]):
                        return f"{sig.key}: row {slot} wrote other {name} rows than decode"
        return None


def check_batch(runner: Any) -> str | None:
    """For every batch signature: fill each row's own cache with a different history (its own
    length), decode one more token per row with ``decode``, then with the batch signature on
    the same caches (rows in order and rotated); every row's logits and KV rows must be
    bit-identical. The first difference as text, or None."""
    check = BatchCheck(runner)
    for index, window in enumerate(runner.layout.all_windows()):
        for sig in runner._batch.get(window.length, ()):
            problem = check.window(index, window, sig)
            if problem is not None:
                return f"window kv{window.length}: {problem}"
    return None


def decode_rows(
    runner: Any, owns: Sequence[Any], tokens: Sequence[int], positions: Sequence[int]
) -> Any:
    """Logits [len(owns), vocab]: one decode step of each cache (`RunnerBase.decode_batch`)."""
    n = len(owns)
    if not (len(tokens) == len(positions) == n):
        raise ValueError(f"{n} caches, {len(tokens)} tokens and {len(positions)} positions")
    if len({id(o) for o in owns}) != n:
        raise ValueError("a cache appears twice in one batch")
    for own, pos in zip(owns, positions, strict=True):
        runner._grow(own, pos + 1, pos)
    groups: dict[int, list[int]] = {}
    for i, own in enumerate(owns):
        groups.setdefault(runner._window(own).length, []).append(i)
    allowed = runner._batch if runner._batch_ok else {}
    if len(groups) == 1:
        length, rows = next(iter(groups.items()))
        sig = next((s for s in allowed.get(length, ()) if s.rows == n), None)
        if sig is not None:  # the common case: one call, the runner's own array
            runner._call_batch(sig, owns, tokens, positions)
            return runner._batch_logits(sig).reshape(n, -1)
    out = np.empty((n, runner.layout.vocab_size), dtype=np.float32)
    for length, rows in groups.items():
        sigs = {s.rows: s for s in allowed.get(length, ())}
        start = 0
        for size in plan_rows(sorted(sigs), len(rows)):
            part = rows[start : start + size]
            start += size
            if size == 1:
                i = part[0]
                sig1 = runner._window(owns[i]).decode
                runner._call(sig1, owns[i], [tokens[i]], positions[i])
                out[i] = runner._logits(sig1).reshape(-1)
                continue
            runner._call_batch(
                sigs[size],
                [owns[i] for i in part],
                [tokens[i] for i in part],
                [positions[i] for i in part],
            )
            out[part] = runner._batch_logits(sigs[size]).reshape(size, -1)
    return out
