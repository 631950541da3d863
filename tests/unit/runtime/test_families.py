"""The model-family matrix: tiny official-exporter models of every family edge-agent supports
(tests/support/families.py), in int8 and int4 block 32, both KV layouts, one and two KV heads.

For each model, the reference is a plain loop written here: numpy and ai-edge-litert's
`Interpreter` on the ORIGINAL file (prefill signature for the prompt, then decode step by step
with the KV outputs fed back, greedy argmax) and SentencePiece for the prompt's ids. No
edge-agent code takes part in it. Against it:

1. the reference itself: finite logits, greedy tokens that are not all one id;
2. edge-agent's greedy tokens, (a) in-process on the prepared copy (a profile with
   ``xnnpack_weight_cache_dir``, as on every board and in the daemon: composites inlined and
   a KV window of 256 where the runtime adds them), (b) through the daemon over gRPC, (c) from
   a session that moves to the host tier and to the disk tier between its turns, against the
   reference over the whole conversation;
3. the prepared copy's logits (its full-length and window signatures, run by the same plain
   loop) against the original's, teacher-forced, within a tolerance derived from the
   quantization.

Test ids name family, layout, KV heads and quantization: ``[gemma3-default-kv1-int8]``.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import signal
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

if importlib.util.find_spec("litert_torch") is None:  # not imported: a warm cache needs no torch
    pytest.skip("needs the toolchain extra (litert-torch)", allow_module_level=True)
pytest.importorskip("sentencepiece")

from ai_edge_litert.interpreter import Interpreter

from tests.support import families
from tests.support.families import COMBOS, QUANTIZATIONS, Combo, FamilyFactory
from tests.support.tiny_models import LEGACY

pytestmark = [
    pytest.mark.toolchain,
    pytest.mark.skipif(LEGACY, reason="the matrix runs fused int8/int4 files: ai-edge-litert only"),
]

PROMPT = "def main():\n    return 1\n"
N_TOKENS = 24
TURNS = ("def f(x):", "\n    return", "\n\nclass A:\n    def")
TURN_TOKENS = 8
MIN_BUDGET = 16 << 20  # runtime.max_num_bytes' lower bound
CASES = [(c, q) for c in COMBOS for q in QUANTIZATIONS]


def case_id(case: tuple[Combo, str]) -> str:
    return f"{case[0].id}-{case[1]}"


# ------------------------------------------------------------------ the reference loop


class PlainLoop:
    """A LiteRT-exported decoder run by the classic Interpreter's signature runners: the KV
    cache lives in numpy arrays passed in and taken back out at every call. `prefix` picks a
    set of signatures (``"kv256_"``: a KV window of a prepared copy)."""

    def __init__(self, path: Path, prefix: str = "") -> None:
        self.interpreter = Interpreter(model_path=str(path), num_threads=2)
        names = self.interpreter.get_signature_list()
        prefills = sorted(
            int(n.removeprefix(f"{prefix}prefill_"))
            for n in names
            if n.startswith(f"{prefix}prefill_") and n.removeprefix(f"{prefix}prefill_").isdigit()
        )
        if not prefills or f"{prefix}decode" not in names:
            raise AssertionError(f"{path.name}: no {prefix}prefill_<N> / {prefix}decode in {names}")
        self.prefill_len = prefills[0]
        self.prefill = self.interpreter.get_signature_runner(f"{prefix}prefill_{prefills[0]}")
        self.decoder = self.interpreter.get_signature_runner(f"{prefix}decode")
        inputs = self.decoder.get_input_details()
        self.kv = {
            n: np.zeros(d["shape"], dtype=d["dtype"])
            for n, d in inputs.items()
            if n.startswith("kv_cache_")
        }
        # K [1, kv, heads, dim] or [1, heads, kv, dim]; every KV length here exceeds both
        self.kv_len = int(max(max(a.shape[1:]) for a in self.kv.values()))
        self.pos = 0

    def _call(self, runner: Any, tokens: Sequence[int], width: int) -> dict[str, Any]:
        n = len(tokens)
        if self.pos + width > self.kv_len:
            raise AssertionError(f"position {self.pos + width} past the KV length {self.kv_len}")
        args: dict[str, Any] = {
            "tokens": np.array([list(tokens) + [0] * (width - n)], dtype=np.int32),
            "input_pos": np.arange(self.pos, self.pos + width, dtype=np.int32),
            **self.kv,
        }
        if "mask" in runner.get_input_details():
            # the causal mask litert-torch's converter builds: row t sees positions <= pos + t
            cols = np.arange(self.kv_len)[None, :]
            rows = (self.pos + np.arange(width))[:, None]
            args["mask"] = np.where(cols <= rows, 0.0, -np.inf).astype(np.float32)[None, None]
        out = runner(**args)
        for name in self.kv:
            self.kv[name] = out[name]
        self.pos += n
        return dict(out)

    def feed(self, tokens: Sequence[int]) -> None:
        """Prefill `tokens` in chunks of the prefill length (the last chunk padded: its padding
        rows lie past the position and are overwritten before anything attends to them)."""
        for i in range(0, len(tokens), self.prefill_len):
            self._call(self.prefill, tokens[i : i + self.prefill_len], self.prefill_len)

    def step(self, token: int) -> npt.NDArray[np.float32]:
        """Decode one token; returns its logits [vocab]."""
        logits = self._call(self.decoder, [token], 1)["logits"]
        return np.asarray(logits, dtype=np.float32).reshape(-1)


def sp_ids(tokenizer: Path, text: str) -> list[int]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    return list(sp.encode(text))


@dataclass(frozen=True, slots=True)
class Reference:
    tokens: tuple[tuple[int, ...], ...]  # per turn
    logits: tuple[npt.NDArray[np.float32], ...]  # every decode step's logits


def reference(path: Path, turns: Sequence[tuple[list[int], int]]) -> Reference:
    """Greedy tokens of a conversation: per turn its prompt ids and how many tokens to make.
    A turn's pending input is the previous turn's last token (never fed yet) and its ids."""
    loop = PlainLoop(path)
    out: list[tuple[int, ...]] = []
    logits: list[npt.NDArray[np.float32]] = []
    pending: list[int] = []
    for ids, n in turns:
        feed = pending + ids
        loop.feed(feed[:-1])
        token, made = feed[-1], []
        for _ in range(n):
            step = loop.step(token)
            logits.append(step)
            token = int(np.argmax(step))
            made.append(token)
        out.append(tuple(made))
        pending = [token]
    return Reference(tuple(out), tuple(logits))


def teacher_forced(path: Path, tokens: Sequence[int], prefix: str = "") -> npt.NDArray[Any]:
    """Logits of every position after a one-chunk prefill, feeding `tokens` (not argmax)."""
    loop = PlainLoop(path, prefix)
    head = loop.prefill_len
    loop.feed(tokens[:head])
    return np.stack([loop.step(t) for t in tokens[head:]])


# ------------------------------------------------------------------ the files themselves


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_derived_variants_are_what_the_converter_quantizes(
    family_factory: FamilyFactory, quantization: str
) -> None:
    """The matrix's int8 / int4 files are derived from one float conversion; litert-torch's own
    ``convert_to_tflite(quantize="dynamic_int8" | "dynamic_int4_block32")`` (the examples'
    convert scripts, how litert-community files are made) writes the very same bytes."""
    combo = families.CONVERTER_CHECK
    derived = family_factory(combo, quantization).read_bytes()
    converted = family_factory.converter_quantized(combo, quantization).read_bytes()
    assert derived == converted


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def family_factory(tmp_path_factory: pytest.TempPathFactory) -> FamilyFactory:
    return FamilyFactory(families.cache_root() or tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="module", autouse=True)
def frozen_heap() -> Iterator[None]:
    """The runtime calls gc.collect() several times per load (to give memory back, as a board
    needs); in a pytest process that holds torch and every earlier test's objects each call
    costs ~0.6 s. Freezing what exists now keeps those calls to this module's own objects."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def cache_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Combo, Path]:
    """One XNNPACK weight cache directory per (family, layout, KV heads): the engines of both
    quantizations load into it, and the daemon runs the copies they made and checked."""
    root = tmp_path_factory.mktemp("weight-caches")
    return {c: root / c.stem for c in COMBOS}


@dataclass
class Model:
    combo: Combo
    quantization: str
    original: Path
    model_dir: Path
    tokenizer: Path
    prompt_ids: list[int]
    turn_ids: list[list[int]]
    ref: Reference  # PROMPT, N_TOKENS
    conversation: Reference  # TURNS, TURN_TOKENS each


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def model(request: pytest.FixtureRequest, family_factory: FamilyFactory) -> Model:
    combo, quant = request.param
    model_dir = family_factory.model_dir(combo)
    original = model_dir / f"model_{quant}.tflite"
    tokenizer = model_dir / "tokenizer.model"
    prompt_ids = [1, *sp_ids(tokenizer, PROMPT)]  # bos 1, as the metadata says
    turn_ids = [[1, *sp_ids(tokenizer, TURNS[0])], *(sp_ids(tokenizer, t) for t in TURNS[1:])]
    return Model(
        combo,
        quant,
        original,
        model_dir,
        tokenizer,
        prompt_ids,
        turn_ids,
        reference(original, [(prompt_ids, N_TOKENS)]),
        reference(original, [(ids, TURN_TOKENS) for ids in turn_ids]),
    )


def profile_data(cache_dir: Path, **runtime: Any) -> dict[str, Any]:
    from agent.profile import profiles_dir

    with open(profiles_dir() / "generic-x86_64.toml", "rb") as f:
        data = tomllib.load(f)
    data = copy.deepcopy(data)
    data["runtime"]["xnnpack_weight_cache_dir"] = str(cache_dir)
    data["runtime"].update(runtime)
    return data


def make_profile(data: dict[str, Any], where: Path) -> Any:
    from agent.profile import parse_profile

    return parse_profile(data, where / f"{data['name']}.toml")


@pytest.fixture(scope="module")
def engine(
    model: Model, cache_dirs: dict[Combo, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """An engine on the model under the dev profile with a weight cache directory (the prepared
    copy runs) and a budget of one runtime KV cache; host tier just larger than the session
    after its first turn, so that its second spill goes to disk."""
    from agent.engine.engine import Engine, EngineLimits
    from agent.engine.loading import estimate_memory
    from agent.model.tflite.file import read_model_file
    from agent.model.tflite.layout import discover_layout

    tmp = tmp_path_factory.mktemp("engine")
    cache = cache_dirs[model.combo]
    base = make_profile(profile_data(cache), tmp)
    one = estimate_memory(base, model.model_dir, model.quantization)
    per_token = discover_layout(read_model_file(model.original)).kv.bytes_per_token
    first_turn_rows = len(model.turn_ids[0]) + TURN_TOKENS
    host = per_token * (first_turn_rows + 4)
    assert len(model.turn_ids[1]) + TURN_TOKENS > 8  # so the second turn outgrows the host tier
    # the profile's floor is 16 MiB, more than the tiny model takes: the prefix cache's budget
    # takes the rest, so that exactly one runtime KV cache fits
    prefix = max(0, MIN_BUDGET - one - host)
    data = profile_data(cache, max_num_bytes=one + host + prefix)
    data["kv"].update(host_max_bytes=host, disk_max_bytes=64 << 20, prefix_max_bytes=prefix)
    e = Engine.load(
        make_profile(data, tmp),
        model.model_dir,
        quantization=model.quantization,
        limits=EngineLimits(max_active=1, max_sessions=8),
        state_dir=tmp / "state",
    )
    assert e.memory.sessions == 1, e.memory
    e.cache_dir = cache  # type: ignore[attr-defined]
    yield e
    e.close()


def greedy(n: int) -> Any:
    from agent.engine.sampler import SamplingParams

    return SamplingParams(temperature=0.0), n


# ------------------------------------------------------------------ 1. the reference


def test_the_reference_is_finite_and_not_degenerate(model: Model) -> None:
    for ref in (model.ref, model.conversation):
        assert all(np.isfinite(x).all() for x in ref.logits), "non-finite logits"
    tokens = model.ref.tokens[0]
    assert len(set(tokens)) >= 3, f"greedy tokens nearly constant: {tokens}"
    spread = float(np.std(np.stack(model.ref.logits)))
    assert spread > 0.1, f"logits nearly flat (std {spread})"


# ------------------------------------------------------------------ 2. edge-agent's tokens


def test_in_process_greedy_tokens_equal_the_reference(model: Model, engine: Any) -> None:
    from agent.engine.types import GenerateRequest

    sampling, n = greedy(N_TOKENS)
    got = engine.complete(GenerateRequest(PROMPT, max_tokens=n, sampling=sampling))
    assert engine.encode_prompt(GenerateRequest(PROMPT)) == model.prompt_ids
    # what served is the runtime's prepared copy, not the file as exported
    assert not engine.info.prepared.startswith(("none", "refused")), engine.info.prepared
    assert list(got.token_ids) == list(model.ref.tokens[0])


def test_a_session_through_the_host_and_disk_tiers_continues_as_the_reference(
    model: Model, engine: Any
) -> None:
    from agent.engine.types import GenerateRequest

    sampling, n = greedy(TURN_TOKENS)

    def turn(sid: str, text: str) -> tuple[int, ...]:
        r = GenerateRequest(text, max_tokens=n, sampling=sampling, session_id=sid)
        return tuple(engine.complete(r).token_ids)

    def tier(sid: str) -> str:
        return next(s.tier for s in engine.list_sessions() if s.id == sid)

    def push_out() -> None:  # the only runtime cache goes to another session
        other = engine.create_session()
        turn(other, "import os")
        engine.delete_session(other)

    sid = engine.create_session()
    got = [turn(sid, TURNS[0])]
    push_out()
    assert tier(sid) == "host"
    got.append(turn(sid, TURNS[1]))
    push_out()
    assert tier(sid) == "disk"  # larger than the host tier now
    got.append(turn(sid, TURNS[2]))
    stats = engine.tier_stats()
    assert stats.restores_host >= 1 and stats.restores_disk >= 1 and stats.lost == 0
    engine.delete_session(sid)
    assert got == list(model.conversation.tokens)


class Daemons:
    """One daemon per (family, layout, KV heads), started on its first quantization and
    reloaded for the next one by SIGHUP after a config change, as an operator would switch
    it: a daemon start costs more than the rest of a case's tests together."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.current: tuple[Combo, str, Any] | None = None

    def get(self, model: Model, cache_dir: Path) -> Any:
        """A daemon serving `model`, with the weight cache directory its engine loaded into."""
        from agent.profile import profiles_dir
        from tests.support.daemon_harness import Daemon

        config = f'[model]\nquantization = "{model.quantization}"\n'
        if self.current is not None and self.current[0] != model.combo:
            self.close()
        if self.current is None:
            tmp = self.tmp_path_factory.mktemp("daemon")
            text = (profiles_dir() / "generic-x86_64.toml").read_text()
            entry = f"xnnpack_weight_cache_dir = {str(cache_dir)!r}\n"
            profile = tmp / "profile" / "generic-x86_64.toml"
            profile.parent.mkdir()
            profile.write_text(text.replace("[runtime]\n", "[runtime]\n" + entry, 1))
            d = Daemon(tmp, model.model_dir, config, profile=str(profile))
            self.current = (model.combo, model.quantization, d)
        combo, quantization, d = self.current
        if quantization != model.quantization:
            d.config.write_text(config)
            since = len(d.notify.messages)
            d.signal(signal.SIGHUP)
            d.notify.wait_for("READY", "1", since=since)
            self.current = (combo, model.quantization, d)
        return d

    def close(self) -> None:
        if self.current is not None:
            d = self.current[2]
            self.current = None
            assert d.stop() == 0, d.read_log()


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    manager = Daemons(tmp_path_factory)
    yield manager
    manager.close()


def test_daemon_greedy_tokens_equal_the_reference(
    model: Model, engine: Any, daemons: Daemons
) -> None:
    """The daemon runs the prepared copy the in-process load made and checked (the engine
    fixture), in the same weight cache directory, as a board's second start does."""
    from agent.api.grpc.client import build_request

    daemon = daemons.get(model, engine.cache_dir)
    c = daemon.client()
    try:
        info = c.info()
        assert info["quantization"] == model.quantization
        req = build_request(
            PROMPT,
            None,
            max_tokens=N_TOKENS,
            temperature=0.0,
            top_k=None,
            top_p=None,
            seed=None,
            stop=[],
        )
        reply = c.generate(req)
    finally:
        c.close()
    assert reply.error == "" and reply.finish_reason == "length", reply
    assert list(reply.tokens) == list(model.ref.tokens[0]), daemon.read_log()[-2000:]


# ------------------------------------------------------------------ 3. the prepared copy's logits


def logit_tolerance(quantization: str, logits: npt.NDArray[Any]) -> float:
    """Both files hold the same quantized weights; what may differ is float rounding and, in
    dynamic-range kernels, which int8 step an activation rounds to. One step of a logit's
    input is 1/127 of its range; allow a few such steps of the logits' own scale."""
    del quantization  # int8 and int4 weights both run with int8 dynamic-range activations
    return 4.0 * float(np.abs(logits).max()) / 127.0


def prepared_copies(cache_dir: Path, sha: str) -> list[Path]:
    return sorted(p for p in cache_dir.glob(f"{sha}.p*.tflite") if p.is_file())


def test_the_prepared_copy_computes_what_the_original_does(model: Model, engine: Any) -> None:
    copies = prepared_copies(engine.cache_dir, engine.info.sha256)
    if not copies:
        why = {p.name: p.read_text().strip() for p in engine.cache_dir.glob("*.refused")}
        files = sorted(p.name for p in engine.cache_dir.iterdir())
        pytest.fail(f"no prepared copy was kept (refused: {why or 'no reason kept'}): {files}")
    tokens = model.prompt_ids + list(model.ref.tokens[0])
    want = teacher_forced(model.original, tokens)
    assert np.isfinite(want).all()
    tol = logit_tolerance(model.quantization, want)
    for path in copies:
        names = Interpreter(model_path=str(path)).get_signature_list()
        prefixes = ["", *sorted({n[: n.index("_") + 1] for n in names if n.startswith("kv")})]
        for prefix in prefixes:
            got = teacher_forced(path, tokens, prefix)
            err = float(np.abs(got - want).max())
            worst = int(np.abs(got - want).max(axis=1).argmax())
            assert err <= tol, (
                f"{path.name} {prefix or 'full length'}: logits off by {err:.3f} "
                f"(tolerance {tol:.3f}), worst at step {worst}"
            )
