"""Issue 36's proof on real daemons (docs/ROLLOUTS.md, Gates): a bundle whose model installs and
commits cleanly but is garbage (every int8 weight random, no canary in the bundle, so nothing
on the device refuses it) halts a rollout at its first wave on default gate settings, naming
the probe's `nll` gate, and the device beyond that wave is never offered it.

Two real `edge-agent run` daemons on a real mosquitto, each probing the shipped model at start;
`edge-agent fleet rollout start` as the operator's own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.model.directory import load_model_dir
from agent.operator.rollout import plan
from agent.ota.artifact.bundle import make_bundle
from agent.pb.edge_agent.fleet.v1 import fleet_pb2 as fpb
from tests.support.broker import Mosquitto
from tests.support.paths import ROOT
from tests.system.test_fleet_link import Observer
from tests.system.test_probe_daemon import LIMIT_S, _health_with_probe
from tests.system.test_updates import (  # noqa: F401  (fixtures)
    TRUSTED,
    Models,
    _copy_variant,
    broker,
    models,
    start,
    trusted,
    write_meta,
)
from tests.unit.ota.test_update_canary import _randomize_int8

RID = "r-garbage"


@pytest.fixture(scope="module")
def garbage(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """The shipped model with every int8 weight random: finite logits, garbage text."""
    d = tmp_path_factory.mktemp("probe-garbage") / "garbage"
    _copy_variant(models.base, d, "1.2.0")
    _randomize_int8(d / "model_int8.tflite")
    write_meta(d, load_model_dir(models.base), "1.2.0")
    return d


def test_a_garbage_model_that_commits_halts_the_rollout_at_wave_1_on_the_nll_gate(
    models: Models,  # noqa: F811
    garbage: Path,
    trusted: Path,  # noqa: F811
    broker: Mosquitto,  # noqa: F811
    tmp_path: Path,
) -> None:
    base_sha = load_model_dir(models.base).variant("int8").sha256
    bad_sha = load_model_dir(garbage).variant("int8").sha256
    bundle = tmp_path / "garbage.tar"
    make_bundle(models.base, garbage, [TRUSTED], bundle, version=7)  # no canary
    # the device ranked first gets wave 1 (50% of two), the other must never be offered
    first, second = plan.ordered(RID, ["dev-g1", "dev-g2"])
    watch = Observer(broker, "garbage-watch")
    for d in (first, second):
        (tmp_path / d).mkdir()
    daemons = {d: start(tmp_path / d, models, broker, trusted, d) for d in (first, second)}
    try:
        for d in daemons:  # each has probed the shipped model: the "before" figures
            before = _health_with_probe(watch, d, base_sha).run.probe
            assert before.runs >= 1 and before.canary_agreement == 1.0
        config = tmp_path / "agent.toml"
        config.write_text("")
        argv = [sys.executable, "-m", "agent", "fleet", "rollout", "start", str(bundle),
                "--target", "all", "--waves", "50%,100%", "--soak", "1s",
                "--wave-timeout", f"{LIMIT_S:g}s", "--id", RID, "--json",
                "--broker", broker.url, "--config", str(config),
                "--rollouts-dir", str(tmp_path / "rollouts")]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert done.returncode == 1, done.stderr[-3000:]  # halted
        rep = json.loads(done.stdout)
        assert rep["state"] == "halted", rep["reason"]
        assert rep["reason"].startswith("wave 1: gate failed: nll"), rep["reason"]
        assert rep["committed"] == 1 and rep["failed"] == 0  # it installed cleanly ...
        assert [w["offered"] for w in rep["waves"]] == [1, 0]  # ... and nobody else got it
        nll = [c for c in rep["checks"] if c["metric"] == "nll"]
        assert [c["verdict"] for c in nll] == ["fail"]
        assert nll[0]["after"] > nll[0]["before"] + nll[0]["threshold"]
        # the first device serves the garbage model it committed, its probe says how bad
        after = _health_with_probe(watch, first, bad_sha)
        assert after.last_update.phase == fpb.UpdateStatus.COMMITTED
        assert after.run.probe.probe_id == after.previous.probe.probe_id
        assert after.run.probe.canary_agreement < 0.5
        # the second was never offered it and still serves the shipped model
        h = _health_with_probe(watch, second, base_sha)
        assert h.model.sha256 == base_sha and not h.last_update.update_id
    finally:
        for d in daemons.values():
            assert d.stop() == 0, d.read_log()[-3000:]
        watch.close()
