"""Recognise the generative-export layout of a `.tflite` LLM from its signatures (litert-torch's
generative converter, the litert-community "ekv" models): prefill, decode, optional KV windows
and verify signatures, and the KV layout. The naming rules: `discover_layout`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from agent.base.errors import ModelFormatError
from agent.model.tflite.info import ModelFile, SignatureIO, TensorInfo

_PREFILL = re.compile(r"^prefill(?:_(\d+))?$")
_VERIFY = re.compile(r"^verify(?:_(\d+))?$")
_WINDOW = re.compile(r"^kv(\d+)_(decode|prefill(?:_\d+)?|verify(?:_\d+)?)$")
_KV = re.compile(r"^kv_cache_([kv])_(\d+)$")
# Windows a single-length model gets at load (`agent.runtime.prepare.windows` adds them):
SMALLEST_WINDOW: Final = 256  # below this the full KV read is already a small part of a step
# a prefill call's fixed cost is ~8 positions (docs/PERFORMANCE.md): a quarter of 32 tokens' work
WINDOW_PREFILL_MIN: Final = 32
# A window of at least this many rows also gets a longer prefill length (`window_prefills`).
WINDOW_LONG_PREFILL: Final = 512


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one session's KV cache."""

    name: str  # "default" | "transposed"
    num_layers: int
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    k_seq_axis: int
    v_seq_axis: int
    dtype: str
    itemsize: int

    @property
    def context_length(self) -> int:
        return self.k_shape[self.k_seq_axis]

    @property
    def bytes_per_session(self) -> int:
        k = v = self.itemsize
        for d in self.k_shape:
            k *= d
        for d in self.v_shape:
            v *= d
        return self.num_layers * (k + v)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_session // self.context_length

    def names(self) -> list[str]:
        out = []
        for i in range(self.num_layers):
            out += [f"kv_cache_k_{i}", f"kv_cache_v_{i}"]
        return out


@dataclass(frozen=True, slots=True)
class Signature:
    key: str
    length: int  # tokens per call
    has_mask: bool
    mask_shape: tuple[int, ...]
    has_logits: bool
    other_inputs: tuple[str, ...]  # inputs beyond tokens/input_pos/mask/kv (must be none)
    logits_shape: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Window:
    """Signatures that run over one KV length: the full one or a shorter KV window."""

    decode: Signature
    prefill: tuple[Signature, ...]  # sorted by length; may be empty for a window
    kv: KVLayout
    verify: tuple[Signature, ...] = ()  # sorted by length; never used for prefill

    @property
    def length(self) -> int:
        return self.kv.context_length

    @property
    def signatures(self) -> tuple[Signature, ...]:
        return (*self.prefill, self.decode, *self.verify)


@dataclass(frozen=True, slots=True)
class ModelLayout:
    decode: Signature
    prefill: tuple[Signature, ...]  # sorted by length
    kv: KVLayout
    vocab_size: int
    windows: tuple[Window, ...] = ()  # shorter KV windows, by length
    verify: tuple[Signature, ...] = ()  # the full length's verify signatures, by length

    @property
    def context_length(self) -> int:
        return self.kv.context_length

    @property
    def full(self) -> Window:
        return Window(self.decode, self.prefill, self.kv, self.verify)

    def all_windows(self) -> tuple[Window, ...]:
        """The KV windows by length, the full length last."""
        return (*self.windows, self.full)

    def window_for(self, rows: int) -> int:
        """Index into `all_windows` of the smallest window holding `rows` cache rows."""
        for i, w in enumerate(self.windows):
            if rows <= w.length:
                return i
        return len(self.windows)


def _fail(what: str, found: str) -> ModelFormatError:
    return ModelFormatError(
        f"not a generative LLM export: expected {what}; found {found}. "
        "edge-agent reads the litert-torch generative format (prefill_<N> and decode "
        "signatures with tokens, input_pos and kv_cache_k_<i>/kv_cache_v_<i>)"
    )


def _kv_tensors(sig: SignatureIO) -> dict[tuple[str, int], TensorInfo]:
    found = {}
    for t in sig.inputs:
        m = _KV.match(t.name)
        if m:
            found[(m.group(1), int(m.group(2)))] = t
    return found


def _kv_layout(sig: SignatureIO, context_length: int | None) -> KVLayout:
    kv = _kv_tensors(sig)
    if not kv:
        raise _fail(
            "kv_cache_k_<i>/kv_cache_v_<i> inputs", f"inputs {[t.name for t in sig.inputs]}"
        )
    layers = 1 + max(i for _, i in kv)
    for i in range(layers):
        for part in "kv":
            if (part, i) not in kv:
                raise _fail(f"kv_cache_{part}_{i}", f"layers 0..{layers - 1} with a gap")
    k, v = kv[("k", 0)], kv[("v", 0)]
    if len(k.shape) != 4 or len(v.shape) != 4:
        raise _fail("rank-4 KV tensors", f"K {k.shape}, V {v.shape}")
    if any(kv[("k", i)].shape != k.shape or kv[("v", i)].shape != v.shape for i in range(layers)):
        raise _fail("the same KV shape in every layer", "layers of different shapes")
    if k.shape == v.shape:
        # default: [1, kv_max, heads, dim]; transposed with kv_max == dim also looks like this,
        # so a known context length decides.
        if context_length is not None and k.shape[1] != context_length:
            if k.shape[2] == context_length:
                name, ks, vs = "transposed", 2, 3
            else:
                raise _fail(f"a KV axis of length {context_length}", f"K {k.shape}")
        else:
            name, ks, vs = "default", 1, 1
    elif k.shape[2] == v.shape[3] and k.shape[3] == v.shape[2] and k.shape[1] == v.shape[1]:
        name, ks, vs = "transposed", 2, 3
    else:
        raise _fail("default or transposed KV layout", f"K {k.shape}, V {v.shape}")
    if k.dtype != "float32" and k.dtype != "float16":
        raise _fail("float KV cache", f"{k.dtype}")
    return KVLayout(
        name, layers, k.shape, v.shape, ks, vs, k.dtype, 4 if k.dtype == "float32" else 2
    )


def _signature(sig: SignatureIO, length_hint: int | None) -> Signature:
    tokens = sig.input("tokens")
    pos = sig.input("input_pos")
    if tokens is None or pos is None:
        raise _fail(f"{sig.key}: tokens and input_pos inputs", f"{[t.name for t in sig.inputs]}")
    if tokens.dtype != "int32" or pos.dtype != "int32":
        raise _fail(f"{sig.key}: int32 tokens/input_pos", f"{tokens.dtype}/{pos.dtype}")
    length = tokens.shape[-1] if tokens.shape else 1
    if length_hint is not None and length != length_hint:
        raise _fail(f"{sig.key}: tokens of length {length_hint}", f"shape {tokens.shape}")
    mask = sig.input("mask")
    logits = sig.output("logits")
    known = {"tokens", "input_pos", "mask"}
    other = tuple(t.name for t in sig.inputs if t.name not in known and not _KV.match(t.name))
    if other:
        raise _fail(f"{sig.key}: no inputs beyond tokens, input_pos, mask and KV", f"{other}")
    for t in sig.inputs:
        if _KV.match(t.name) and sig.output(t.name) is None:
            raise _fail(f"{sig.key}: output {t.name} (the updated cache)", "no such output")
    return Signature(
        key=sig.key,
        length=length,
        has_mask=mask is not None,
        mask_shape=mask.shape if mask is not None else (),
        has_logits=logits is not None,
        other_inputs=other,
        logits_shape=logits.shape if logits is not None else (),
    )


def discover_layout(model: ModelFile, context_length: int | None = None) -> ModelLayout:
    """Find the decode/prefill signatures, KV layout and vocabulary of an exported LLM.

    The format (litert-torch's generative converter, the litert-community "ekv" models): one
    ``decode`` signature and one or more ``prefill_<N>`` signatures; inputs ``tokens`` [1, N] int32,
    ``input_pos`` [N] int32, optional ``mask``, and per layer ``kv_cache_k_<i>`` /
    ``kv_cache_v_<i>`` that come back updated as outputs of the same name; ``decode`` also outputs
    ``logits`` [1, 1, vocab].

    KV layouts: *default* K and V are [1, kv_max, kv_heads, head_dim]; *transposed* K is [1,
    kv_heads, kv_max, head_dim] and V is [1, kv_heads, head_dim, kv_max].

    KV windows (optional): ``kv<L>_decode`` and ``kv<L>_prefill_<N>`` are the same model over a
    shorter KV length L (see `agent.toolchain.export`). Each window, and the full length, is a
    `Window`: its own signatures and KV shapes.

    Verify signatures (optional): ``verify_<N>`` (``kv<L>_verify_<N>`` in a window, and a plain
    ``verify``, LiteRT-LM's name, whose N is its tokens' length) take N tokens like a prefill and
    also output ``logits`` [1, N, vocab], one row per position: what speculative decoding checks N-1
    drafted tokens with. They are never part of a prefill plan.
    """
    by_key = {s.key: s for s in model.signatures}
    found = sorted(by_key) or ["no signatures"]
    if "decode" not in by_key:
        raise _fail("a 'decode' signature", f"signatures {found}")
    decode_io = by_key["decode"]
    decode = _signature(decode_io, 1)
    logits = decode_io.output("logits")
    if logits is None or not logits.shape:
        raise _fail(
            "decode output 'logits' [1, 1, vocab]", f"{[t.name for t in decode_io.outputs]}"
        )
    kv = _kv_layout(decode_io, context_length)
    prefill = []
    for key, sig in by_key.items():
        m = _PREFILL.match(key)
        if not m:
            continue
        p = _signature(sig, int(m.group(1)) if m.group(1) else None)
        if _kv_layout(sig, kv.context_length) != kv:
            raise _fail(f"{key}: the same KV layout as decode", "a different one")
        prefill.append(p)
    if not prefill:
        raise _fail("at least one 'prefill_<N>' signature", f"signatures {found}")
    prefill.sort(key=lambda s: s.length)
    vocab = logits.shape[-1]
    verify = _verify(by_key, "", kv, vocab)
    return ModelLayout(decode, tuple(prefill), kv, vocab, _windows(by_key, kv, vocab), verify)


def _verify(
    by_key: dict[str, SignatureIO], prefix: str, kv: KVLayout, vocab: int
) -> tuple[Signature, ...]:
    """The verify signatures named ``<prefix>verify[_<N>]``, checked: logits [1, N, vocab] and
    the KV layout of the decode signature they sit beside."""
    found: dict[int, Signature] = {}
    for key, sig in by_key.items():
        m = _VERIFY.match(key[len(prefix) :]) if key.startswith(prefix) else None
        if m is None:
            continue
        v = _signature(sig, int(m.group(1)) if m.group(1) else None)
        want = (1, v.length, vocab)
        if v.logits_shape != want:
            got = f"logits {list(v.logits_shape)}" if v.has_logits else "no 'logits' output"
            raise _fail(f"{key}: a verify signature's logits {list(want)}", got)
        if _kv_layout(sig, kv.context_length) != kv:
            raise _fail(f"{key}: the same KV layout as {prefix}decode", "a different one")
        if v.length in found:
            raise _fail(f"{key}: one verify signature per length", f"{found[v.length].key} too")
        found[v.length] = v
    return tuple(found[n] for n in sorted(found))


def _windows(by_key: dict[str, SignatureIO], full: KVLayout, vocab: int) -> tuple[Window, ...]:
    """The ``kv<L>_*`` signature sets, checked against the full-length ones."""
    groups: dict[int, dict[str, SignatureIO]] = {}
    for key, sig in by_key.items():
        m = _WINDOW.match(key)
        if m:
            groups.setdefault(int(m.group(1)), {})[m.group(2)] = sig
    windows = []
    for length, sigs in sorted(groups.items()):
        where = f"KV window kv{length}"
        if not 1 < length < full.context_length:
            raise _fail(f"{where}: shorter than the full KV ({full.context_length})", f"{length}")
        if "decode" not in sigs:
            raise _fail(f"{where}: a kv{length}_decode signature", f"{sorted(sigs)}")
        decode = _signature(sigs["decode"], 1)
        logits = sigs["decode"].output("logits")
        if logits is None or not logits.shape or logits.shape[-1] != vocab:
            raise _fail(f"{where}: decode logits over the vocabulary ({vocab})", f"{logits}")
        kv = _kv_layout(sigs["decode"], length)
        same = (kv.name, kv.num_layers, kv.dtype) == (full.name, full.num_layers, full.dtype)
        if not same or kv.context_length != length:
            raise _fail(f"{where}: the full KV layout over {length} rows", f"K {kv.k_shape}")
        prefill = []
        for name, sig in sigs.items():
            m = _PREFILL.match(name)
            if m:
                p = _signature(sig, int(m.group(1)) if m.group(1) else None)
                if _kv_layout(sig, length) != kv:
                    raise _fail(f"{where}: {name} with the window's KV layout", "a different one")
                prefill.append(p)
        named = {f"kv{length}_{name}": sig for name, sig in sigs.items()}
        verify = _verify(named, f"kv{length}_", kv, vocab)
        windows.append(Window(decode, tuple(sorted(prefill, key=lambda s: s.length)), kv, verify))
    return tuple(windows)


def window_prefill(lengths: Iterable[int], window: int) -> int | None:
    """The one prefill length a window added at load gets: the shortest below the window of
    at least `WINDOW_PREFILL_MIN` tokens, else the longest below it (None: no prefill fits).

    Every signature costs memory of its own, whatever its KV length: its tensors and their
    quantization tables, LiteRT's copy of its graph, XNNPACK's operators (~7.5 MiB each on
    SmolLM-135M's shape, measured). A window is there for decode; one prefill length fills it
    (a prompt that moves it up, a turn), and a longer one besides would make long prompts in a
    window a little faster (docs/PERFORMANCE.md) for another ~7.5 MiB per window.
    """
    below = sorted(n for n in lengths if n < window)
    if not below:
        return None
    return next((n for n in below if n >= WINDOW_PREFILL_MIN), below[-1])


def window_prefills(lengths: Iterable[int], window: int) -> tuple[int, ...]:
    """The prefill lengths a window added at load gets: `window_prefill`'s, and in a window of
    `WINDOW_LONG_PREFILL` rows or more also the longest of at most a quarter of the window.

    A long prompt in a window otherwise runs as many short calls: a 448-token prompt in the
    512-row window took 14 calls of 32 tokens, ~1.5x the CPU time of 3x128 + 2x32 in that
    window (SmolLM-135M shape, int8, 2 threads; the full length's 3x128 + 2x32 over 1024 rows
    costs ~1.4x too), which put edge-agent's time to first token behind LiteRT-LM's
    (docs/PERFORMANCE.md, "Prefill time to first token"). It costs one signature (~7.5 MiB on
    that shape) per such window.
    """
    lengths = sorted(set(lengths))
    first = window_prefill(lengths, window)
    if first is None:
        return ()
    longer = [n for n in lengths if first < n <= window // 4]
    return (first, longer[-1]) if window >= WINDOW_LONG_PREFILL and longer else (first,)


def auto_windows(kv_length: int) -> tuple[int, ...]:
    """The windows a KV length gets: 256, 512, ... up to half of it (none below 512)."""
    out: list[int] = []
    w = SMALLEST_WINDOW
    while 2 * w <= kv_length:
        out.append(w)
        w *= 2
    return tuple(out)
