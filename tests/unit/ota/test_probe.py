"""The quality probe on the demo model (agent.ota.probe, its engine binding in
agent.daemon.probe): its NLL equals a plain ai_edge_litert loop's over the model file, the base
model agrees with its own answers and a garbage model does not, requests beside a probe get
exactly their tokens, and its files in the state directory are bounded and never replaced when
they do not parse."""

from __future__ import annotations

import json
import math
import platform
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config.probe import ProbeConfig
from agent.daemon.probe import Patience, Prober, Yielded, base_answers, idle_model, tokenizer_id
from agent.engine.engine import Engine
from agent.engine.sampler import SamplingParams
from agent.engine.types import GenerateRequest
from agent.model.directory import demo_model_dir, load_model_dir
from agent.ota import probe as qp
from agent.profile import resolve_profile
from tests.unit.ota.test_update_canary import _decode_runner, _randomize_int8, _sp

PROFILE = "generic-aarch64" if platform.machine() == "aarch64" else "generic-x86_64"
CTX = 1024  # the demo model's context
PATIENT = 600.0  # a safety net: the probes here wait for the engine only while it is busy


def _patience(seconds: float = PATIENT) -> Patience:
    return Patience(time.monotonic() + seconds, threading.Event())


@pytest.fixture(scope="module")
def garbage_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with every int8 weight random: finite logits, garbage text."""
    from tests.system.test_updates import _copy_variant
    from tests.unit.ota.test_bundle import _write_meta

    d = tmp_path_factory.mktemp("probe-garbage") / "garbage"
    _copy_variant(demo_model_dir(), d, "1.2.0")
    _randomize_int8(d / "model_int8.tflite")
    _write_meta(d, load_model_dir(demo_model_dir()), "1.2.0")
    return d


@pytest.fixture(scope="module")
def base() -> Iterator[Engine]:
    engine = Engine.load(resolve_profile(PROFILE)[0], demo_model_dir(), quantization="int8")
    yield engine
    engine.stop(0)
    engine.close()


@pytest.fixture(scope="module")
def answers(base: Engine) -> qp.Answers:
    return base_answers(idle_model(base, _patience()), base, qp.load_set(), tokenizer_id(base))


def _reference_nll(ids: list[int], window: int) -> float:
    """Mean NLL of ids[1:] with the decode signature run by hand (nothing of ours), in windows
    of `window` tokens overlapping by one, each from position 0 on a fresh KV."""
    vocab = _sp(demo_model_dir()).get_piece_size()
    total, start = 0.0, 0
    while start < len(ids) - 1:
        chunk = ids[start : start + window]
        step = _decode_runner(demo_model_dir() / "model_int8.tflite")
        for pos in range(len(chunk) - 1):
            logits = step(chunk[pos], pos)[:vocab].astype("float64")
            top = float(logits.max())
            lse = top + math.log(float(sum(math.exp(x - top) for x in logits)))
            total += lse - logits[chunk[pos + 1]]
        start += len(chunk) - 1
    return total / (len(ids) - 1)


def test_the_nll_is_a_plain_litert_loops(base: Engine) -> None:
    pset = qp.load_set()
    model = idle_model(base, _patience())
    n = len(pset.prompts)
    empty = qp.Answers("0" * 64, ("",) * n, "0" * 64, ((),) * n)
    figures = qp.measure(model, pset, empty, CTX, tokenizer_id(base))
    sp, meta = _sp(demo_model_dir()), load_model_dir(demo_model_dir())
    ids = [meta.bos_id, *sp.encode(pset.text)]
    assert figures.nll_tokens == len(ids) - 1 > 150
    assert figures.nll_per_token == pytest.approx(_reference_nll(ids, CTX), abs=1e-4)
    assert figures.canary_tokens == 0  # empty answers: nothing to agree with
    # a model whose context is shorter than the text scores it in windows
    windowed, tokens = qp.text_nll(model, pset.text, 64)
    assert tokens == figures.nll_tokens
    assert windowed == pytest.approx(_reference_nll(ids, 64), abs=1e-4)


def test_the_base_model_agrees_with_itself_and_a_garbage_model_does_not(
    base: Engine, answers: qp.Answers, garbage_dir: Path
) -> None:
    pset = qp.load_set()
    assert all(answers.texts)
    mine = qp.measure(idle_model(base, _patience()), pset, answers, CTX, tokenizer_id(base))
    assert mine.canary_agreement == 1.0  # forced on its own generated ids
    assert mine.canary_tokens == sum(map(len, answers.ids)) >= len(pset.prompts) * 8
    # on another tokenizer the answers' text is encoded again (it need not give back the ids)
    encoded = qp.measure(idle_model(base, _patience()), pset, answers, CTX, "f" * 64)
    assert encoded.canary_tokens > 0 and encoded.canary_agreement > 0.5
    garbage = Engine.load(resolve_profile(PROFILE)[0], garbage_dir, quantization="int8")
    try:
        theirs = qp.measure(
            idle_model(garbage, _patience()), pset, answers, CTX, tokenizer_id(garbage)
        )
    finally:
        garbage.stop(0)
        garbage.close()
    assert theirs.canary_tokens == mine.canary_tokens  # the same tokenizer: the same ids
    assert theirs.canary_agreement < 0.3
    assert theirs.nll_per_token > mine.nll_per_token + 2.0


def _greedy(engine: Engine, prompt: str) -> tuple[int, ...]:
    request = GenerateRequest(prompt, max_tokens=48, sampling=SamplingParams(0.0), stop=())
    return engine.complete(request, timeout=PATIENT).token_ids


def test_a_request_beside_a_probe_gets_exactly_its_tokens(
    base: Engine, answers: qp.Answers
) -> None:
    pset = qp.load_set()
    prompt = "def read_settings(path):\n"
    alone = _greedy(base, prompt)
    quiet = qp.measure(idle_model(base, _patience()), pset, answers, CTX, tokenizer_id(base))
    # the probe runs in its thread; requests go in while it is under way (each waits for one of
    # its steps at most, and the probe for the requests)
    model = idle_model(base, _patience())
    started, out = threading.Event(), {}
    inner = model.steps

    def steps(n: int):  # type: ignore[no-untyped-def]
        step = inner(n)

        def first(token: int, pos: int):  # type: ignore[no-untyped-def]
            started.set()
            return step(token, pos)

        return first

    import dataclasses

    t = threading.Thread(
        target=lambda: out.setdefault(
            "f",
            qp.measure(
                dataclasses.replace(model, steps=steps), pset, answers, CTX, tokenizer_id(base)
            ),
        )
    )
    t.start()
    assert started.wait(PATIENT)
    during = [_greedy(base, prompt) for _ in range(3)]
    t.join(PATIENT)
    assert during == [alone] * 3
    assert out["f"] == quiet


def test_a_periodic_probe_gives_way_to_a_waiting_request(base: Engine) -> None:
    prompt = "import os\n"
    alone = _greedy(base, prompt)
    base.inject_stall(PATIENT)  # the engine thread held: the request below stays waiting
    got: dict[str, tuple[int, ...]] = {}
    t = threading.Thread(target=lambda: got.setdefault("t", _greedy(base, prompt)))
    t.start()
    try:
        deadline = time.monotonic() + PATIENT
        # the request waits, or was admitted just before the stall began: either way it holds
        # the engine (the probe's run_idle sees it busy)
        while _busy(base) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _busy(base) == 1
        model = idle_model(base, Patience(0.0, threading.Event()))
        with pytest.raises(Yielded):
            model.steps(8)
    finally:
        base.end_stall()
    t.join(PATIENT)
    assert got["t"] == alone


def _busy(engine: Engine) -> int:
    s = engine.stats()
    return s.queue_depth + s.active


def test_the_prober_probes_a_new_model_once_and_keeps_two(base: Engine, tmp_path: Path) -> None:
    prober = Prober(lambda: ProbeConfig(), tmp_path)
    sha = base.info.sha256
    assert prober.latest(sha) is None
    prober.settle(base)  # an update's trial: probed now, waited for
    first = prober.latest(sha)
    assert first is not None and first.runs == 1 and first.canary_agreement == 1.0
    assert first.cpu_s > 0 and first.nll_tokens > 150
    answers = json.loads((tmp_path / "probe" / f"answers-{qp.load_set().set_id}.json").read_text())
    assert answers["origin"] == sha
    assert answers["tokenizer"] == tokenizer_id(base) and len(answers["ids"]) == len(
        answers["answers"]
    )
    pid = qp.probe_id(qp.load_set(), qp.Answers(sha, (), "", ()))
    assert first.probe_id == pid
    prober.settle(base)  # probed already: nothing runs
    assert prober.latest(sha) == first
    # the store keeps the serving model and the most recent other one
    store = qp.ProbeStore(tmp_path / "probe")
    fig = qp.Figures(5.0, 10, 1, 4)
    store.record("a" * 64, fig, pid, time.time() + 1, 0.1)
    store.record("b" * 64, fig, pid, time.time() + 2, 0.1)
    assert set(store.results()) == {"a" * 64, "b" * 64}
    again = store.record("b" * 64, fig, pid, time.time() + 3, 0.1)
    assert again.runs == 2 and again.canary_agreement == 0.25


def test_the_periodic_probe_runs_when_idle(base: Engine, tmp_path: Path) -> None:
    prober = Prober(lambda: ProbeConfig(min_idle_s=0.0, interval_s=10.0), tmp_path)
    prober.tick(base)
    deadline = time.monotonic() + PATIENT
    while prober.latest(base.info.sha256) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prober.latest(base.info.sha256) is not None
    prober.stop()


def test_files_that_do_not_parse_are_errors_and_kept(base: Engine, tmp_path: Path) -> None:
    d = tmp_path / "probe"
    d.mkdir()
    (d / "results.json").write_text('{"x": [1, 2]}')
    with pytest.raises(qp.ProbeError, match=r"results\.json is not a probe results file"):
        qp.ProbeStore(d).results()
    pset = qp.load_set()
    bad = d / f"answers-{pset.set_id}.json"
    bad.write_text(json.dumps({"origin": "me", "answers": []}))
    with pytest.raises(qp.ProbeError, match="remove it to take the serving model's answers"):
        qp.ProbeStore(d).answers(pset)
    assert bad.read_text() == json.dumps({"origin": "me", "answers": []})
    prober = Prober(lambda: ProbeConfig(min_idle_s=0.0), tmp_path)
    prober.tick(base)  # the probe is off: nothing runs, nothing is written
    prober.settle(base)
    assert prober.latest(base.info.sha256) is None
    assert (d / "results.json").read_text() == '{"x": [1, 2]}'


def test_the_probe_set_and_its_id(tmp_path: Path) -> None:
    pset = qp.load_set()
    assert 300 <= len(pset.text) <= 2000 and "def " in pset.text and len(pset.prompts) >= 3
    a, b = (
        qp.Answers("a" * 64, ("x",), "c" * 64, ((7,),)),
        qp.Answers("b" * 64, ("x",), "c" * 64, ((7,),)),
    )
    assert qp.probe_id(pset, a) != qp.probe_id(pset, b)
    assert a.forced("c" * 64) == ((7,),) and a.forced("d" * 64) == (None,)
    other = tmp_path / "p.json"
    other.write_text(json.dumps({"text": pset.text, "prompts": [], "answer_tokens": 16}))
    with pytest.raises(qp.ProbeError, match="non-empty list of non-empty prompts"):
        qp.load_set(other)
