"""Rollout gates with the real driver over a real mosquitto (docs/ROLLOUTS.md, "Gates"): boards
that are a few MQTT messages each (a retained online state, and a health with the serving
model's figures, as the device side of issue 36 publishes them) answer an update command by
reporting it committed and the target model's figures. A model that decodes slower, or scores
a worse probe NLL, halts the rollout at wave 1 naming the gate, with nothing offered beyond it;
a good one completes; an override resumes the halted one and is recorded in the store and in
`rollout status`."""

from __future__ import annotations

import getpass
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config.file import parse_broker
from agent.fleet.mqtt import MqttOptions
from agent.operator.publish import read_offer
from agent.operator.rollout.figures import DEFAULT_THRESHOLDS, Gates
from agent.operator.rollout.report import report
from agent.operator.rollout.run import create_rollout, load_rollout, run_rollout
from agent.operator.rollout.state import State, Target, parse_waves
from tests.support.broker import Mosquitto
from tests.support.fleetsim import SimModels
from tests.support.gateboards import GOOD, PREFIX, Boards
from tests.support.paths import ROOT


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path / "broker")
    yield b
    b.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> SimModels:
    return SimModels.create(tmp_path_factory.mktemp("gate-models"))


def rollout(broker: Mosquitto, models: SimModels, tmp_path: Path, after: dict[str, float],
            rk_after: dict[str, float] | None = None, **gate: object,
            ) -> tuple[Boards, Path, str]:  # fmt: skip
    bundle = models.bundle(tmp_path / "u.tar", version=1)
    _, manifest, _ = read_offer(bundle)
    boards = Boards(broker, manifest.update_id, manifest.target_model_sha256, 10, after, rk_after)
    store = tmp_path / "rollouts"
    r = create_rollout(
        store, bundle, Target("all"), parse_waves("10%,50%,100%"), prefix=PREFIX,
        wave_timeout_s=60.0, soak_s=0.0, rollout_id="r-gates", **gate,  # type: ignore[arg-type]
    )  # fmt: skip
    return boards, store, r.spec.rollout_id


def opts(broker: Mosquitto) -> MqttOptions:
    return MqttOptions(broker=parse_broker("test", "broker", broker.url), protocol="5")


@pytest.mark.parametrize(
    ("worse", "gate"),
    [({"decode": 12.0}, "decode_tok_s"), ({"nll": 3.4}, "nll"), ({"errors": 30}, "errors")],
)
def test_a_worse_model_halts_at_wave_1_naming_the_gate_and_offers_nothing_beyond(
    broker: Mosquitto, models: SimModels, tmp_path: Path, worse: dict[str, float], gate: str
) -> None:
    boards, store, rid = rollout(broker, models, tmp_path, {**GOOD, **worse})
    try:
        rep = run_rollout(opts(broker), store, rid)
        assert rep.state == "halted" and rep.waves[0].state == "halted"
        assert f"wave 1: gate failed: {gate} on pi5/aarch64" in rep.reason
        assert rep.offered == 1  # wave 1 is one device of ten; nobody beyond it ...
        assert len(boards.offered()) == 1  # ... as the boards saw it too
        assert [c.verdict for c in rep.checks if c.metric == gate] == ["fail"]
        assert {c.verdict for c in rep.checks if c.metric != gate} == {"pass"}
    finally:
        boards.close()


def test_a_good_model_passes_every_gate_and_completes(
    broker: Mosquitto, models: SimModels, tmp_path: Path
) -> None:
    boards, store, rid = rollout(broker, models, tmp_path, {**GOOD, "decode": 21.0})
    try:
        rep = run_rollout(opts(broker), store, rid)
        assert rep.state == "completed", rep.reason
        assert boards.offered() == boards.devices and set(boards.commands.values()) == {1}
        assert {c.wave for c in rep.checks} == {0, 1, 2}
        assert {c.verdict for c in rep.checks} == {"pass"}
    finally:
        boards.close()


def test_an_override_resumes_a_halted_rollout_and_is_recorded(
    broker: Mosquitto, models: SimModels, tmp_path: Path
) -> None:
    boards, store, rid = rollout(broker, models, tmp_path, {**GOOD, "decode": 12.0})
    try:
        assert run_rollout(opts(broker), store, rid).state == "halted"
        status = [sys.executable, "-m", "agent", "fleet", "rollout", "status", rid,
                  "--rollouts-dir", str(store)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        shown = subprocess.run(status, capture_output=True, text=True, env=env, cwd=ROOT,
                               timeout=120)  # fmt: skip
        assert "gate decode_tok_s on pi5/aarch64: decode p50 20 -> 12 tok/s" in shown.stdout
        assert "FAIL" in shown.stdout
        plain = subprocess.run([*status[:5], "resume", *status[6:]], capture_output=True,
                               text=True, env=env, cwd=ROOT, timeout=120)  # fmt: skip
        assert plain.returncode == 2 and plain.stderr.count("\n") == 1, plain.stderr
        assert "--override-gate decode_tok_s --reason TEXT" in plain.stderr
        (tmp_path / "agent.toml").write_text("")
        resume = [*status[:5], "resume", *status[6:], "--broker", broker.url, "--config",
                  str(tmp_path / "agent.toml")]  # fmt: skip
        refused = subprocess.run([*resume, "--override-gate", "decode_tok_s"], capture_output=True,
                                 text=True, env=env, cwd=ROOT, timeout=120)  # fmt: skip
        assert refused.returncode == 2 and "needs --reason" in refused.stderr, refused.stderr
        before = time.time()
        why = "slower but within the SLA"
        argv = [*resume, "--override-gate", "decode_tok_s", "--reason", why]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "override of gate decode_tok_s at wave 1 by " in done.stdout
        assert boards.offered() == boards.devices and set(boards.commands.values()) == {1}
        kept = load_rollout(store, rid)
        assert kept.state == State.COMPLETED and len(kept.overrides) == 1
        o = kept.overrides[0]
        who = f"{getpass.getuser()}@{socket.gethostname()}"
        assert (o.metric, o.reason, o.who, o.wave) == ("decode_tok_s", why, who, 0)
        assert before <= o.at_unix <= time.time()
        doc = report(kept).to_json()  # what `status --json` prints
        assert doc["overrides"][0]["reason"] == "slower but within the SLA"
        assert {c["verdict"] for c in doc["checks"] if c["metric"] == "decode_tok_s"} == {
            "overridden"
        }
    finally:
        boards.close()


def test_bad_gate_flags_are_one_line_and_exit_2(models: SimModels, tmp_path: Path) -> None:
    bundle = models.bundle(tmp_path / "u.tar", version=1)
    (tmp_path / "agent.toml").write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for bad, says in (
        (["--gate", "speed:0.1"], "--gate 'speed'"),
        (["--gate", "nll"], "METRIC:THRESHOLD"),
        (["--no-gate", "fast"], "--no-gate 'fast'"),
        (["--gate-min-samples", "0"], "at least 1"),
    ):
        config, store = str(tmp_path / "agent.toml"), str(tmp_path / "r")
        argv = [sys.executable, "-m", "agent", "fleet", "rollout", "start", str(bundle),
                "--target", "all", "--broker", "mqtt://127.0.0.1:9", "--config", config,
                "--rollouts-dir", store, *bad]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=120)  # fmt: skip
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert says in done.stderr
    assert not (tmp_path / "r").exists()  # nothing written


@pytest.mark.parametrize("scope", ["rollout", "class"])
def test_slower_on_one_board_class_halts_by_the_scope_policy(
    broker: Mosquitto, models: SimModels, tmp_path: Path, scope: str
) -> None:
    """Half the boards are rk3588s on which the target decodes at half speed: by default the
    rollout halts at the first wave that updated one, with no device beyond that wave offered;
    with --gate-scope class the pi5s all get it, the rk3588s no more, and it halts at the end."""
    slow = {**GOOD, "decode": 10.0}
    g = Gates(DEFAULT_THRESHOLDS, wait_s=0.0, scope=scope)
    boards, store, rid = rollout(broker, models, tmp_path, GOOD, slow, gate=g)
    try:
        rep = run_rollout(opts(broker), store, rid)
        assert rep.state == "halted" and "decode_tok_s on rk3588/aarch64" in rep.reason
        r = load_rollout(store, rid)
        v = {(c.board, c.metric): c.verdict for c in r.checks if c.wave == r.wave}
        assert v[("rk3588/aarch64", "decode_tok_s")] == "fail"
        assert v[("pi5/aarch64", "decode_tok_s")] == "pass"
        pis = [d for d in boards.devices if boards.profile(d) == "pi5"]
        rks = [d for d in boards.offered() if boards.profile(d) == "rk3588"]
        failed_at = min(c.wave for c in r.checks if c.verdict == "fail")
        assert all(d.wave <= failed_at for d in r.devices if d.device_id in rks)
        if scope == "rollout":
            assert r.wave == failed_at and all(d.wave <= failed_at for d in r.devices)
        else:
            assert r.wave == 2 and set(pis) <= set(boards.offered()) and len(rks) < 5
            assert "not offered to its class" in rep.reason
        assert set(boards.commands.values()) <= {0, 1}
    finally:
        boards.close()
