"""The default canary of `update make` on the demo model: the base model's own greedy text,
checked against a plain ai_edge_litert loop; a finite but garbage model refused when the bundle
is made, and rolled back by a real daemon when such a bundle reaches it; a fine-tune passes and
commits; `--no-canary` opts out."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from google.protobuf.json_format import MessageToDict

from agent.model.directory import demo_model_dir, load_model_dir
from agent.ota import canary
from agent.ota.artifact import keys
from agent.ota.artifact.bundle import make_bundle, read_bundle
from agent.ota.artifact.signing import verify
from agent.profile import resolve_profile
from tests.support.broker import Mosquitto
from tests.support.paths import ROOT
from tests.system.test_fleet_link import PREFIX, Observer, options
from tests.system.test_updates import (
    Models,
    _copy_variant,
    _fine_tune,
    int8_weight_spans,
    start,
    statuses,
)
from tests.unit.ota.test_bundle import _run

PROFILE = "generic-aarch64" if platform.machine() == "aarch64" else "generic-x86_64"


def _randomize_int8(path: Path) -> None:
    """Every int8 weight buffer replaced by random int8 values: finite logits, garbage text."""
    data = bytearray(path.read_bytes())
    spans = int8_weight_spans(data)
    assert spans
    rng = np.random.default_rng(11)
    for start_, length in spans:
        data[start_ : start_ + length] = rng.integers(-127, 128, length, np.int8).tobytes()
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo model's int8 variant (base 1.0.0), a fine-tune (1.1.0: ±1 on 10% of its int8
    tensors) and a garbage model (1.2.0: every int8 weight random)."""
    from tests.unit.ota.test_bundle import _write_meta

    root = tmp_path_factory.mktemp("canary-models")
    out = {}
    demo = load_model_dir(demo_model_dir())
    for name, version, change in (
        ("base", "1.0.0", None),
        ("tuned", "1.1.0", _fine_tune),
        ("garbage", "1.2.0", _randomize_int8),
    ):
        d = root / name
        _copy_variant(demo_model_dir(), d, version)
        if change is not None:
            change(d / "model_int8.tflite")
        _write_meta(d, demo, version)
        out[name] = d
    return out


def _make(dirs: dict[str, Path], tmp: Path, new: str, *extra: str) -> list[str]:
    if not (tmp / "k.key").exists():
        keys.generate(tmp / "k.key", tmp / "k.pub")
    return [
        "update", "make", str(dirs["base"]), str(dirs[new]), "--key", str(tmp / "k.key"),
        "-o", str(tmp / f"{new}.tar"), "--version", "2", "--canary-profile", PROFILE, *extra,
    ]  # fmt: skip


# ----------------------------------------------------------------------------- references


def _decode_runner(model: Path):  # type: ignore[no-untyped-def]
    """A plain ai_edge_litert Interpreter over the `decode` signature, KV fed back by hand:
    nothing of edge-agent runs. Returns step(token, pos) -> logits."""
    from ai_edge_litert.interpreter import Interpreter

    run = Interpreter(model_path=str(model)).get_signature_runner("decode")
    kv = {
        name: np.zeros(d["shape"], d["dtype"])
        for name, d in run.get_input_details().items()
        if name.startswith("kv_cache_")
    }

    def step(token: int, pos: int) -> np.ndarray:
        nonlocal kv
        res = run(tokens=np.array([[token]], np.int32), input_pos=np.array([pos], np.int32), **kv)
        kv = {k: res[k] for k in kv}
        return np.asarray(res["logits"]).reshape(-1)

    return step


def _sp(model_dir: Path) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))


# ----------------------------------------------------------------------------- update make


def test_the_default_canary_is_the_base_models_greedy_text(
    dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run([*_make(dirs, tmp_path, "tuned"), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["manifest"]["canary"]
    assert c is not None and c["expected_tokens"] == []
    seed = canary.DEFAULT_PROMPT
    assert c["prompt"].startswith(seed)

    sp, meta = _sp(dirs["base"]), load_model_dir(dirs["base"])
    vocab = sp.get_piece_size()
    step = _decode_runner(dirs["base"] / "model_int8.tflite")
    ids = [meta.bos_id, *sp.encode(seed)]
    out: list[int] = []
    for pos in range(len(ids) + canary.REFERENCE_TOKENS - 1):
        logits = step(ids[pos] if pos < len(ids) else out[-1], pos)
        if pos >= len(ids) - 1:
            out.append(int(np.argmax(logits[:vocab])))
    assert c["prompt"] == seed + sp.decode(out)  # the base model's own greedy continuation

    text_ids = [meta.bos_id, *sp.encode(c["prompt"])]
    step = _decode_runner(dirs["base"] / "model_int8.tflite")
    nll = 0.0
    for pos in range(len(text_ids) - 1):
        lg = step(text_ids[pos], pos)[:vocab].astype(np.float64)
        nll += np.log(np.exp(lg - lg.max()).sum()) + lg.max() - lg[text_ids[pos + 1]]
    base_nll = nll / (len(text_ids) - 1)
    assert c["base_mean_nll"] == pytest.approx(base_nll, rel=1e-3, abs=1e-3)
    # halfway from the base model's score to a uniform guess over the vocabulary
    assert c["max_mean_nll"] == pytest.approx((base_nll + math.log(vocab)) / 2, rel=1e-3)

    signed, _ = read_bundle(tmp_path / "tuned.tar")
    m = verify(signed, keys.load_trusted(tmp_path))
    assert m.canary.prompt == c["prompt"] and m.canary.max_mean_nll == c["max_mean_nll"]
    assert _run(["update", "inspect", str(tmp_path / "tuned.tar")]) == 0
    assert "canary      mean NLL <= " in capsys.readouterr().out


def test_update_make_refuses_a_garbage_model_unless_told_no_canary(
    dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(_make(dirs, tmp_path, "garbage")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "fails the canary" in err and "mean NLL" in err and "--no-canary" in err
    assert str(dirs["garbage"]) in err
    assert not (tmp_path / "garbage.tar").exists()

    assert _run([*_make(dirs, tmp_path, "garbage", "--no-canary"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["manifest"]["canary"] is None
    assert _run([*_make(dirs, tmp_path, "garbage", "--no-canary", "--canary-prompt", "x")]) == 2
    assert "--no-canary" in capsys.readouterr().err


def test_the_devices_check_tells_a_fine_tune_from_garbage(dirs: dict[str, Path]) -> None:
    from agent.daemon.canary import engine_model
    from agent.engine.engine import Engine

    profile = resolve_profile(PROFILE)[0]
    base = Engine.load(profile, dirs["base"])
    try:
        made = canary.reference_canary(engine_model(base))
    finally:
        base.close()
    for name, passes in (("base", True), ("tuned", True), ("garbage", False)):
        engine = Engine.load(profile, dirs[name])
        try:
            problem = canary.check(engine_model(engine), made)
        finally:
            engine.close()
        assert (problem is None) == passes, (name, problem)
        if not passes:
            assert problem is not None and "mean NLL" in problem and "bound" in problem


# ----------------------------------------------------------------------------- a real device


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    b = Mosquitto(tmp_path_factory.mktemp("canary-broker"))
    yield b
    b.stop()


def test_a_device_rolls_back_garbage_with_the_default_canary_and_commits_a_fine_tune(
    dirs: dict[str, Path], broker: Mosquitto, tmp_path: Path
) -> None:
    """What `update make` records by default, for a bundle whose new model is garbage (made
    with the library, which does not run models: a device must not rely on the operator's
    check) and for the fine-tune (made with the CLI)."""
    from agent.daemon.canary import engine_model
    from agent.engine.engine import Engine
    from agent.operator.publish import publish_update

    base = Engine.load(resolve_profile(PROFILE)[0], dirs["base"])
    try:
        made = canary.reference_canary(engine_model(base))
    finally:
        base.close()
    assert _run([*_make(dirs, tmp_path, "tuned"), "--version", "3"]) == 0  # makes k.key
    garbage = tmp_path / "garbage.tar"
    key = keys.load_private(tmp_path / "k.key")
    make_bundle(dirs["base"], dirs["garbage"], [key], garbage, version=2, canary=made)
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "k.pub").write_bytes((tmp_path / "k.pub").read_bytes())

    models = Models(dirs["base"], dirs["tuned"])
    watch = Observer(broker, "canary-watch")
    d = start(tmp_path, models, broker, trusted, "dev-canary-default")
    try:
        result = publish_update(
            options(broker), PREFIX, garbage, ["dev-canary-default"], timeout_s=120
        )
        final = result["dev-canary-default"].status
        assert final is not None and final.phase == final.ROLLED_BACK, final
        assert "canary" in final.message and "mean NLL" in final.message, final.message
        assert d.client().info()["version"] == "1.0.0"

        # the fine-tune through the operator's command line, as JSON lines: every status the
        # device published on update/status (seen by an independent subscriber) once, none twice
        since = len(statuses(watch, "dev-canary-default"))
        config = tmp_path / "operator.toml"
        config.write_text("")
        argv = ["fleet", "publish-update", str(tmp_path / "tuned.tar"), "--device"]
        argv += ["dev-canary-default", "--broker", broker.url, "--config", str(config)]
        done = subprocess.run(
            [sys.executable, "-m", "agent", *argv, "--json", "--timeout", "120"],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        *printed, summary = [json.loads(line) for line in done.stdout.strip().split("\n")]
        assert summary["summary"]["committed"] == ["dev-canary-default"]
        assert d.client().info()["version"] == "1.1.0"
        deadline = time.monotonic() + 10
        while not any(s.phase == s.COMMITTED for s in statuses(watch, "dev-canary-default")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        reported = statuses(watch, "dev-canary-default")[since:]
        distinct = list({s.SerializeToString(): s for s in reported}.values())
        want = [MessageToDict(s, preserving_proto_field_name=True) for s in distinct]
        got = [
            {k: v for k, v in doc.items() if k != "device" and v not in ("", "0", 0)}
            for doc in printed
        ]
        assert got == want
        names = [doc["phase"] for doc in printed]
        assert names.count("RECEIVED") == 1 and names[-1] == "COMMITTED", names
    finally:
        assert d.stop() == 0, d.read_log()
        watch.close()
