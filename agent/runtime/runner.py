"""What the engine runs a model through (`Runner`, `KVCache`), and the part both execution
paths share (`RunnerBase`): prefill plans, decode, verify, KV rows and KV windows on top of one
``_run(signature, kv, tokens, pos)`` per path (`agent.runtime.compiled`,
`agent.runtime.interpreter`), every call timed (`agent.runtime.costs`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from time import perf_counter
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from agent.base.errors import ModelFormatError, RuntimeFailure
from agent.model.tflite.layout import ModelLayout, Signature, Window
from agent.runtime import batch
from agent.runtime.costs import CallCosts
from agent.runtime.plan import plan_prefill
from agent.runtime.prepare import cachefiles

log = logging.getLogger("agent.runtime.litert")  # the load's lines keep the front door's name

Logits = npt.NDArray[np.float32]
_NEG = np.float32(-np.inf)
VERIFY_CHECK_HEAD = 1  # rows decoded before the verify calls of `check_verify`

_K = TypeVar("_K")


class KVCache(Protocol):
    """One session's KV cache as the runner holds it (opaque above the runtime)."""

    @property
    def nbytes(self) -> int: ...


class Runner(Protocol):
    """What the engine needs from a runtime."""

    layout: ModelLayout
    accelerator: str
    costs: CallCosts  # measured seconds per signature call

    @property
    def verify_lengths(self) -> tuple[int, ...]:
        """Tokens per call of the verify signatures (N: the last accepted token and N-1
        drafts); () when the model has none or speculation is not allowed for this load."""
        ...

    def new_kv(self) -> KVCache: ...
    def reserve(self, kv: KVCache, rows: int, keep: int) -> None: ...
    def read_rows(self, kv: KVCache, rows: int) -> dict[str, npt.NDArray[Any]]: ...
    def write_rows(self, kv: KVCache, arrays: Mapping[str, npt.NDArray[Any]]) -> None: ...
    def prefill(self, kv: KVCache, tokens: Sequence[int], start: int) -> None: ...
    def decode(self, kv: KVCache, token: int, pos: int) -> Logits:
        """The next token's logits: the runner's own array, which its next call overwrites
        (copy it to keep it)."""
        ...

    def verify(self, kv: KVCache, tokens: Sequence[int], pos: int) -> Logits | None:
        """Logits [len(tokens), vocab] of every position of `tokens` written at `pos`, as
        `decode` one by one would give them (the runner's own array: copy it to keep it), or
        None when no verify signature fits there (the end of the context, a window without
        them, or none allowed)."""
        ...

    def close(self) -> None: ...


def causal_mask(
    rows: int, first_pos: int, ctx: int, shape: tuple[int, ...]
) -> npt.NDArray[np.float32]:
    """Causal mask: row i may attend to positions <= first_pos + i."""
    cols = np.arange(ctx, dtype=np.int64)[None, :]
    limit = first_pos + np.arange(rows, dtype=np.int64)[:, None]
    m = np.where(cols <= limit, np.float32(0), _NEG).astype(np.float32)
    return m.reshape(shape)


class RunnerBase(Generic[_K]):
    """Prefill plans, decode and KV rows on top of one `_run(signature, kv, tokens, pos)` per
    path. A cache runs in one KV window at a time (`_window`); a path with windows moves it to
    another in `_switch`."""

    layout: ModelLayout
    accelerator: str
    _kv_type: type[_K]
    _held: Path | None = None  # <weight cache dir>/<cache key> of the files it runs
    _verify_ok = False  # set by `check_verify` (or `allow_verify`, a cached check)
    verify_problem: str | None = None  # why speculation is off, when a check found a reason
    _verify_cached: tuple[ModelLayout | None, tuple[int, ...]] = (None, ())
    # batched decode (`agent.runtime.batch`): the batch signatures by KV window length, found
    # by a path that can run them; used only once `check_batch` (or `allow_batch`) passed
    _batch: Mapping[int, tuple[batch.BatchSignature, ...]] = MappingProxyType({})
    _batch_ok = False
    batch_problem: str | None = "this execution path does not batch"

    def __init__(self) -> None:
        self.costs = CallCosts(self._signature_for)

    def hold_cache_files(self, directory: Path | None, cache_key: str | None) -> None:
        """Keep the files of `cache_key` in weight cache `directory` while this runner is open:
        another load into the directory (an update loaded beside this model) prunes the rest."""
        if directory is None or cache_key is None or self._held is not None:
            return
        self._held = key = directory / cache_key
        cachefiles.hold(key)

    def _release_cache_files(self) -> None:
        key, self._held = self._held, None
        if key is None:
            return
        cachefiles.release(key)

    def _run(self, sig: Signature, kv: _K, tokens: Sequence[int], pos: int) -> None:
        raise NotImplementedError

    def _call(self, sig: Signature, kv: _K, tokens: Sequence[int], pos: int) -> None:
        """`_run`, timed into `costs`."""
        t = perf_counter()
        self._run(sig, kv, tokens, pos)
        self.costs.add(sig.key, perf_counter() - t)

    def _logits(self, sig: Signature) -> Logits:
        """The logits output of decode signature `sig` after its run."""
        raise NotImplementedError

    def _own(self, kv: KVCache) -> _K:
        """A KV handle is only valid with the runner that made it."""
        if not isinstance(kv, self._kv_type):
            raise TypeError(f"KV cache {type(kv).__name__} does not belong to this runner")
        return kv

    def new_kv(self) -> _K:
        raise NotImplementedError

    def _window(self, kv: _K) -> Window:
        """The KV window a cache is in now."""
        return self.layout.full

    def _switch(self, kv: _K, window: int, keep: int) -> None:
        """Move a cache to window `window` (index into `all_windows`), keeping `keep` rows."""
        raise NotImplementedError

    def _full(self, kv: _K, name: str) -> npt.NDArray[Any]:
        """One KV tensor of a cache as a host array (a copy or a view)."""
        raise NotImplementedError

    def _store(self, kv: _K, name: str, array: npt.NDArray[Any]) -> None:
        """Replace one KV tensor of a cache."""
        raise NotImplementedError

    def _seq_axis(self, name: str) -> int:
        kv = self.layout.kv
        return kv.k_seq_axis if "_k_" in name else kv.v_seq_axis

    def _seq_index(self, name: str, rows: int) -> tuple[Any, ...]:
        """Index of the first `rows` cache rows of one KV tensor."""
        index: list[Any] = [slice(None)] * len(self.layout.kv.k_shape)
        index[self._seq_axis(name)] = slice(0, rows)
        return tuple(index)

    def reserve(self, kv: KVCache, rows: int, keep: int) -> None:
        """Put a cache in the smallest KV window that holds `rows` rows, keeping its first
        `keep` rows (copied when it moves). Without windows there is nothing to do."""
        self._reserve(self._own(kv), rows, keep)

    def _reserve(self, own: _K, rows: int, keep: int) -> None:
        if self.layout.windows:
            target = self.layout.window_for(rows)
            if self.layout.all_windows()[target].length != self._window(own).length:
                self._switch(own, target, min(keep, rows))

    def _grow(self, own: _K, rows: int, keep: int) -> None:
        """`reserve`, but only ever up: a running request outgrowing its window."""
        if rows > self._window(own).length:
            self._reserve(own, rows, keep)

    def read_rows(self, kv: KVCache, rows: int) -> dict[str, npt.NDArray[Any]]:
        """A copy of the first `rows` cache rows of every KV tensor: what a spill keeps."""
        return self._read_rows(self._own(kv), rows)

    def _read_rows(self, own: _K, rows: int) -> dict[str, npt.NDArray[Any]]:
        # Always a copy: `_full` of a host cache is the live array, and a slice of it can be
        # contiguous already (one KV head), where ascontiguousarray would return a view that
        # the next user of the cache overwrites.
        return {
            name: np.array(self._full(own, name)[self._seq_index(name, rows)], order="C")
            for name in self.layout.kv.names()
        }

    def write_rows(self, kv: KVCache, arrays: Mapping[str, npt.NDArray[Any]]) -> None:
        """Put rows saved by `read_rows` back at the start of a cache; later rows are zeroed
        (the causal mask hides them either way)."""
        own = self._own(kv)
        if set(arrays) != set(self.layout.kv.names()):
            raise ModelFormatError("saved KV rows do not match this model's KV tensors")
        some = next(iter(arrays))
        self._reserve(own, arrays[some].shape[self._seq_axis(some)], 0)  # rows from `arrays`
        self._put_rows(own, arrays)

    def _put_rows(self, own: _K, arrays: Mapping[str, npt.NDArray[Any]]) -> None:
        layout = self._window(own).kv
        for name, rows in arrays.items():
            shape = layout.k_shape if "_k_" in name else layout.v_shape
            full = np.zeros(shape, dtype=np.float32)
            index = self._seq_index(name, rows.shape[self._seq_axis(name)])
            try:
                full[index] = rows
            except ValueError as exc:
                raise ModelFormatError(f"saved KV rows of {name} do not fit: {exc}") from exc
            self._store(own, name, full)

    def prefill(self, kv: KVCache, tokens: Sequence[int], start: int) -> None:
        own = self._own(kv)
        self._grow(own, start + len(tokens), start)
        for call in plan_prefill(self._window(own), len(tokens), start):
            chunk = tokens[call.offset : call.offset + call.count]
            self._call(call.signature, own, chunk, start + call.offset)

    def check_windows(self, tolerance: float = 1e-3) -> str | None:
        """Run every signature of each KV window, then one decode step, on the same tokens as
        the full length's signature of the same length; the first failure, or difference in
        the logits beyond `tolerance` (relative to the largest logit), as text, or None.
        Measured on the SmolLM-shaped int8 and int4 files: the logits are bit-identical."""
        windows = self.layout.all_windows()
        top = len(windows) - 1
        longest = max((p.length for w in windows[:-1] for p in w.prefill), default=0)
        tokens = [(7919 * i + 11) % self.layout.vocab_size for i in range(longest + 1)]

        def logits(index: int, n: int) -> Logits:
            """Prefill `n` tokens with window `index`'s signature of that length, then decode."""
            window = windows[index]
            kv = self.new_kv()
            if self._window(kv).length != window.length:
                self._switch(kv, index, 0)
            if n:
                self._call(next(p for p in window.prefill if p.length == n), kv, tokens[:n], 0)
            self._call(window.decode, kv, [tokens[n]], n)
            return self._logits(window.decode).copy()

        want: dict[int, Logits] = {}
        for index, window in enumerate(windows[:-1]):
            for n in (0, *(p.length for p in window.prefill)):
                if n not in want:
                    want[n] = logits(top, n)
                try:
                    got = logits(index, n)
                except RuntimeFailure as exc:
                    return f"window kv{window.length} after {n} prefilled tokens: {exc}"
                scale = max(1.0, float(np.max(np.abs(want[n]))))
                err = float(np.max(np.abs(got - want[n])))
                if not err <= tolerance * scale:  # NaN fails too
                    return (
                        f"window kv{window.length} after {n} prefilled tokens: logits differ "
                        f"from the full length by {err:.3g} (largest logit {scale:.3g})"
                    )
        return None

    def decode(self, kv: KVCache, token: int, pos: int) -> Logits:
        own = self._own(kv)
        self._grow(own, pos + 1, pos)
        sig = self._window(own).decode
        self._call(sig, own, [token], pos)
        return self._logits(sig)

    # -- batched decode: several sessions' decode steps in one call ---------------------------
    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Rows per call of the batch signatures that passed the first-load check; () when the
        file has none, this path cannot run them or they failed (`batch_problem` says why)."""
        if not self._batch_ok:
            return ()
        return tuple(sorted({s.rows for sigs in self._batch.values() for s in sigs}))

    def allow_batch(self, problem: str | None) -> None:
        """Take the outcome of an earlier load's `check_batch` of the same files and path."""
        self._batch_ok = problem is None and bool(self._batch)
        if self._batch:
            self.batch_problem = problem

    def check_batch(self) -> str | None:
        """Whether every batch signature gives each row decode's logits and KV rows bit for
        bit (`agent.runtime.batch.check_batch`); batching is used only then. The first
        difference as text, or None."""
        self._batch_ok = False
        if not self._batch:
            return self.batch_problem
        try:
            problem = batch.check_batch(self)
        except RuntimeFailure as exc:
            problem = str(exc)
        self.batch_problem = problem
        self._batch_ok = problem is None
        return problem

    def decode_batch(
        self, kvs: Sequence[KVCache], tokens: Sequence[int], positions: Sequence[int]
    ) -> Logits:
        """Logits [len(kvs), vocab]: one decode step of each cache, `tokens[i]` at
        `positions[i]`, exactly what `decode` gives each alone. Rows of one KV window run in
        one call of a batch signature of that many rows where the file has one (the runner's
        own array then: copy it to keep it); the rest run one by one."""
        return batch.decode_rows(self, [self._own(kv) for kv in kvs], tokens, positions)  # type: ignore[no-any-return]

    def _call_batch(
        self,
        sig: batch.BatchSignature,
        owns: Sequence[_K],
        tokens: Sequence[int],
        positions: Sequence[int],
    ) -> None:
        t = perf_counter()
        self._run_batch(sig, owns, tokens, positions)
        self.costs.add(sig.key, perf_counter() - t)

    def _run_batch(
        self,
        sig: batch.BatchSignature,
        owns: Sequence[_K],
        tokens: Sequence[int],
        positions: Sequence[int],
    ) -> None:
        raise NotImplementedError

    def _batch_logits(self, sig: batch.BatchSignature) -> Logits:
        raise NotImplementedError

    # -- speculation: verify signatures ------------------------------------------------------
    @property
    def verify_lengths(self) -> tuple[int, ...]:
        if not self._verify_ok:
            return ()
        layout, lengths = self._verify_cached
        if layout is not self.layout:  # a load may drop the windows after the check
            lengths = tuple(sorted({s.length for w in self.layout.all_windows() for s in w.verify}))
            self._verify_cached = (self.layout, lengths)
        return lengths

    def allow_verify(self, problem: str | None) -> None:
        """Take the outcome of an earlier load's `check_verify` of the same files and path
        (None: allowed)."""
        self._verify_ok, self.verify_problem = problem is None, problem

    def verify(self, kv: KVCache, tokens: Sequence[int], pos: int) -> Logits | None:
        lengths = self.verify_lengths
        if not lengths:
            return None
        n = len(tokens)
        if not 1 <= n <= lengths[-1]:
            raise ValueError(f"verify takes 1..{lengths[-1]} tokens, not {n}")
        own = self._own(kv)
        current = self._window(own).length
        for index, window in enumerate(self.layout.all_windows()):
            if window.length < current:
                continue  # a cache only moves up
            if not window.verify:
                return None  # no speculation in this window
            # padded positions write rows past the real ones: they must fit the cache too
            # (the model's DYNAMIC_UPDATE_SLICE would clamp and overwrite valid rows)
            sig = next((s for s in window.verify if n <= s.length <= window.length - pos), None)
            if sig is None:
                continue
            if window.length != current:
                self._switch(own, index, pos)
            self._call(sig, own, tokens, pos)
            return self._logits(sig).reshape(sig.length, -1)[:n]
        return None

    def _signature_for(self, kv: KVCache, n: int) -> str | None:
        """The signature `kv`'s window runs `n` tokens with now: decode for 1, else the shortest
        verify signature holding them (what `costs.decode_s` / `verify_s` ask about)."""
        window = self._window(self._own(kv))
        if n == 1:
            return window.decode.key
        return next((s.key for s in window.verify if s.length >= n), None)

    def check_verify(self) -> str | None:
        """In every KV window with verify signatures, decode a few tokens, then run each verify
        signature on the next ones (all its positions real, and one padded) and compare its
        logits rows and KV rows with decode one by one on the same tokens. Speculation is
        allowed (`verify_lengths`) only when every one is bit-identical: XNNPACK's are
        (measured), LiteRT's builtin kernels differ by ~1e-6. The first difference as text,
        or None."""
        self._verify_ok, self.verify_problem = False, None
        windows = self.layout.all_windows()
        for index, window in enumerate(windows):
            if window.verify:
                try:
                    problem = self._check_verify_window(index, window)
                except RuntimeFailure as exc:
                    problem = f"window kv{window.length}: {exc}"
                if problem is not None:
                    self.verify_problem = problem
                    return problem
        self._verify_ok = any(w.verify for w in windows)
        return None

    def _check_verify_window(self, index: int, window: Window) -> str | None:
        longest = window.verify[-1].length
        head = max(0, min(VERIFY_CHECK_HEAD, window.length - longest))
        tokens = [(7919 * i + 11) % self.layout.vocab_size for i in range(head + longest)]

        kv = self.new_kv()
        if self._window(kv).length != window.length:
            self._switch(kv, index, 0)
        want = []
        for i in range(head + longest):
            self._call(window.decode, kv, [tokens[i]], i)
            want.append(self._logits(window.decode).copy())
        want_rows = self._read_rows(kv, head + longest)
        # The verify calls run on the same cache: each rewrites the rows from `head` on, from
        # the first `head` rows, which decode wrote and nothing rewrites.
        worst, where = 0.0, ""
        for sig in window.verify:
            for n in sorted({sig.length, sig.length - 1}):
                self._call(sig, kv, tokens[head : head + n], head)
                got = self._logits(sig).reshape(sig.length, -1)[:n]
                err = _difference(got, np.stack(want[head : head + n])[:, : got.shape[1]])
                rows = self._read_rows(kv, head + n)
                for name, array in rows.items():
                    wanted = want_rows[name][self._seq_index(name, head + n)]
                    err = max(err, _difference(array, wanted))
                if err > worst:
                    worst, where = err, f"{sig.key} with {n} tokens"
        if where:
            return (
                f"window kv{window.length}: {where} differs from decode one by one by "
                f"{worst:.3g} (logits or KV rows)"
            )
        return None


def _difference(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> float:
    """0.0 when bit-identical, else the largest absolute difference (inf: NaN or shapes)."""
    if a.shape != b.shape:
        return float("inf")
    if np.array_equal(a, b):
        return 0.0
    err = float(np.max(np.abs(a.astype(np.float64) - b)))
    return err if err > 0.0 else float("inf")  # not equal, yet no difference: a NaN
